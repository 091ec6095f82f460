"""Attention kernels for TAPE: the plain-torch reference and the fused Triton kernel."""

from tape_train.kernels.reference import rotate_half, tape_attention_reference

__all__ = ["rotate_half", "tape_attention_reference"]
