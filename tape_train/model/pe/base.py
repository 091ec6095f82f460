"""Shared pieces of the positional encodings.

A positional encoding is a model-level module (shared by every layer). Per forward pass it
turns layer-0 positions into a :class:`PositionContext` that every attention layer reads:
rotary tables for the queries and keys, or an additive attention bias, or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tape_train.kernels.reference import rotate_half
from tape_train.model.pe import encoding_spec
from tape_train.model.pe.spec import EncodingSpec


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables in rotate-half layout, computed in fp32 (fp64 for fp64 models), then cast.

    Args:
        positions: (b|1, N) integer or float positions.
    Returns:
        cos, sin: (b|1, 1, N, D) — the head axis broadcasts.
    """
    work = torch.promote_types(torch.float32, dtype)
    exponents = torch.arange(0, head_dim, 2, device=positions.device).to(work) / head_dim
    inv_freq = 1.0 / (theta ** exponents)                      # ω_β, (D/2,)
    angles = positions.to(work)[..., None] * inv_freq           # (b|1, N, D/2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    """rotᵀ(x) = [x[D/2:], −x[:D/2]], the adjoint of :func:`rotate_half`."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


class _Modulate(torch.autograd.Function):
    """x̃ = x ⊙ c + rot(x) ⊙ s that saves only (x, c, s) for backward.

    Autograd through the plain expression would also keep rot(x), one more (b, H, N, D)
    tensor per projection and layer; here it is never materialised: the rotation is applied
    on half-width slices with in-place multiply-adds (rot(x) ⊙ s = [−x₂s₁, x₁s₂]), which on
    CPU, where this elementwise work is memory-bound, also saves the cat/neg temporaries.
    Backward (spec T8): dx = c ⊙ g + rotᵀ(s ⊙ g), dc = x ⊙ g, ds = rot(x) ⊙ g (summed over
    broadcast axes).
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        # x is needed only for the tables' gradients (TAPE); RoPE's constant tables skip it.
        tables_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if tables_need_grad else None, cos, sin)
        h = x.shape[-1] // 2
        out = x * cos
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1.0)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        h = grad.shape[-1] // 2
        dx = dcos = dsin = None
        if ctx.needs_input_grad[0]:
            dx = grad * cos                                  # + rotᵀ(s ⊙ g) = [g₂s₂, −g₁s₁]
            dx[..., :h].addcmul_(grad[..., h:], sin[..., h:])
            dx[..., h:].addcmul_(grad[..., :h], sin[..., :h], value=-1.0)
        if ctx.needs_input_grad[1]:
            dcos = (grad * x).sum_to_size(cos.shape)
        if ctx.needs_input_grad[2]:
            rot_x_grad = torch.empty_like(grad)              # rot(x) ⊙ g = [−x₂g₁, x₁g₂]
            torch.mul(x[..., h:], grad[..., :h], out=rot_x_grad[..., :h]).neg_()
            torch.mul(x[..., :h], grad[..., h:], out=rot_x_grad[..., h:])
            dsin = rot_x_grad.sum_to_size(sin.shape)
        return dx, dcos, dsin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x̃ = x ⊙ cos + rot(x) ⊙ sin; x (b, H, N, D), tables broadcastable to it.

    With RoPE the tables are constants; with TAPE they are the state E⁰, E¹ (gradients flow).
    Under ``torch.compile`` the plain expression: Inductor fuses it into one kernel and
    chooses what its backward keeps (``_Modulate``'s in-place slices would break the graph).
    """
    if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and (x.requires_grad or cos.requires_grad or sin.requires_grad)):
        return _Modulate.apply(x, cos, sin)
    return x * cos + rotate_half(x) * sin


@dataclass
class PositionContext:
    """What one forward pass's attention layers need to know about positions.

    Attributes:
        q_pos: (b|1, Nq) layer-0 positions of the new tokens.
        k_pos: (b|1, Nk) positions of all keys (cached ones first).
        q_tables / k_tables: rotary (cos, sin) tables (xPos folds its scale in) for the queries
            and keys of the *new* tokens, (b|1, 1, Nq, D); cached keys are stored rotated.
        bias: additive logit bias, (b|1, H, Nq, Nk), or None.
        alibi_slopes: (H,) fp32 slopes when the bias is ALiBi (flash-attn takes them natively).
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    k_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None


class PositionalEncoding(nn.Module):
    """Base class: no positional signal (NoPE). Subclasses override what they change.

    What an encoding *is* (rotary, carries a state, value width, GQA, ...) is not declared
    here but in its registry entry, ``self.spec`` (``tape_train.model.pe.ENCODINGS``).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg

    @property
    def spec(self) -> EncodingSpec:
        """This encoding's declared capabilities (its registry entry)."""
        return encoding_spec(self.cfg.pe)

    def layer0_positions(self, batch: int, length: int, offset: int,
                         device: torch.device) -> torch.Tensor:
        """Positions of the new tokens when the caller passes none: (1, N) or (b, N)."""
        return torch.arange(offset, offset + length, device=device)[None]

    def context(self, q_pos: torch.Tensor, k_pos: torch.Tensor,
                dtype: torch.dtype) -> PositionContext:
        return PositionContext(q_pos=q_pos, k_pos=k_pos)

    def initial_state(self, q_pos: torch.Tensor, dtype: torch.dtype):
        """Layer-0 positional state for encodings with ``spec.carries_state``, else None."""
        return None

    def state_update(self) -> nn.Module:
        """A new per-block module updating the state (``spec.carries_state`` encodings).

        The block calls it as ``pos_update(state, e_hat, y)`` (y: the MLP output): the update
        after attention per state tensor, then the one after the MLP; see ``TapeStateUpdate``.
        """
        raise NotImplementedError(f"pe={self.cfg.pe} carries no positional state")

    def reset_parameters(self) -> None:
        """Re-initialise learned parameters (called from the model's init)."""


def relative_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i − j for every query/key pair: (b|1, Nq, Nk), fp32."""
    return q_pos.float()[..., :, None] - k_pos.float()[..., None, :]
