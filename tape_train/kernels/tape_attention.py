"""Autograd entry point of the fused Triton TAPE attention (spec §4).

``tape_attention_triton`` matches ``tape_attention_reference`` for self-attention (E of queries
and keys are the same tensors) and differentiates all five inputs exactly, including the q/k
gradients that flow through Ê = A·E (spec T9). Triton is imported lazily so this module loads on
machines without Triton or CUDA; ``triton_available`` tells whether the kernel can run.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from tape_train.kernels.tape_attention_configs import HEAD_DIMS, TapeKernelConfigs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available(device: torch.device | str) -> bool:
    """True if the fused kernel can run on ``device``.

    CUDA devices of compute capability >= 8.0 with Triton importable; or any device when
    ``TRITON_INTERPRET=1`` is set (Triton's CPU interpreter, for tests: slow).
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _check_inputs(q, k, v, e0, e1) -> None:
    names = ("q", "k", "v", "e0", "e1")
    tensors = (q, k, v, e0, e1)
    for name, t in zip(names, tensors):
        if t.dim() != 4:
            raise ValueError(f"tape_attention_triton: {name} must be (b, M, N, D), got shape {tuple(t.shape)}")
        broadcastable = name.startswith("e") and all(s in (1, qs) for s, qs in zip(t.shape[:2], q.shape[:2]))
        if t.shape != q.shape and not (broadcastable and t.shape[2:] == q.shape[2:]):
            raise ValueError(
                f"tape_attention_triton: {name} has shape {tuple(t.shape)}, expected q's {tuple(q.shape)} "
                "(self-attention over the same tokens; e0/e1 may have batch or head dim 1)"
            )
        if t.dtype not in _DTYPES:
            raise ValueError(f"tape_attention_triton: {name} dtype {t.dtype} not in {_DTYPES}")
        if t.device != q.device:
            raise ValueError(f"tape_attention_triton: {name} on {t.device}, q on {q.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"tape_attention_triton: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if e0.dtype != e1.dtype:
        raise ValueError(f"tape_attention_triton: e0 dtype {e0.dtype} != e1 dtype {e1.dtype}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"tape_attention_triton: head dim {q.shape[-1]} not supported; use one of {HEAD_DIMS}")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch/head/sequence strides but read rows as contiguous vectors;
    # only a tensor whose head dim is strided (rare: e.g. a transposed view) is copied.
    return t if t.stride(-1) == 1 else t.contiguous()


class TapeAttentionFunction(torch.autograd.Function):
    """(q, k, v, E⁰, E¹) -> (O, Ê⁰, Ê¹) with the fused Triton forward and backward kernels."""

    @staticmethod
    def forward(ctx, q, k, v, e0, e1, causal: bool, scale: float, deterministic: bool,
                configs: TapeKernelConfigs | None):
        from tape_train.kernels.tape_attention_launch import tape_attention_forward

        q, k, v, e0, e1 = (_unit_last_stride(t) for t in (q, k, v, e0, e1))
        o, e0_hat, e1_hat, lse = tape_attention_forward(q, k, v, e0, e1, causal, scale, configs)
        ctx.save_for_backward(q, k, v, e0, e1, o, e0_hat, e1_hat, lse)
        ctx.causal, ctx.scale, ctx.deterministic, ctx.configs = causal, scale, deterministic, configs
        return o, e0_hat, e1_hat

    @staticmethod
    def backward(ctx, do, de0_hat, de1_hat):
        from tape_train.kernels.tape_attention_launch import tape_attention_backward

        q, k, v, e0, e1, o, e0_hat, e1_hat, lse = ctx.saved_tensors
        do, de0_hat, de1_hat = (_unit_last_stride(t) for t in (do, de0_hat, de1_hat))
        grads = tape_attention_backward(
            q, k, v, e0, e1, o, e0_hat, e1_hat, lse, do, de0_hat, de1_hat,
            ctx.causal, ctx.scale, ctx.deterministic, ctx.configs,
        )
        return (*grads, None, None, None, None)


def tape_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e0: torch.Tensor,
    e1: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    deterministic: bool | None = None,
    configs: TapeKernelConfigs | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused TAPE self-attention: one softmax over q̃k̃ᵀ shared by v, E⁰ and E¹.

    Args:
        q, k, v: (b, M, N, D) unmodulated queries, keys and values; one dtype of fp16/bf16/fp32.
            Any batch/head/sequence strides (e.g. views of a (b, N, M, D) projection); the head
            dim must have unit stride or the tensor is copied.
        e0, e1: (b|1, M|1, N, D) positional state (rotate-half layout), one dtype of fp16/bf16/fp32;
            may differ from q's (e.g. fp32 E with bf16 q): modulation runs in fp32, the value
            path P·E in q's dtype with fp32 accumulation.
        causal: query i attends keys j <= i.
        scale: logit scale, default 1/√D.
        deterministic: True computes dq without atomics (bit-reproducible; backward 13U instead of 9U
            FLOPs); False uses fp32 atomics (FlashAttention-2's choice). Default: follow
            ``torch.are_deterministic_algorithms_enabled()``.
        configs: pin one launch configuration per kernel instead of autotuning.

    Returns:
        (O, Ê⁰, Ê¹): contiguous (b, M, N, D); O in v's dtype, Ê in E's dtype.
    """
    _check_inputs(q, k, v, e0, e1)
    if not triton_available(q.device):
        raise RuntimeError(
            f"tape_attention_triton: the fused kernel cannot run on {q.device} "
            "(needs CUDA with compute capability >= 8.0 and Triton, or TRITON_INTERPRET=1)"
        )
    # A broadcast E (layer 0's tables: batch dim 1) becomes a stride-0 view, no copy; autograd
    # sums the returned full-shape dE over the broadcast dims.
    e0, e1 = e0.expand_as(q), e1.expand_as(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return TapeAttentionFunction.apply(q, k, v, e0, e1, causal, scale, bool(deterministic), configs)
