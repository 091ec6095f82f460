"""TAPE (spec §2): a positional state E = (E⁰, E¹) carried and updated by every layer.

:class:`TapeEncoding` builds the layer-0 state (RoPE's cos/sin tables, one per head);
:class:`TapeStateUpdate` is the per-layer part: the head mixing after attention (W_pa) and the
token-conditioned head mixing after the MLP (K_n = W_dn·diag(g_n)·W_up).
Shapes: E^c is (b|1, M, N, D); the batch axis stays 1 until a layer makes it token-dependent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tape_train.model.pe.base import PositionalEncoding, PositionContext, rotary_tables
from tape_train.model.pe.tape_update import TapeUpdateFunction, mixing_weights


class TapeEncoding(PositionalEncoding):
    def layer0_positions(self, batch, length, offset, device) -> torch.Tensor:
        positions = super().layer0_positions(batch, length, offset, device)
        if self.training and self.cfg.tape_train_offset:
            # Parity with the released code: a random global shift in [0, 2N]. By T2 this is
            # a no-op up to rounding; torch's global RNG keeps it reproducible.
            positions = positions + int(torch.randint(0, 2 * length + 1, ()))
        return positions

    def initial_state(self, q_pos: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer-0 E⁰, E¹: (b|1, M, N, D), RoPE tables expanded over heads (no copy)."""
        cos, sin = rotary_tables(q_pos, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        shape = (cos.shape[0], self.cfg.num_heads, cos.shape[2], cos.shape[3])
        return cos.expand(shape), sin.expand(shape)

    def context(self, q_pos, k_pos, dtype) -> PositionContext:
        return PositionContext(q_pos=q_pos, k_pos=k_pos)

    def state_update(self) -> "TapeStateUpdate":
        return TapeStateUpdate(self.cfg)


class TapeStateUpdate(nn.Module):
    """Per-layer TAPE parameters and the two updates of E.

    Parameters (M heads, P = ``tape_position_size``, C hidden):
        w_pa: (M, M) head mixing of the attended state, zero-init.
        w_x:  Linear C → P, the gate's input projection (reads the MLP output y).
        w_up: (P, M), zero-init.  w_dn: (M, P).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg
        m, p = cfg.num_heads, cfg.tape_position_size
        self.w_pa = nn.Parameter(torch.zeros(m, m))
        self.w_x = nn.Linear(cfg.hidden_size, p, bias=False)
        self.w_up = nn.Parameter(torch.zeros(p, m))
        self.w_dn = nn.Parameter(torch.empty(m, p))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_x.weight, std=self.cfg.init_std)
        nn.init.normal_(self.w_dn, std=self.cfg.init_std)
        nn.init.zeros_(self.w_up)
        nn.init.zeros_(self.w_pa)

    def forward(self, state: tuple[torch.Tensor, ...], e_hat: tuple[torch.Tensor, ...],
                y: torch.Tensor) -> tuple:
        """Both updates of one block: ``after_attention`` per table, then ``after_mlp``.

        The block calls the module, not the methods: DeepSpeed ZeRO-3 gathers a module's
        partitioned parameters in its forward hooks, and under ``torch.compile`` nothing else
        does (eagerly, ZeRO-3 also gathers a parameter on attribute access; a compiled graph
        reads the attribute without that).
        """
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # Training: one autograd node (tape_update.py) with the same values; it keeps two
            # fewer E-sized tensors for the backward. Inference and torch.compile (Inductor
            # fuses the plain form itself) run the plain form below.
            dtype = e_hat[0].dtype
            g = F.silu(self.w_x(y)).to(dtype)
            return TapeUpdateFunction.apply(
                *(e.to(dtype) for e in state), *e_hat, g, self.w_pa.to(dtype),
                self.w_up.to(dtype), self.w_dn.to(dtype), self.cfg.tape_post_attn == "headmix")
        return self.plain_update(state, e_hat, y)

    def plain_update(self, state: tuple[torch.Tensor, ...], e_hat: tuple[torch.Tensor, ...],
                     y: torch.Tensor) -> tuple:
        """Both updates through plain autograd (``after_attention`` per table, then
        ``after_mlp``): what inference and torch.compile run, and the node's reference."""
        state = tuple(self.after_attention(e, eh) for e, eh in zip(state, e_hat))
        return self.after_mlp(state, y)

    def after_attention(self, e: torch.Tensor, e_hat: torch.Tensor) -> torch.Tensor:
        """E^c ← E^c + W_pa ×_heads Ê^c. e (b|1, M, N, D), e_hat (b, M, N, D).

        The head mixing is one batched GEMM over Ê viewed as (b, M, N·D) with W_pa broadcast
        (stride 0): a contiguous Ê (the fused kernel's output) is used in place, not copied
        for the backward (an einsum would keep a permuted copy).
        """
        if self.cfg.tape_post_attn == "rowsum":
            gate = self.w_pa.sum(dim=1).to(e_hat.dtype)           # s_m = Σ_m' W_pa[m, m']
            return e + gate[:, None, None] * e_hat
        b, m = e_hat.shape[:2]
        w = self.w_pa.to(e_hat.dtype).expand(b, m, m)
        return e + torch.bmm(w, e_hat.reshape(b, m, -1)).view(e_hat.shape)

    def mixing_matrices(self, y: torch.Tensor) -> torch.Tensor:
        """K_n = W_dn·diag(g_n)·W_up with g = silu(y·W_x): y (b, N, C) → (b, N, M, M).

        K_n[m, k] = Σ_p g_n[p]·W_dn[m, p]·W_up[p, k] is linear in g_n, so all tokens' K_n are
        one GEMM g·Z with Z[p, (m, k)] = W_dn[m, p]·W_up[p, k] — not b·N tiny batched products.
        """
        m = self.cfg.num_heads
        g = F.silu(self.w_x(y))                                    # (b, N, P)
        return (g @ mixing_weights(self.w_up, self.w_dn).to(g.dtype)).view(*g.shape[:-1], m, m)

    def after_mlp(self, state: tuple[torch.Tensor, ...], y: torch.Tensor) -> tuple:
        """E^c_n ← E^c_n + K_n·E^c_n for each table (mixes heads, never channels).

        state: tables each (b, M, N, D); y (b, N, C). One K_n per token serves both tables.
        """
        k = self.mixing_matrices(y)
        return tuple(e + torch.einsum("bnmk,bknd->bmnd", k, e) for e in state)

    def after_mlp_unfused(self, state: tuple[torch.Tensor, ...], y: torch.Tensor) -> tuple:
        """The released code's form: up-project E to P channels, gate, down-project (T7)."""
        g = F.silu(self.w_x(y)).transpose(1, 2)[..., None]        # (b, P, N, 1)
        out = []
        for e in state:
            up = torch.einsum("pm,bmnd->bpnd", self.w_up, e) * g
            out.append(e + torch.einsum("mp,bpnd->bmnd", self.w_dn, up))
        return tuple(out)
