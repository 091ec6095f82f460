"""Decoder-only language models trained with tape-train, for Hugging Face ``transformers``.

Standalone (torch + transformers only). One Llama decoder whose positional encoding is
``config.pe``:

    tape    a positional state E = (E⁰, E¹), (b, M, N, D) each, starts as RoPE's cos/sin
            tables and is updated by every block but the last: after attention
            E ← E + W_pa ×_heads (A·E) with the attention's own softmax A, after the MLP
            E_n ← E_n + K_n·E_n, K_n = W_dn·diag(silu(y_n·W_x))·W_up (y: the MLP output).
            q and k are modulated as q̃ = q⊙E⁰ + rot(q)⊙E¹ (arXiv 2501.00712).
    rope    rotary (randpe decodes as rope: plain positions); xpos: rotary with the scale
            ζ^(±n/scale_base) folded into the tables.
    alibi / fire / t5   an additive logit bias; nope: none.

Parameter names are tape-train's, so the weights are the ones it trained. Positions are
counted from the ``attention_mask`` (left padding gives every row positions 0, 1, ...), as
in training where every sequence starts at position 0. The key/value cache is a
``DynamicCache`` whose value holds [v | E⁰ | E¹] for TAPE blocks (one softmax serves all
three); incremental decoding equals the full forward.
"""

import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tape import TapeConfig
from .export_check import verify as verify_export

# The output's cache field: ``cache`` from transformers 5.24 on (whose ``generate`` reads only
# that), ``past_key_values`` before.
_CACHE_FIELD = ("cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
                else "past_key_values")

_BIAS = ("alibi", "fire", "t5")


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def modulate(x, cos, sin):
    """x̃ = x⊙cos + rot(x)⊙sin; x (b, H, N, D), tables broadcastable."""
    return x * cos + rotate_half(x) * sin


def rotary_tables(positions, head_dim, theta, dtype):
    """cos, sin (b, 1, N, D) of positions (b, N), computed in fp32 (fp64 models: fp64)."""
    work = torch.promote_types(torch.float32, dtype)
    exponents = torch.arange(0, head_dim, 2, device=positions.device).to(work) / head_dim
    angles = positions.to(work)[..., None] * (1.0 / theta ** exponents)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def xpos_tables(positions, config, sign, dtype):
    work = torch.promote_types(torch.float32, dtype)
    cos, sin = rotary_tables(positions, config.head_dim, config.rotary_theta, work)
    half = config.head_dim // 2
    zeta = (torch.arange(half, device=positions.device, dtype=torch.float32) / half + 0.4) / 1.4
    zeta = torch.cat((zeta, zeta)).to(work)
    scale = zeta ** (sign * positions.to(work)[:, None, :, None] / config.xpos_scale_base)
    return (cos * scale).to(dtype), (sin * scale).to(dtype)


def alibi_slopes(num_heads):
    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(p)
    if p < num_heads:
        slopes += power_of_two(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def t5_bucket(distance, num_buckets, max_distance):
    n = distance.clamp(min=0).long()
    exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype != torch.float64 else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PositionBias(nn.Module):
    """The model-level part of a bias encoding (FIRE's MLP and c, L; T5's bucket table)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        if config.pe == "fire":
            self.mlp = nn.Sequential(nn.Linear(1, config.fire_hidden), nn.ReLU(),
                                     nn.Linear(config.fire_hidden, config.num_attention_heads))
            self.c = nn.Parameter(torch.full((1,), 0.1))
            self.threshold = nn.Parameter(torch.full((1,), 512.0))
        elif config.pe == "t5":
            self.rel_bias = nn.Embedding(config.t5_num_buckets, config.num_attention_heads)

    def forward(self, q_pos, k_pos, dtype):
        """Additive logits (b|1, H, Nq, Nk) for positions q_pos (b|1, Nq), k_pos (b|1, Nk)."""
        dist = q_pos.float()[..., :, None] - k_pos.float()[..., None, :]
        pe = self.config.pe
        if pe == "alibi":
            slopes = alibi_slopes(self.config.num_attention_heads).to(q_pos.device)
            return (-slopes[:, None, None] * dist[:, None]).to(dtype)
        if pe == "t5":
            buckets = t5_bucket(dist, self.config.t5_num_buckets, self.config.t5_max_distance)
            return self.rel_bias(buckets).permute(0, 3, 1, 2).to(dtype)
        psi = lambda x: torch.log(self.c.abs() * x + 1.0)  # noqa: E731
        denom = psi(torch.maximum(q_pos.float(), self.threshold.abs()))[..., None]
        ratio = (psi(dist.clamp(min=0)) / denom).to(self.mlp[0].weight.dtype)
        return self.mlp(ratio[..., None]).permute(0, 3, 1, 2).to(dtype)


class TapeStateUpdate(nn.Module):
    """TAPE's per-block parameters: W_pa (M, M), W_x (C → P), W_up (P, M), W_dn (M, P)."""

    def __init__(self, config):
        super().__init__()
        m, p = config.num_attention_heads, config.tape_position_size
        self.rowsum = config.tape_post_attn == "rowsum"
        self.w_pa = nn.Parameter(torch.zeros(m, m))
        self.w_x = nn.Linear(config.hidden_size, p, bias=False)
        self.w_up = nn.Parameter(torch.zeros(p, m))
        self.w_dn = nn.Parameter(torch.zeros(m, p))

    def after_attention(self, e, e_hat):
        if self.rowsum:
            return e + self.w_pa.sum(dim=1).to(e_hat.dtype)[:, None, None] * e_hat
        return e + torch.einsum("mk,bknd->bmnd", self.w_pa.to(e_hat.dtype), e_hat)

    def after_mlp(self, state, y):
        m = self.w_pa.shape[0]
        g = F.silu(self.w_x(y))                                          # (b, N, P)
        z = (self.w_dn.t()[:, :, None] * self.w_up[:, None, :]).reshape(-1, m * m)
        k = (g @ z.to(g.dtype)).view(*g.shape[:-1], m, m)               # K_n, (b, N, M, M)
        return tuple(e + torch.einsum("bnmk,bknd->bmnd", k, e) for e in state)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        d = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, config.hidden_size, bias=False)

    def _heads(self, x, proj):
        b, n, _ = x.shape
        return proj(x).view(b, n, -1, self.config.head_dim).transpose(1, 2)

    def forward(self, x, pos, layer_idx, cache, state, need_e_hat):
        """x (b, N, C) → (out (b, N, C), (Ê⁰, Ê¹) or None). ``pos``: the forward's position
        context (tables, bias, mask); ``state``: TAPE's (E⁰, E¹) for the new tokens."""
        b, n, _ = x.shape
        q, k, v = (self._heads(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
        d = v.shape[-1]
        if state is not None:
            e0, e1 = (e.expand(b, *e.shape[1:]) for e in state)
            q, k = modulate(q, e0, e1), modulate(k, e0, e1)
            if need_e_hat:
                v = torch.cat((v, e0, e1), dim=-1)
        elif pos["q_tables"] is not None:
            q, k = modulate(q, *pos["q_tables"]), modulate(k, *pos["k_tables"])
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = pos["mask"]
        if pos["bias"] is not None:
            mask = pos["bias"].to(q.dtype).masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o, e_hat = out[..., :d], None
        if state is not None and need_e_hat:
            e_hat = (out[..., d:2 * d], out[..., 2 * d:])
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1)), e_hat


class TapeBlock(nn.Module):
    def __init__(self, config, carries_state):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.pos_update = TapeStateUpdate(config) if carries_state else None

    def forward(self, x, pos, layer_idx, cache, state):
        attn_out, e_hat = self.attn(self.attn_norm(x), pos, layer_idx, cache, state,
                                    need_e_hat=self.pos_update is not None)
        x = x + attn_out
        y = self.mlp(self.mlp_norm(x))
        if self.pos_update is not None:
            state = tuple(self.pos_update.after_attention(e, eh) for e, eh in zip(state, e_hat))
            state = self.pos_update.after_mlp(state, y)
        else:
            state = None
        return x + y, state


class TapePreTrainedModel(PreTrainedModel):
    config_class = TapeConfig
    base_model_prefix = "tape"  # no wrapped base model: parameter names are tape-train's
    _no_split_modules = ["TapeBlock"]
    _supports_cache_class = True  # transformers 4.x: generate() passes a DynamicCache
    supports_gradient_checkpointing = False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loading, after the export's files are checked against the record in
        its ``export.json`` (``export_check.py``): a tensor removed or with bytes changed, a
        file cut short or gone, is refused naming the file and the tensor, where transformers
        alone would start the missing weights at random with a warning. A local directory is
        checked (each file read and hashed once: 1.6 s for the 2.5 GB of a bf16 `1b` export on
        a 2-core AMD EPYC, from the page cache); a Hub id is not."""
        path = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        # An export of tape-train without its record is named; a directory that never was
        # one (saved again by save_pretrained, which writes no export.json) is not.
        if (os.path.isdir(path) and not verify_export(path)
                and os.path.isfile(os.path.join(path, "export.json"))):
            logging.getLogger(__name__).warning(
                "%s: no integrity record in export.json (exported before checksums): its "
                "weights are loaded unchecked", path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()


class TapeForCausalLM(TapePreTrainedModel, GenerationMixin):
    """``forward(input_ids, attention_mask=None, past_key_values=None, labels=None, ...)``
    → ``CausalLMOutputWithPast`` (logits (b, N, V); loss: mean next-token NLL of ``labels``
    shifted by one, −100 ignored, as every Hugging Face causal LM, or its sum over
    ``num_items_in_batch`` when given; hidden_states with ``output_hidden_states``)."""

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pe = PositionBias(config)
        tape = config.pe == "tape"
        self.layers = nn.ModuleList(
            TapeBlock(config, carries_state=tape and i < config.num_hidden_layers - 1)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def _positions(self, n, device, attention_mask, past):
        """Layer-0 positions of the n new tokens (b|1, N), of all keys (b|1, Nk), key mask."""
        if attention_mask is None:
            k_pos = torch.arange(past + n, device=device)[None]
            return k_pos[:, past:], k_pos, None
        if attention_mask.dim() != 2 or attention_mask.shape[-1] < past + n:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)}: it must be (batch, "
                f"tokens in the cache + new tokens), here at least {past} + {n} columns (the "
                f"mask of the whole sequence so far, as generate() passes it)")
        valid = attention_mask[:, -(past + n):].bool()
        k_pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        return k_pos[:, past:], k_pos, valid

    @staticmethod
    def _check_position_ids(position_ids, q_pos, valid, past):
        """Positions are counted from the attention mask; ``position_ids`` (which generate()
        passes in transformers 4.x) must agree with them on every unmasked token, else the
        forward refuses rather than silently ignore them."""
        given = position_ids.to(q_pos.device)
        try:
            agree = len(torch.broadcast_shapes(given.shape, q_pos.shape)) == 2
        except RuntimeError:  # shapes that cannot be compared
            agree = False
        if agree:
            same = given == q_pos
            if valid is not None:
                same = same | ~valid[:, past:]
            agree = bool(same.all())
        if not agree:
            raise ValueError(
                "position_ids that differ from the positions TapeForCausalLM counts from "
                "attention_mask (0, 1, ... over the unmasked tokens, continuing after the "
                "cache, as in training) are not supported: offsets and packed sequences "
                "cannot be honoured. Leave position_ids out and pass attention_mask (left "
                "padding)")

    def _context(self, q_pos, k_pos, valid, dtype):
        cfg = self.config
        nq, nk = q_pos.shape[-1], k_pos.shape[-1]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q_pos.device).tril(nk - nq)[None, None]
        if valid is not None:
            mask = mask & valid[:, None, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # padding queries: keep them finite
        pos = {"mask": mask, "bias": None, "q_tables": None, "k_tables": None}
        if cfg.pe in ("rope", "randpe"):
            pos["q_tables"] = pos["k_tables"] = rotary_tables(q_pos, cfg.head_dim,
                                                              cfg.rotary_theta, dtype)
        elif cfg.pe == "xpos":
            pos["q_tables"] = xpos_tables(q_pos, cfg, 1.0, dtype)
            pos["k_tables"] = xpos_tables(q_pos, cfg, -1.0, dtype)
        elif cfg.pe in _BIAS:
            pos["bias"] = self.pe(q_pos, k_pos, dtype)
        return pos

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None,
                logits_to_keep=0, cache=None, **kwargs):
        # transformers >= 5.24 passes the cache as ``cache`` (``past_key_values`` before).
        past_key_values = cache if past_key_values is None else past_key_values
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        elif isinstance(past_key_values, (tuple, list)):
            past_key_values = DynamicCache.from_legacy_cache(past_key_values)
        cache = past_key_values if isinstance(past_key_values, Cache) else None
        past = cache.get_seq_length() if cache is not None else 0
        q_pos, k_pos, valid = self._positions(inputs_embeds.shape[1], inputs_embeds.device,
                                              attention_mask, past)
        if position_ids is not None:
            self._check_position_ids(position_ids, q_pos, valid, past)
        if output_attentions:
            raise ValueError("output_attentions=True is not supported: TapeForCausalLM computes "
                             "attention with scaled_dot_product_attention, which returns no "
                             "attention weights")
        x = inputs_embeds
        hidden = [x] if output_hidden_states else None
        pos = self._context(q_pos, k_pos, valid, x.dtype)
        state = None
        if self.config.pe == "tape":
            cos, sin = rotary_tables(q_pos, self.config.head_dim, self.config.rotary_theta,
                                     x.dtype)
            shape = (cos.shape[0], self.config.num_attention_heads, *cos.shape[2:])
            state = (cos.expand(shape), sin.expand(shape))
        for i, layer in enumerate(self.layers):
            x, state = layer(x, pos, i, cache, state)
            if hidden is not None and i < len(self.layers) - 1:
                hidden.append(x)
        x = self.norm(x)
        if hidden is not None:  # as Llama: the embeddings, each block's output, the last normed
            hidden.append(x)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            # transformers 5's Trainer passes num_items_in_batch (the labelled tokens of all
            # accumulated micro-batches) to any forward taking **kwargs and then leaves the
            # loss unscaled: the sum over those tokens is divided by it, as Llama does.
            num_items = kwargs.get("num_items_in_batch")
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                   labels[:, 1:].flatten().to(logits.device), ignore_index=-100,
                                   reduction="mean" if num_items is None else "sum")
            if num_items is not None:
                loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items)
                               else num_items)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      hidden_states=tuple(hidden) if hidden else None,
                                      **{_CACHE_FIELD: cache if use_cache else None})
