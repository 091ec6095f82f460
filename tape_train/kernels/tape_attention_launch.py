"""Host-side launchers of the fused TAPE attention kernels: grids, autotuning, scratch buffers.

Imports Triton at module level; import this module only after checking
``tape_train.kernels.triton_available`` (the autograd wrapper does so lazily).
"""

from __future__ import annotations

import os

import torch
import triton

from tape_train.kernels.tape_attention_bwd import (
    tape_attention_bwd_dkv_kernel,
    tape_attention_bwd_dq_finish_kernel,
    tape_attention_bwd_dq_kernel,
    tape_attention_bwd_preprocess_kernel,
)
from tape_train.kernels.tape_attention_configs import (
    INTERPRETER_CONFIGS,
    TapeKernelConfigs,
    arch_for_capability,
    autotune_configs,
    validate_config,
)
from tape_train.kernels.tape_attention_fwd import tape_attention_fwd_kernel

_ELEMENTWISE_BLOCK = 64  # rows per program of the Δ preprocess and the dq finish kernels
_autotuned_cache: dict[tuple, object] = {}


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use TF32 tensor cores when torch allows it for matmuls, else IEEE fp32."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _bhn_strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _autotuned(kernel, kind: str, arch: int, head_dim: int, reset_to_zero: tuple[str, ...] = (),
               elem_bytes: int = 2):
    key = (kind, arch, head_dim, reset_to_zero, elem_bytes)
    if key not in _autotuned_cache:
        configs = [
            triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n},
                          num_warps=c.num_warps, num_stages=c.num_stages)
            for c in autotune_configs(arch, head_dim, kind, elem_bytes)
        ]
        _autotuned_cache[key] = triton.autotune(
            configs=configs, key=["N_CTX", "CAUSAL"], reset_to_zero=list(reset_to_zero) or None
        )(kernel)
    return _autotuned_cache[key]


def _launch(kernel, kind: str, q: torch.Tensor, configs: TapeKernelConfigs | None,
            args, kwargs, reset_to_zero: tuple[str, ...] = ()) -> None:
    """Run ``kernel`` with the pinned config of ``kind`` or autotune over the table for this GPU."""
    b, h, n, d = q.shape
    rows_per_program = "BLOCK_N" if kind == "bwd_dkv" else "BLOCK_M"
    if configs is None and interpreter_enabled():
        configs = INTERPRETER_CONFIGS
    if configs is not None:
        cfg = getattr(configs, kind)
        validate_config(kind, cfg)
        block = cfg.block_n if kind == "bwd_dkv" else cfg.block_m
        kernel[(triton.cdiv(n, block), b * h)](
            *args, **kwargs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return
    arch = arch_for_capability(*torch.cuda.get_device_capability(q.device))
    tuned = _autotuned(kernel, kind, arch, d, reset_to_zero, q.element_size())
    tuned[lambda meta: (triton.cdiv(n, meta[rows_per_program]), b * h)](*args, **kwargs)


def tape_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e0: torch.Tensor, e1: torch.Tensor,
    causal: bool, scale: float, configs: TapeKernelConfigs | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Inputs (b, H, N, D) with unit last-dim stride.

    Returns O (dtype of v), Ê⁰, Ê¹ (dtype of E), all contiguous (b, H, N, D), and the fp32 LSE
    (b·H, N) in log2 units.
    """
    b, h, n, d = q.shape
    o = torch.empty((b, h, n, d), dtype=v.dtype, device=q.device)
    e0_hat = torch.empty((b, h, n, d), dtype=e0.dtype, device=q.device)
    e1_hat = torch.empty_like(e0_hat)
    lse = torch.empty((b * h, n), dtype=torch.float32, device=q.device)
    args = (q, k, v, e0, e1, o, e0_hat, e1_hat, lse,
            *_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v), *_bhn_strides(e0), *_bhn_strides(e1),
            h, n, scale)
    kwargs = dict(HEAD_DIM=d, CAUSAL=causal, PRECISION=dot_precision(q.dtype))
    _launch(tape_attention_fwd_kernel, "fwd", q, configs, args, kwargs)
    return o, e0_hat, e1_hat, lse


def tape_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e0: torch.Tensor, e1: torch.Tensor,
    o: torch.Tensor, e0_hat: torch.Tensor, e1_hat: torch.Tensor, lse: torch.Tensor,
    do: torch.Tensor, de0_hat: torch.Tensor, de1_hat: torch.Tensor,
    causal: bool, scale: float, deterministic: bool, configs: TapeKernelConfigs | None,
) -> tuple[torch.Tensor, ...]:
    """Launch the backward kernels; returns (dq, dk, dv, dE⁰, dE¹), contiguous, input dtypes.

    ``deterministic``: dq̃ from a separate query-block kernel (no atomics, fixed summation order,
    17U) instead of fp32 atomics from the dk/dv kernel (13U).
    """
    b, h, n, d = q.shape
    grad_strides = (*_bhn_strides(do), *_bhn_strides(de0_hat), *_bhn_strides(de1_hat))
    delta = torch.empty((b * h, n), dtype=torch.float32, device=q.device)
    tape_attention_bwd_preprocess_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK), b * h)](
        o, e0_hat, e1_hat, do, de0_hat, de1_hat, delta, *grad_strides, h, n,
        HEAD_DIM=d, BLOCK_M=_ELEMENTWISE_BLOCK,
    )
    dq = torch.empty((b, h, n, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, h, n, d), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, h, n, d), dtype=v.dtype, device=q.device)
    de0 = torch.empty((b, h, n, d), dtype=e0.dtype, device=q.device)
    de1 = torch.empty((b, h, n, d), dtype=e1.dtype, device=q.device)
    de0_part = torch.empty((b, h, n, d), dtype=torch.float32, device=q.device)
    de1_part = torch.empty_like(de0_part)
    dqt = torch.zeros_like(de0_part) if not deterministic else de0_part  # unused when deterministic
    input_strides = (*_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v),
                     *_bhn_strides(e0), *_bhn_strides(e1))
    precision = dot_precision(q.dtype)
    _launch(
        tape_attention_bwd_dkv_kernel, "bwd_dkv", q, configs,
        (q, k, v, e0, e1, do, de0_hat, de1_hat, lse, delta, dk, dv, de0_part, de1_part, dqt,
         *input_strides, *grad_strides, h, n, scale),
        dict(HEAD_DIM=d, CAUSAL=causal, ATOMIC_DQ=not deterministic, PRECISION=precision),
        reset_to_zero=() if deterministic else ("DQT",),
    )
    if deterministic:
        _launch(
            tape_attention_bwd_dq_kernel, "bwd_dq", q, configs,
            (q, k, v, e0, e1, do, de0_hat, de1_hat, lse, delta, dq, de0, de1, de0_part, de1_part,
             *input_strides, *grad_strides, h, n, scale),
            dict(HEAD_DIM=d, CAUSAL=causal, PRECISION=precision),
        )
    else:
        tape_attention_bwd_dq_finish_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK), b * h)](
            q, e0, e1, dqt, dq, de0, de1, de0_part, de1_part,
            *_bhn_strides(q), *_bhn_strides(e0), *_bhn_strides(e1), h, n,
            HEAD_DIM=d, BLOCK_M=_ELEMENTWISE_BLOCK,
        )
    return dq, dk, dv, de0, de1
