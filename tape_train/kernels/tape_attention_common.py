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

LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is one SFU op); LSE is stored in log2 units


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
def modulate(x1, x2, e0a, e0b, e1a, e1b):
    """x̃ halves from x halves and E⁰, E¹ halves, computed in fp32 (spec §2)."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    e0a = e0a.to(tl.float32)
    e0b = e0b.to(tl.float32)
    e1a = e1a.to(tl.float32)
    e1b = e1b.to(tl.float32)
    return x1 * e0a - x2 * e1a, x2 * e0b + x1 * e1b


@triton.jit
def modulation_backward(dxt1, dxt2, x1, x2, e0a, e0b, e1a, e1b):
    """Gradients through x̃ = x⊙E⁰ + rot(x)⊙E¹ given dx̃ (fp32 halves).

    dx = dx̃⊙E⁰ + rotᵀ(dx̃⊙E¹) with rotᵀ(y) = [y₂, −y₁];  dE⁰ = x⊙dx̃;  dE¹ = rot(x)⊙dx̃.
    Returns (dx₁, dx₂, dE⁰₁, dE⁰₂, dE¹₁, dE¹₂), all fp32.
    """
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    e0a = e0a.to(tl.float32)
    e0b = e0b.to(tl.float32)
    e1a = e1a.to(tl.float32)
    e1b = e1b.to(tl.float32)
    dx1 = dxt1 * e0a + dxt2 * e1b
    dx2 = dxt2 * e0b - dxt1 * e1a
    return dx1, dx2, x1 * dxt1, x2 * dxt2, -x2 * dxt1, x1 * dxt2
