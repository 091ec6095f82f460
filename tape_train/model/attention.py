"""Multi-head attention with pluggable positional encodings and attention backends.

Backends (``ModelConfig.attn_backend``):
    eager   plain matmul + fp32 softmax; runs in any dtype, fp64 included (the reference).
    sdpa    ``torch.nn.functional.scaled_dot_product_attention``. For TAPE one call with the
            3D-wide value [v | E⁰ | E¹]: one softmax for all three outputs; on CUDA a value
            wider than the flash/cuDNN kernels take (D = 128: 384) goes in D-wide parts.
    flash   flash-attn 2 (CUDA, fp16/bf16) for encodings without a dense bias.
    triton  the fused TAPE kernel of ``tape_train.kernels`` (CUDA, or Triton's interpreter).
    blocked causal attention in query blocks on plain GEMMs (``blocked_attention``): logits at
            the key width, value at any width, saves only output and LSE. No dense bias.
    auto    the fastest correct one for the device, dtype and encoding.

The attention *core* (``AttentionCore``) sees already-modulated q̃, k̃ and the (possibly
extended) value; ``tape_train.parallel`` wraps it for sequence parallelism from outside.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from tape_train.model.blocked_attention import blocked_attention
from tape_train.model.pe.base import PositionContext, apply_rotary

_HALF_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn's dtypes; `blocked` beats CPU SDPA


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(requested: str, pe, device: torch.device, dtype: torch.dtype,
                    has_cache: bool, plain_value: bool = False, has_bias: bool = False) -> str:
    """Pick the backend for one call. Explicit requests that cannot run raise.

    ``plain_value``: the block attends with the plain value even though the encoding's is
    wider (TAPE's last block): it may use flash-attn like RoPE, and no fused kernel is needed.
    ``has_bias``: the encoding adds a dense logit bias (ALiBi, FIRE, T5).

    On CUDA, ``auto`` picks the fused kernel for TAPE's 3D-wide value where it measured
    fastest (``fused_kernel_preferred``; SDPA elsewhere), flash-attn for flash-capable encodings
    in fp16/bf16. On CPU, ``auto`` picks ``blocked`` for TAPE's 3D-wide value in any dtype and
    for every bias-free encoding in fp16/bf16 (PyTorch's CPU flash kernel is slower there,
    measured in docs/model.md), else ``sdpa``; decoding with a cache always uses ``sdpa``.
    """
    spec = pe.spec
    wide_value = spec.value_width > 1 and not plain_value  # [v | E⁰ | E¹]: the fused kernel
    flash_ok = spec.flash_ok or (plain_value and not spec.dense_bias)
    on_cuda = device.type == "cuda"
    flash_here = on_cuda and dtype in _HALF_DTYPES and flash_attn_installed()
    if requested == "auto":
        if (on_cuda and wide_value and not has_cache and _triton_ok(device)
                and fused_kernel_preferred(device, pe.cfg.head_dim)):
            return "triton"
        if flash_ok and flash_here:
            return "flash"
        if not on_cuda and not has_cache and not has_bias and (wide_value or dtype in _HALF_DTYPES):
            return "blocked"
        return "sdpa"
    if requested == "blocked":
        if has_bias:
            raise ValueError(f"model.attn_backend=blocked has no dense logit bias; "
                             f"pe={pe.cfg.pe} should use sdpa or eager")
        return "sdpa" if has_cache else "blocked"
    if requested == "triton" and plain_value:
        return "flash" if flash_here else "sdpa"
    if requested == "flash":
        if not flash_ok:
            raise ValueError(f"model.attn_backend=flash does not support pe="
                             f"{pe.cfg.pe} (needs a dense bias or a 3D-wide value); "
                             f"use sdpa{' or triton' if wide_value else ''}")
        if not flash_here:
            raise RuntimeError("model.attn_backend=flash needs flash-attn installed "
                               "(pip install 'tape-train[cuda]'), a CUDA device and fp16/bf16")
    if requested == "triton":
        if not wide_value:
            raise ValueError(f"model.attn_backend=triton is the fused TAPE kernel; "
                             f"pe={pe.cfg.pe} should use sdpa or flash")
        if has_cache:
            return "sdpa"  # decoding: a handful of queries, no kernel needed
        if not _triton_ok(device):
            raise RuntimeError("model.attn_backend=triton needs CUDA (or TRITON_INTERPRET=1)")
    return requested


# (compute capability major, head dim) where `auto` gives TAPE's attention to SDPA (the value
# in key-width parts: flash/cuDNN) rather than the fused kernel, by side-by-side measurement.
# H100, bf16, causal, forward+backward (docs/kernel.md, "Measured on an H100"): at D = 128 three
# SDPA calls took 6.42 / 8.86 / 24.1 ms at N = 2k / 4k / 16k where the fused kernel took 11.9 /
# 21.6 / 80.9 (static tiles) and its tuned tiles' summed kernel times project ≈ 11.6 ms at 4k.
# At D = 64 the tuned kernel projects faster than SDPA (≈ 8.4 vs 10.4 ms at 4k). Architectures
# not measured keep the fused kernel; sm_90 stands for every newer one (as its tile table).
SDPA_PREFERRED = {(9, 128)}


def fused_kernel_preferred(device: torch.device, head_dim: int) -> bool:
    """Whether ``auto`` runs TAPE's attention on the fused kernel on CUDA ``device`` at
    ``head_dim`` (else SDPA). Deterministic runs always do: its dq has an atomic-free mode,
    SDPA's flash/cuDNN backward has none."""
    if torch.are_deterministic_algorithms_enabled():
        return True
    major = torch.cuda.get_device_capability(device)[0]
    return (min(major, 9), head_dim) not in SDPA_PREFERRED


def _triton_ok(device: torch.device) -> bool:
    try:
        from tape_train.kernels import triton_available
    except ImportError:
        return False
    return triton_available(device)


def causal_mask(nq: int, nk: int, device) -> torch.Tensor:
    """(Nq, Nk) bool, True = may attend; queries are the last Nq of the Nk positions."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)


def eager_attention(q, k, v, bias=None, scale=None) -> torch.Tensor:
    """Causal softmax attention: q (b, H, Nq, D), k (b, Hkv, Nk, D), v (b, Hkv, Nk, Dv).

    Logits and softmax in fp32 (fp64 stays fp64); output in v's dtype, (b, H, Nq, Dv).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    logits = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias.to(acc)
    logits = logits.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v.to(acc)).to(v.dtype)


#: The widest head PyTorch's flash and cuDNN SDPA kernels take; a wider value falls to slower ones.
SDPA_FLASH_MAX_WIDTH = 256


def split_value_on_device(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`sdpa_attention` attends to ``v`` in key-width parts: on CUDA, when the
    value (TAPE's [v | E⁰ | E¹], 3·D wide) is wider than the flash/cuDNN kernels take. On an
    H100 at D = 128 (value 384 wide) one call took 41 ms where three took 8.9 ms (N = 4096,
    docs/kernel.md)."""
    d, dv = q.shape[-1], v.shape[-1]
    return q.device.type == "cuda" and dv > SDPA_FLASH_MAX_WIDTH and dv > d and dv % d == 0


def sdpa_attention(q, k, v, bias=None, scale=None) -> torch.Tensor:
    """Same contract as :func:`eager_attention`, through PyTorch SDPA."""
    if split_value_on_device(q, v):
        return sdpa_split_value(q, k, v, bias, scale)
    return _sdpa(q, k, v, bias, scale)


def sdpa_split_value(q, k, v, bias=None, scale=None) -> torch.Tensor:
    """:func:`sdpa_attention` with the value in key-width parts, one SDPA call each: the same
    softmax weights applied to each part (recomputed per call), outputs concatenated; autograd
    sums the q/k gradients of all parts."""
    return torch.cat([_sdpa(q, k, part, bias, scale) for part in v.split(q.shape[-1], dim=-1)],
                     dim=-1)


def _sdpa(q, k, v, bias=None, scale=None) -> torch.Tensor:
    nq, nk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    d, dv = q.shape[-1], v.shape[-1]
    if dv > d and q.device.type == "cpu" and bias is None and nq == nk:
        # TAPE's 3D-wide value: PyTorch's CPU flash kernel needs equal q/k/v widths and
        # otherwise falls back to the ~2x slower math path. Zero-padding q̃ and k̃ leaves every
        # logit unchanged (the padded channels contribute 0) and keeps one fused call.
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        q = F.pad(q, (0, dv - d))
        k = F.pad(k, (0, dv - d))
    if bias is None and nq == nk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    if bias is None and nq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    mask = causal_mask(nq, nk, q.device)
    if bias is None:
        attn_mask = mask
    else:
        attn_mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                          enable_gqa=gqa)


def flash_attention(q, k, v, scale=None, alibi_slopes=None) -> torch.Tensor:
    """flash-attn 2 (imported lazily); tensors head-major in, head-major out. Its backward is
    atomic-free (deterministic) when torch's deterministic algorithms are on."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          softmax_scale=scale, causal=True,
                          alibi_slopes=None if alibi_slopes is None else alibi_slopes.float(),
                          deterministic=torch.are_deterministic_algorithms_enabled())
    return out.transpose(1, 2)


def value_widths(v) -> tuple[int, ...] | None:
    """The last-dim widths of a value given in parts (TAPE's (v, E⁰, E¹)), None for one tensor."""
    return tuple(t.shape[-1] for t in v) if isinstance(v, (tuple, list)) else None


def join_value(v) -> torch.Tensor:
    """One value tensor from parts (concatenated on the last dim); a tensor is returned as is."""
    return torch.cat(tuple(v), dim=-1) if isinstance(v, (tuple, list)) else v


def split_like(out: torch.Tensor, widths: tuple[int, ...] | None):
    """The output of a joined value cut back into its parts (views), or ``out`` itself."""
    return out if widths is None else out.split(widths, dim=-1)


class AttentionCore(nn.Module):
    """softmax(q̃k̃ᵀ/√D + bias)·V on already-modulated inputs; the backend is chosen per call.

    ``v`` is one tensor (b, Hkv, Nk, Dv) or TAPE's value in parts (v, E⁰, E¹); the output is
    one tensor (b, H, Nq, Dv) or the matching parts. Backend ``triton`` is TAPE's fused kernel:
    there q and k arrive *unmodulated* and the parts go to it as they are (no concatenation in
    or out: Ê⁰, Ê¹ come back as the kernel's own contiguous outputs). Every other backend
    attends to the concatenated [v | E⁰ | E¹] with one softmax and returns views of its output.
    Sequence parallelism replaces this module on every layer (``tape_train.parallel``) with the
    same contract, whatever the backend.
    """

    def forward(self, q, k, v, *, backend: str, bias=None, alibi_slopes=None):
        if backend == "triton":
            from tape_train.kernels import tape_attention_triton

            if value_widths(v) is None:       # one [v | E⁰ | E¹] tensor (sequence parallel)
                d = q.shape[-1]
                return torch.cat(tape_attention_triton(
                    q, k, *v.split((v.shape[-1] - 2 * d, d, d), dim=-1)), dim=-1)
            return tape_attention_triton(q, k, *v)
        widths = value_widths(v)
        return split_like(self._joined(q, k, join_value(v), backend, bias, alibi_slopes), widths)

    @staticmethod
    def _joined(q, k, v, backend, bias, alibi_slopes) -> torch.Tensor:
        if backend == "eager":
            return eager_attention(q, k, v, bias)
        if backend == "blocked":
            return blocked_attention(q, k, v)
        if backend == "flash":
            return flash_attention(q, k, v, alibi_slopes=alibi_slopes)
        return sdpa_attention(q, k, v, bias)


class Attention(nn.Module):
    """Attention sublayer: projections, positional modulation, cache, core, output projection.

    Parameter names follow Llama (``q_proj``…``o_proj``) so TP patterns and HF mapping are exact.
    """

    def __init__(self, cfg, pe) -> None:
        super().__init__()
        self.cfg = cfg
        self.pe = [pe]  # shared model-level module; a list keeps it out of this module's params
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        self.core = AttentionCore()

    def _heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, -1, self.cfg.head_dim).transpose(1, 2)  # (b, H, N, D)

    def forward(self, x: torch.Tensor, ctx: PositionContext, cache: dict | None = None,
                tape_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                need_e_hat: bool = True):
        """x (b, N, C) → (out (b, N, C), (Ê⁰, Ê¹) or None).

        ``cache``: this layer's dict, extended in place with k̃, v (and E⁰, E¹ for TAPE).
        ``tape_state``: this layer's input E⁰, E¹ for the new tokens, (b|1, M, N, D).
        ``need_e_hat``: False in TAPE's last block — E only modulates q and k there, and the
        attention is a plain one over v (any backend a rotary encoding may use).
        """
        b, n, _ = x.shape
        q, k, v = self._heads(x, self.q_proj), self._heads(x, self.k_proj), self._heads(x, self.v_proj)
        plain = tape_state is None or not need_e_hat
        backend = resolve_backend(self.cfg.attn_backend, self.pe[0], x.device, x.dtype,
                                  cache is not None, plain_value=plain,
                                  has_bias=ctx.bias is not None)
        e_hat = None
        if tape_state is not None and not need_e_hat:
            q, k = apply_rotary(q, *tape_state), apply_rotary(k, *tape_state)
            if cache is not None:
                k, v = _extend(cache, k=k, v=v)
            o = self.core(q, k, v, backend=backend)
        elif tape_state is not None:
            e0, e1 = (e.expand(b, *e.shape[1:]) for e in tape_state)
            if backend != "triton":  # the fused kernel modulates q and k itself
                q, k = apply_rotary(q, e0, e1), apply_rotary(k, e0, e1)
            if cache is not None:
                k, v, e0, e1 = _extend(cache, k=k, v=v, e0=e0, e1=e1)
            o, e0_hat, e1_hat = self.core(q, k, (v, e0, e1), backend=backend)
            e_hat = (e0_hat, e1_hat)
        else:
            if ctx.q_tables is not None:
                q, k = apply_rotary(q, *ctx.q_tables), apply_rotary(k, *ctx.k_tables)
            if cache is not None:
                k, v = _extend(cache, k=k, v=v)
            o = self.core(q, k, v, backend=backend, bias=ctx.bias, alibi_slopes=ctx.alibi_slopes)
        o = o.transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(o), e_hat


def _extend(cache: dict, **new: torch.Tensor) -> list[torch.Tensor]:
    """Append new keys/values along the sequence axis (dim 2) and return the full tensors."""
    out = []
    for name, t in new.items():
        full = t if name not in cache else torch.cat((cache[name], t), dim=2)
        cache[name] = full
        out.append(full)
    return out
