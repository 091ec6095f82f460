"""Triton device helpers shared by the TAPE forward and backward kernels.

Every (b, M, N, D) operand is read as two half-width tiles, columns [0, D/2) and [D/2, D):
rotate-half pairs channel β with β + D/2, so the modulation
    x̃ = x ⊙ E⁰ + rot(x) ⊙ E¹,   rot(x) = [−x₂, x₁]
becomes elementwise arithmetic on the halves, with no register shuffle:
    x̃₁ = x₁ ⊙ E⁰₁ − x₂ ⊙ E¹₁,   x̃₂ = x₂ ⊙ E⁰₂ + x₁ ⊙ E¹₂.
The inner products that use x̃ (q̃k̃ᵀ, dS·k̃, ...) are split into two dots over the halves.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Softmax runs in base 2 (exp2 is one SFU op); LSE is stored in log2 units.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def program_head(N_HEADS):
    """(bh, batch index, head index) of this program: grid axis 1 runs over batch·heads."""
    bh = tl.program_id(1)
    return bh, (bh // N_HEADS).to(tl.int64), (bh % N_HEADS).to(tl.int64)


@triton.jit
def head_ptr(base, off_b, off_h, stride_b, stride_h):
    """Start of one (batch, head) slice of a (b, H, N, D) tensor."""
    return base + off_b * stride_b + off_h * stride_h


@triton.jit
def query_block(CAUSAL: tl.constexpr):
    """This program's query block (grid axis 0); causal grids run the longest rows first, so
    the tail of the grid is short programs."""
    start_m = tl.program_id(0)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m
    return start_m


@triton.jit
def key_ranges(start_m, N_CTX, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(unmasked_end, masked_end) of query block ``start_m``'s key loop: keys [0, unmasked_end)
    need no mask (strictly left of the diagonal, or fully inside N); [unmasked_end, masked_end)
    are the diagonal / tail blocks. Needs BLOCK_M % BLOCK_N == 0."""
    if CAUSAL:
        unmasked_end = start_m * BLOCK_M
        masked_end = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    else:
        unmasked_end = (N_CTX // BLOCK_N) * BLOCK_N
        masked_end = N_CTX
    return unmasked_end, masked_end


@triton.jit
def load_halves(base, offs, stride_n, HALF: tl.constexpr, row_ok, MASKED: tl.constexpr):
    """Load rows ``offs`` of a (N, D) slice as two (len(offs), D/2) tiles (zeros past N if MASKED)."""
    cols = tl.arange(0, HALF)
    ptrs = base + offs[:, None] * stride_n + cols[None, :]
    if MASKED:
        x1 = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        x2 = tl.load(ptrs + HALF, mask=row_ok[:, None], other=0.0)
    else:
        x1 = tl.load(ptrs)
        x2 = tl.load(ptrs + HALF)
    return x1, x2


@triton.jit
def load_rows(base, offs, stride_n, WIDTH: tl.constexpr, row_ok, MASKED: tl.constexpr):
    """Load rows ``offs`` of a (N, WIDTH) slice as one tile (zeros past N if MASKED)."""
    ptrs = base + offs[:, None] * stride_n + tl.arange(0, WIDTH)[None, :]
    if MASKED:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def store_halves(base, offs, stride_n, HALF: tl.constexpr, row_ok, x1, x2):
    """Store two (len(offs), D/2) tiles into rows ``offs`` of a (N, D) slice, rows < N only."""
    cols = tl.arange(0, HALF)
    ptrs = base + offs[:, None] * stride_n + cols[None, :]
    tl.store(ptrs, x1.to(base.dtype.element_ty), mask=row_ok[:, None])
    tl.store(ptrs + HALF, x2.to(base.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def load_with_state(x_base, e0_base, e1_base, offs, stride_xn, stride_e0n, stride_e1n,
                    HALF: tl.constexpr, row_ok, MASKED: tl.constexpr):
    """Rows ``offs`` of x, E⁰ and E¹ as half tiles: (x₁, x₂, E⁰₁, E⁰₂, E¹₁, E¹₂)."""
    x1, x2 = load_halves(x_base, offs, stride_xn, HALF, row_ok, MASKED)
    e0a, e0b = load_halves(e0_base, offs, stride_e0n, HALF, row_ok, MASKED)
    e1a, e1b = load_halves(e1_base, offs, stride_e1n, HALF, row_ok, MASKED)
    return x1, x2, e0a, e0b, e1a, e1b


@triton.jit
def load_modulated(x_base, e0_base, e1_base, offs, stride_xn, stride_e0n, stride_e1n,
                   HALF: tl.constexpr, row_ok, MASKED: tl.constexpr):
    """(x̃₁, x̃₂) in x's dtype (the dot operand dtype) and the E halves as loaded."""
    x1, x2, e0a, e0b, e1a, e1b = load_with_state(
        x_base, e0_base, e1_base, offs, stride_xn, stride_e0n, stride_e1n, HALF, row_ok, MASKED)
    xt1, xt2 = modulate(x1, x2, e0a, e0b, e1a, e1b)
    dt = x_base.dtype.element_ty
    return xt1.to(dt), xt2.to(dt), e0a, e0b, e1a, e1b


@triton.jit
def load_key_block(k_base, v_base, e0_base, e1_base, offs_n, stride_kn, stride_vn, stride_e0n, stride_e1n,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, col_ok, MASKED: tl.constexpr):
    """One streamed key block of the forward / dq loops: (k̃₁, k̃₂) in fp32, the E halves as
    loaded (also the value operand [E⁰ | E¹]) and v as loaded. All four loads are issued before
    the modulation. Callers cast k̃ to the dot dtype themselves, where the kernel did before the
    helper existed: where that cast sits changes Triton's schedule (casting here cost the sm_90
    D=64 forward 4–8 KiB of shared memory and made its 64×64 entry spill)."""
    k1, k2, e0a, e0b, e1a, e1b = load_with_state(
        k_base, e0_base, e1_base, offs_n, stride_kn, stride_e0n, stride_e1n, HALF, col_ok, MASKED)
    v = load_rows(v_base, offs_n, stride_vn, HEAD_DIM, col_ok, MASKED)
    kt1, kt2 = modulate(k1, k2, e0a, e0b, e1a, e1b)
    return kt1, kt2, e0a, e0b, e1a, e1b, v


@triton.jit
def _fp32(x1, x2, e0a, e0b, e1a, e1b):
    return (x1.to(tl.float32), x2.to(tl.float32), e0a.to(tl.float32), e0b.to(tl.float32),
            e1a.to(tl.float32), e1b.to(tl.float32))


@triton.jit
def modulate(x1, x2, e0a, e0b, e1a, e1b):
    """x̃ halves from x halves and E⁰, E¹ halves, computed in fp32 (spec §2)."""
    x1, x2, e0a, e0b, e1a, e1b = _fp32(x1, x2, e0a, e0b, e1a, e1b)
    return x1 * e0a - x2 * e1a, x2 * e0b + x1 * e1b


@triton.jit
def modulation_backward(dxt1, dxt2, x1, x2, e0a, e0b, e1a, e1b):
    """Gradients through x̃ = x⊙E⁰ + rot(x)⊙E¹ given dx̃ (fp32 halves).

    dx = dx̃⊙E⁰ + rotᵀ(dx̃⊙E¹) with rotᵀ(y) = [y₂, −y₁];  dE⁰ = x⊙dx̃;  dE¹ = rot(x)⊙dx̃.
    Returns (dx₁, dx₂, dE⁰₁, dE⁰₂, dE¹₁, dE¹₂), all fp32.
    """
    x1, x2, e0a, e0b, e1a, e1b = _fp32(x1, x2, e0a, e0b, e1a, e1b)
    dx1 = dxt1 * e0a + dxt2 * e1b
    dx2 = dxt2 * e0b - dxt1 * e1a
    return dx1, dx2, x1 * dxt1, x2 * dxt2, -x2 * dxt1, x1 * dxt2
