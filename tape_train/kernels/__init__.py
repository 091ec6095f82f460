"""Attention kernels for TAPE: the plain-torch reference and the fused Triton kernel.

Importing this package never imports Triton: the fused kernel's modules load on first use,
so machines without Triton/CUDA can use the reference. Check ``triton_available(device)``
before calling ``tape_attention_triton``.
"""

from tape_train.kernels.reference import rotate_half, tape_attention_reference
from tape_train.kernels.tape_attention import TapeAttentionFunction, tape_attention_triton, triton_available
from tape_train.kernels.tape_attention_configs import KernelConfig, TapeKernelConfigs

__all__ = [
    "KernelConfig",
    "TapeAttentionFunction",
    "TapeKernelConfigs",
    "rotate_half",
    "tape_attention_reference",
    "tape_attention_triton",
    "triton_available",
]
