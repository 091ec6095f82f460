"""Backward Triton kernels of fused TAPE attention (spec §4, "Backward"; spec §3 T8).

Notation: dO_ext = [dO | dÊ⁰ | dÊ¹], V_ext = [v | E⁰ | E¹] (3D wide), logits = scale·q̃k̃ᵀ.

1. ``tape_attention_bwd_preprocess_kernel``: Δ_i = Σ_c dO_ext[i, c]·O_ext[i, c] over all 3D columns.
2. ``tape_attention_bwd_dkv_kernel``: one program per key block. Streams query blocks,
   recomputes P from the saved LSE once per tile, and accumulates in registers
       dV_ext += Pᵀ dO_ext          (dv and the value path of dE⁰, dE¹)
       dP = dO_ext V_extᵀ,  dS = P ⊙ (dP − Δ),  dk̃ += scale·dSᵀ q̃
   then applies the modulation backward to k̃ (dk and the k-path of dE⁰, dE¹). It writes dk, dv
   and the key-side part of dE (fp32 scratch). With ``ATOMIC_DQ`` it also adds scale·dS k̃ into
   an fp32 dq̃ buffer with atomics (13U total, non-deterministic summation order).
3a. Deterministic path, ``tape_attention_bwd_dq_kernel``: one program per query block streams
   key blocks, recomputes P and dP (one extra S and dP per tile, 17U instead of 13U, no atomics),
   accumulates dq̃ in registers and finishes the query side (step 4) in the same program.
3b. Atomic path, ``tape_attention_bwd_dq_finish_kernel``: reads the accumulated dq̃.
4. Query side: the modulation backward of q̃ gives dq and the q-path of dE⁰, dE¹, which are
   added to the key-side scratch and written in E's dtype. Since E at token i feeds q̃_i, k̃_i
   and V_ext row i, dE_i = (q-path) + (k-path) + (value path): all five input gradients exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tape_train.kernels.tape_attention_common import (
    LOG2E,
    head_ptr,
    key_ranges,
    load_halves,
    load_key_block,
    load_modulated,
    load_rows,
    load_with_state,
    modulation_backward,
    program_head,
    query_block,
    store_halves,
)


@triton.jit
def tape_attention_bwd_preprocess_kernel(
    O, E0_HAT, E1_HAT, DO, DE0_HAT, DE1_HAT, DELTA,
    stride_dob, stride_doh, stride_don,
    stride_de0b, stride_de0h, stride_de0n,
    stride_de1b, stride_de1h, stride_de1n,
    N_HEADS, N_CTX,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    bh, off_b, off_h = program_head(N_HEADS)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_CTX
    out_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
    o = load_rows(O + out_off, offs_m, HEAD_DIM, HEAD_DIM, row_ok, True).to(tl.float32)
    e0 = load_rows(E0_HAT + out_off, offs_m, HEAD_DIM, HEAD_DIM, row_ok, True).to(tl.float32)
    e1 = load_rows(E1_HAT + out_off, offs_m, HEAD_DIM, HEAD_DIM, row_ok, True).to(tl.float32)
    do = load_rows(head_ptr(DO, off_b, off_h, stride_dob, stride_doh), offs_m, stride_don, HEAD_DIM, row_ok, True)
    de0 = load_rows(head_ptr(DE0_HAT, off_b, off_h, stride_de0b, stride_de0h), offs_m, stride_de0n, HEAD_DIM,
                    row_ok, True)
    de1 = load_rows(head_ptr(DE1_HAT, off_b, off_h, stride_de1b, stride_de1h), offs_m, stride_de1n, HEAD_DIM,
                    row_ok, True)
    delta = tl.sum(o * do.to(tl.float32), 1) + tl.sum(e0 * de0.to(tl.float32), 1)
    delta += tl.sum(e1 * de1.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * N_CTX + offs_m, delta, mask=row_ok)


@triton.jit
def _dkv_inner(
    dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2,
    kt1, kt2, v, e0a, e0b, e1a, e1b, offs_n, col_ok,
    q_base, e0_base, e1_base, do_base, de0_base, de1_base, lse_base, delta_base, dqt_base,
    stride_qn, stride_e0n, stride_e1n, stride_don, stride_de0n, stride_de1n,
    lo, hi, N_CTX, sm_scale, qk_scale,
    BLOCK_M: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
):
    dt = kt1.dtype
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_CTX
        qt1, qt2, _, _, _, _ = load_modulated(q_base, e0_base, e1_base, offs_m, stride_qn, stride_e0n,
                                              stride_e1n, HALF, row_ok, MASKED)
        do = load_rows(do_base, offs_m, stride_don, HEAD_DIM, row_ok, MASKED).to(dt)
        g0a, g0b = load_halves(de0_base, offs_m, stride_de0n, HALF, row_ok, MASKED)
        g1a, g1b = load_halves(de1_base, offs_m, stride_de1n, HALF, row_ok, MASKED)
        g0a = g0a.to(dt)
        g0b = g0b.to(dt)
        g1a = g1a.to(dt)
        g1b = g1b.to(dt)
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # Transposed tile (keys × queries) so Pᵀ and dSᵀ need no transpose for the dk/dv dots.
        st = tl.dot(kt1, tl.trans(qt1), input_precision=PRECISION)
        st = tl.dot(kt2, tl.trans(qt2), st, input_precision=PRECISION)
        pt = tl.math.exp2(st * qk_scale - lse[None, :])
        if MASKED:
            keep = row_ok[None, :] & col_ok[:, None]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(keep, pt, 0.0)
        ptc = pt.to(dt)
        dv = tl.dot(ptc, do, dv, input_precision=PRECISION)
        dv0a = tl.dot(ptc, g0a, dv0a, input_precision=PRECISION)
        dv0b = tl.dot(ptc, g0b, dv0b, input_precision=PRECISION)
        dv1a = tl.dot(ptc, g1a, dv1a, input_precision=PRECISION)
        dv1b = tl.dot(ptc, g1b, dv1b, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dpt = tl.dot(e0a, tl.trans(g0a), dpt, input_precision=PRECISION)
        dpt = tl.dot(e0b, tl.trans(g0b), dpt, input_precision=PRECISION)
        dpt = tl.dot(e1a, tl.trans(g1a), dpt, input_precision=PRECISION)
        dpt = tl.dot(e1b, tl.trans(g1b), dpt, input_precision=PRECISION)
        dst = (pt * (dpt - delta[None, :])).to(dt)
        dkt1 = tl.dot(dst, qt1, dkt1, input_precision=PRECISION)
        dkt2 = tl.dot(dst, qt2, dkt2, input_precision=PRECISION)
        if ATOMIC_DQ:
            ds = tl.trans(dst)
            dq1 = tl.dot(ds, kt1, input_precision=PRECISION) * sm_scale
            dq2 = tl.dot(ds, kt2, input_precision=PRECISION) * sm_scale
            dq_ptrs = dqt_base + offs_m[:, None] * HEAD_DIM + tl.arange(0, HALF)[None, :]
            tl.atomic_add(dq_ptrs, dq1, mask=row_ok[:, None], sem="relaxed")
            tl.atomic_add(dq_ptrs + HALF, dq2, mask=row_ok[:, None], sem="relaxed")
    return dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2


@triton.jit
def tape_attention_bwd_dkv_kernel(
    Q, K, V, E0, E1, DO, DE0_HAT, DE1_HAT,
    LSE, DELTA,  # (b·H, N) fp32
    DK, DV,  # contiguous (b, H, N, D), dtype of k / v
    DE0_PART, DE1_PART,  # contiguous (b, H, N, D) fp32: key-side dE⁰, dE¹
    DQT,  # contiguous (b, H, N, D) fp32 dq̃ accumulator (used only if ATOMIC_DQ)
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_e0b, stride_e0h, stride_e0n,
    stride_e1b, stride_e1h, stride_e1n,
    stride_dob, stride_doh, stride_don,
    stride_de0b, stride_de0h, stride_de0n,
    stride_de1b, stride_de1h, stride_de1n,
    N_HEADS, N_CTX, sm_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    bh, off_b, off_h = program_head(N_HEADS)
    # Causal: the earliest key blocks see the most queries; launch them first.
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N_CTX
    dt = Q.dtype.element_ty

    k_base = head_ptr(K, off_b, off_h, stride_kb, stride_kh)
    e0_base = head_ptr(E0, off_b, off_h, stride_e0b, stride_e0h)
    e1_base = head_ptr(E1, off_b, off_h, stride_e1b, stride_e1h)
    kt1, kt2, e0a, e0b, e1a, e1b, v = load_key_block(
        k_base, head_ptr(V, off_b, off_h, stride_vb, stride_vh), e0_base, e1_base, offs_n, stride_kn, stride_vn,
        stride_e0n, stride_e1n, HALF, HEAD_DIM, col_ok, True)
    kt1 = kt1.to(dt)
    kt2 = kt2.to(dt)
    v = v.to(dt)

    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv0a = tl.zeros([BLOCK_N, HALF], tl.float32)
    dv0b = tl.zeros([BLOCK_N, HALF], tl.float32)
    dv1a = tl.zeros([BLOCK_N, HALF], tl.float32)
    dv1b = tl.zeros([BLOCK_N, HALF], tl.float32)
    dkt1 = tl.zeros([BLOCK_N, HALF], tl.float32)
    dkt2 = tl.zeros([BLOCK_N, HALF], tl.float32)

    q_base = head_ptr(Q, off_b, off_h, stride_qb, stride_qh)
    do_base = head_ptr(DO, off_b, off_h, stride_dob, stride_doh)
    de0_base = head_ptr(DE0_HAT, off_b, off_h, stride_de0b, stride_de0h)
    de1_base = head_ptr(DE1_HAT, off_b, off_h, stride_de1b, stride_de1h)
    row_off = bh.to(tl.int64) * N_CTX
    out_off = row_off * HEAD_DIM
    qk_scale = sm_scale * LOG2E

    # Query blocks: [diagonal, masked] [middle, unmasked] [tail past the last full block, masked].
    full_end = (N_CTX // BLOCK_M) * BLOCK_M
    if CAUSAL:
        diag_end = tl.minimum(start_n + BLOCK_N, N_CTX)
        (dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2) = _dkv_inner(
            dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2, kt1, kt2, v, e0a.to(dt), e0b.to(dt), e1a.to(dt), e1b.to(dt),
            offs_n, col_ok, q_base, e0_base, e1_base, do_base, de0_base, de1_base,
            LSE + row_off, DELTA + row_off, DQT + out_off,
            stride_qn, stride_e0n, stride_e1n, stride_don, stride_de0n, stride_de1n,
            start_n, diag_end, N_CTX, sm_scale, qk_scale,
            BLOCK_M, HALF, HEAD_DIM, CAUSAL, True, ATOMIC_DQ, PRECISION,
        )
        mid_start = start_n + BLOCK_N
    else:
        mid_start = 0
    mid_end = tl.maximum(full_end, mid_start)
    # A key block that runs past N keeps every query block masked: padded keys must get P = 0.
    mid_end = tl.where(start_n + BLOCK_N > N_CTX, mid_start, mid_end)
    (dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2) = _dkv_inner(
        dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2, kt1, kt2, v, e0a.to(dt), e0b.to(dt), e1a.to(dt), e1b.to(dt),
        offs_n, col_ok, q_base, e0_base, e1_base, do_base, de0_base, de1_base,
        LSE + row_off, DELTA + row_off, DQT + out_off,
        stride_qn, stride_e0n, stride_e1n, stride_don, stride_de0n, stride_de1n,
        mid_start, mid_end, N_CTX, sm_scale, qk_scale,
        BLOCK_M, HALF, HEAD_DIM, CAUSAL, False, ATOMIC_DQ, PRECISION,
    )
    (dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2) = _dkv_inner(
        dv, dv0a, dv0b, dv1a, dv1b, dkt1, dkt2, kt1, kt2, v, e0a.to(dt), e0b.to(dt), e1a.to(dt), e1b.to(dt),
        offs_n, col_ok, q_base, e0_base, e1_base, do_base, de0_base, de1_base,
        LSE + row_off, DELTA + row_off, DQT + out_off,
        stride_qn, stride_e0n, stride_e1n, stride_don, stride_de0n, stride_de1n,
        mid_end, N_CTX, N_CTX, sm_scale, qk_scale,
        BLOCK_M, HALF, HEAD_DIM, CAUSAL, True, ATOMIC_DQ, PRECISION,
    )

    dkt1 = dkt1 * sm_scale
    dkt2 = dkt2 * sm_scale
    # Re-read k and E (one tile each) rather than keep the raw tiles live across the loop:
    # registers are the binding constraint of this kernel.
    k1, k2, e0a, e0b, e1a, e1b = load_with_state(k_base, e0_base, e1_base, offs_n, stride_kn, stride_e0n,
                                                 stride_e1n, HALF, col_ok, True)
    dk1, dk2, g0a, g0b, g1a, g1b = modulation_backward(dkt1, dkt2, k1, k2, e0a, e0b, e1a, e1b)
    store_halves(DK + out_off, offs_n, HEAD_DIM, HALF, col_ok, dk1, dk2)
    dv_ptrs = DV + out_off + offs_n[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
    store_halves(DE0_PART + out_off, offs_n, HEAD_DIM, HALF, col_ok, g0a + dv0a, g0b + dv0b)
    store_halves(DE1_PART + out_off, offs_n, HEAD_DIM, HALF, col_ok, g1a + dv1a, g1b + dv1b)


@triton.jit
def _finish_query_side(
    dqt1, dqt2, q1, q2, e0a, e0b, e1a, e1b, offs_m, row_ok, out_off,
    DQ, DE0, DE1, DE0_PART, DE1_PART, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    dq1, dq2, g0a, g0b, g1a, g1b = modulation_backward(dqt1, dqt2, q1, q2, e0a, e0b, e1a, e1b)
    store_halves(DQ + out_off, offs_m, HEAD_DIM, HALF, row_ok, dq1, dq2)
    p0a, p0b = load_halves(DE0_PART + out_off, offs_m, HEAD_DIM, HALF, row_ok, True)
    p1a, p1b = load_halves(DE1_PART + out_off, offs_m, HEAD_DIM, HALF, row_ok, True)
    store_halves(DE0 + out_off, offs_m, HEAD_DIM, HALF, row_ok, g0a + p0a, g0b + p0b)
    store_halves(DE1 + out_off, offs_m, HEAD_DIM, HALF, row_ok, g1a + p1a, g1b + p1b)


@triton.jit
def _dq_inner(
    dqt1, dqt2, qt1, qt2, do, g0a, g0b, g1a, g1b, lse, delta, offs_m, row_ok,
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
        kt1 = kt1.to(dt)
        kt2 = kt2.to(dt)
        v = v.to(dt)
        s = tl.dot(qt1, tl.trans(kt1), input_precision=PRECISION)
        s = tl.dot(qt2, tl.trans(kt2), s, input_precision=PRECISION)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            keep = col_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        dp = tl.dot(g0a, tl.trans(e0a.to(dt)), dp, input_precision=PRECISION)
        dp = tl.dot(g0b, tl.trans(e0b.to(dt)), dp, input_precision=PRECISION)
        dp = tl.dot(g1a, tl.trans(e1a.to(dt)), dp, input_precision=PRECISION)
        dp = tl.dot(g1b, tl.trans(e1b.to(dt)), dp, input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(dt)
        dqt1 = tl.dot(ds, kt1, dqt1, input_precision=PRECISION)
        dqt2 = tl.dot(ds, kt2, dqt2, input_precision=PRECISION)
    return dqt1, dqt2


@triton.jit
def tape_attention_bwd_dq_kernel(
    Q, K, V, E0, E1, DO, DE0_HAT, DE1_HAT, LSE, DELTA,
    DQ, DE0, DE1,  # contiguous (b, H, N, D) outputs, dtype of q / E
    DE0_PART, DE1_PART,  # key-side dE from the dk/dv kernel, fp32
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_e0b, stride_e0h, stride_e0n,
    stride_e1b, stride_e1h, stride_e1n,
    stride_dob, stride_doh, stride_don,
    stride_de0b, stride_de0h, stride_de0n,
    stride_de1b, stride_de1h, stride_de1n,
    N_HEADS, N_CTX, sm_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    bh, off_b, off_h = program_head(N_HEADS)
    start_m = query_block(CAUSAL)
    dt = Q.dtype.element_ty
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_CTX
    q_base = head_ptr(Q, off_b, off_h, stride_qb, stride_qh)
    e0_base = head_ptr(E0, off_b, off_h, stride_e0b, stride_e0h)
    e1_base = head_ptr(E1, off_b, off_h, stride_e1b, stride_e1h)
    qt1, qt2, _, _, _, _ = load_modulated(q_base, e0_base, e1_base, offs_m, stride_qn, stride_e0n, stride_e1n,
                                          HALF, row_ok, True)
    do = load_rows(head_ptr(DO, off_b, off_h, stride_dob, stride_doh), offs_m, stride_don, HEAD_DIM, row_ok,
                   True).to(dt)
    g0a, g0b = load_halves(head_ptr(DE0_HAT, off_b, off_h, stride_de0b, stride_de0h), offs_m, stride_de0n, HALF,
                           row_ok, True)
    g1a, g1b = load_halves(head_ptr(DE1_HAT, off_b, off_h, stride_de1b, stride_de1h), offs_m, stride_de1n, HALF,
                           row_ok, True)
    row_off = bh.to(tl.int64) * N_CTX
    lse = tl.load(LSE + row_off + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_off + offs_m, mask=row_ok, other=0.0)
    dqt1 = tl.zeros([BLOCK_M, HALF], tl.float32)
    dqt2 = tl.zeros([BLOCK_M, HALF], tl.float32)
    k_base = head_ptr(K, off_b, off_h, stride_kb, stride_kh)
    v_base = head_ptr(V, off_b, off_h, stride_vb, stride_vh)
    qk_scale = sm_scale * LOG2E
    unmasked_end, masked_end = key_ranges(start_m, N_CTX, BLOCK_M, BLOCK_N, CAUSAL)
    dqt1, dqt2 = _dq_inner(
        dqt1, dqt2, qt1, qt2, do, g0a.to(dt), g0b.to(dt), g1a.to(dt), g1b.to(dt), lse, delta, offs_m, row_ok,
        k_base, v_base, e0_base, e1_base, stride_kn, stride_vn, stride_e0n, stride_e1n,
        0, unmasked_end, N_CTX, qk_scale, BLOCK_N, HALF, HEAD_DIM, CAUSAL, False, PRECISION,
    )
    dqt1, dqt2 = _dq_inner(
        dqt1, dqt2, qt1, qt2, do, g0a.to(dt), g0b.to(dt), g1a.to(dt), g1b.to(dt), lse, delta, offs_m, row_ok,
        k_base, v_base, e0_base, e1_base, stride_kn, stride_vn, stride_e0n, stride_e1n,
        unmasked_end, masked_end, N_CTX, qk_scale, BLOCK_N, HALF, HEAD_DIM, CAUSAL, True, PRECISION,
    )
    # Re-read q and E for the modulation backward (see the dk/dv kernel: registers bind).
    q1, q2, e0a, e0b, e1a, e1b = load_with_state(q_base, e0_base, e1_base, offs_m, stride_qn, stride_e0n,
                                                 stride_e1n, HALF, row_ok, True)
    _finish_query_side(
        dqt1 * sm_scale, dqt2 * sm_scale, q1, q2, e0a, e0b, e1a, e1b, offs_m, row_ok,
        row_off * HEAD_DIM, DQ, DE0, DE1, DE0_PART, DE1_PART, HALF, HEAD_DIM,
    )


@triton.jit
def tape_attention_bwd_dq_finish_kernel(
    Q, E0, E1, DQT, DQ, DE0, DE1, DE0_PART, DE1_PART,
    stride_qb, stride_qh, stride_qn,
    stride_e0b, stride_e0h, stride_e0n,
    stride_e1b, stride_e1h, stride_e1n,
    N_HEADS, N_CTX,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    bh, off_b, off_h = program_head(N_HEADS)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_CTX
    out_off = bh.to(tl.int64) * N_CTX * HEAD_DIM
    q1, q2, e0a, e0b, e1a, e1b = load_with_state(
        head_ptr(Q, off_b, off_h, stride_qb, stride_qh), head_ptr(E0, off_b, off_h, stride_e0b, stride_e0h),
        head_ptr(E1, off_b, off_h, stride_e1b, stride_e1h), offs_m, stride_qn, stride_e0n, stride_e1n, HALF,
        row_ok, True)
    dqt1, dqt2 = load_halves(DQT + out_off, offs_m, HEAD_DIM, HALF, row_ok, True)
    _finish_query_side(
        dqt1, dqt2, q1, q2, e0a, e0b, e1a, e1b, offs_m, row_ok, out_off,
        DQ, DE0, DE1, DE0_PART, DE1_PART, HALF, HEAD_DIM,
    )
