"""Forward Triton kernel of fused TAPE attention (spec §4, "Forward").

One program handles BLOCK_M query rows of one (batch, head): it modulates q̃ in registers once,
then streams key blocks, modulating k̃ per block, with ONE online softmax whose probabilities
multiply the 3D-wide value [v | E⁰ | E¹]. It writes O, Ê⁰, Ê¹ and one log-sum-exp per row.

Loop structure (FlashAttention-2): key blocks that need no mask (entirely below the causal
diagonal, or entirely inside N) run without any masking; only the diagonal / tail blocks pay for
masks. That needs BLOCK_M % BLOCK_N == 0 (see tape_attention_configs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tape_train.kernels.tape_attention_common import (
    LOG2E,
    head_ptr,
    key_ranges,
    load_key_block,
    load_modulated,
    program_head,
    query_block,
    store_halves,
)


@triton.jit
def _fwd_inner(
    acc_v, acc_e0a, acc_e0b, acc_e1a, acc_e1b, m_i, l_i,
    qt1, qt2, offs_m,
    k_base, v_base, e0_base, e1_base, stride_kn, stride_vn, stride_e0n, stride_e1n,
    lo, hi, N_CTX, qk_scale,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    dt = qt1.dtype
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N_CTX
        kt1, kt2, e0a, e0b, e1a, e1b, v = load_key_block(
            k_base, v_base, e0_base, e1_base, offs_n, stride_kn, stride_vn, stride_e0n, stride_e1n,
            HALF, HEAD_DIM, col_ok, MASKED)
        s = tl.dot(qt1, tl.trans(kt1.to(dt)), input_precision=PRECISION)
        s = tl.dot(qt2, tl.trans(kt2.to(dt)), s, input_precision=PRECISION)
        s = s * qk_scale  # log2 units
        if MASKED:
            keep = col_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_v = acc_v * alpha[:, None]
        acc_e0a = acc_e0a * alpha[:, None]
        acc_e0b = acc_e0b * alpha[:, None]
        acc_e1a = acc_e1a * alpha[:, None]
        acc_e1b = acc_e1b * alpha[:, None]
        pc = p.to(dt)
        acc_v = tl.dot(pc, v.to(dt), acc_v, input_precision=PRECISION)
        acc_e0a = tl.dot(pc, e0a.to(dt), acc_e0a, input_precision=PRECISION)
        acc_e0b = tl.dot(pc, e0b.to(dt), acc_e0b, input_precision=PRECISION)
        acc_e1a = tl.dot(pc, e1a.to(dt), acc_e1a, input_precision=PRECISION)
        acc_e1b = tl.dot(pc, e1b.to(dt), acc_e1b, input_precision=PRECISION)
        m_i = m_new
    return acc_v, acc_e0a, acc_e0b, acc_e1a, acc_e1b, m_i, l_i


@triton.jit
def tape_attention_fwd_kernel(
    Q, K, V, E0, E1,  # inputs (b, H, N, D), last dim contiguous
    O, E0_HAT, E1_HAT,  # outputs, contiguous (b, H, N, D)
    LSE,  # (b·H, N) fp32, log2 units
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_e0b, stride_e0h, stride_e0n,
    stride_e1b, stride_e1h, stride_e1n,
    N_HEADS, N_CTX, sm_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    bh, off_b, off_h = program_head(N_HEADS)
    start_m = query_block(CAUSAL)
    k_base = head_ptr(K, off_b, off_h, stride_kb, stride_kh)
    v_base = head_ptr(V, off_b, off_h, stride_vb, stride_vh)
    e0_base = head_ptr(E0, off_b, off_h, stride_e0b, stride_e0h)
    e1_base = head_ptr(E1, off_b, off_h, stride_e1b, stride_e1h)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_CTX
    qt1, qt2, _, _, _, _ = load_modulated(head_ptr(Q, off_b, off_h, stride_qb, stride_qh), e0_base,
                                          e1_base, offs_m, stride_qn, stride_e0n, stride_e1n, HALF,
                                          row_ok, True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_v = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc_e0a = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_e0b = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_e1a = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_e1b = tl.zeros([BLOCK_M, HALF], tl.float32)
    qk_scale = sm_scale * LOG2E
    unmasked_end, masked_end = key_ranges(start_m, N_CTX, BLOCK_M, BLOCK_N, CAUSAL)
    acc_v, acc_e0a, acc_e0b, acc_e1a, acc_e1b, m_i, l_i = _fwd_inner(
        acc_v, acc_e0a, acc_e0b, acc_e1a, acc_e1b, m_i, l_i, qt1, qt2, offs_m,
        k_base, v_base, e0_base, e1_base, stride_kn, stride_vn, stride_e0n, stride_e1n,
        0, unmasked_end, N_CTX, qk_scale,
        BLOCK_N, HALF, HEAD_DIM, CAUSAL, False, PRECISION,
    )
    acc_v, acc_e0a, acc_e0b, acc_e1a, acc_e1b, m_i, l_i = _fwd_inner(
        acc_v, acc_e0a, acc_e0b, acc_e1a, acc_e1b, m_i, l_i, qt1, qt2, offs_m,
        k_base, v_base, e0_base, e1_base, stride_kn, stride_vn, stride_e0n, stride_e1n,
        unmasked_end, masked_end, N_CTX, qk_scale,
        BLOCK_N, HALF, HEAD_DIM, CAUSAL, True, PRECISION,
    )

    inv_l = 1.0 / l_i
    out_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
    store_halves(E0_HAT + out_off, offs_m, HEAD_DIM, HALF, row_ok,
                 acc_e0a * inv_l[:, None], acc_e0b * inv_l[:, None])
    store_halves(E1_HAT + out_off, offs_m, HEAD_DIM, HALF, row_ok,
                 acc_e1a * inv_l[:, None], acc_e1b * inv_l[:, None])
    o_ptrs = O + out_off + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(o_ptrs, (acc_v * inv_l[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * N_CTX + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)
