"""Positional encodings, one small module each (spec §2 and §5)."""

from __future__ import annotations

from tape_train.model.pe.alibi import ALiBi
from tape_train.model.pe.base import PositionalEncoding, PositionContext
from tape_train.model.pe.fire import FIRE
from tape_train.model.pe.nope import NoPE
from tape_train.model.pe.rope import RandPE, RoPE
from tape_train.model.pe.t5 import T5Bias
from tape_train.model.pe.tape import TapeEncoding, TapeStateUpdate
from tape_train.model.pe.xpos import XPos

ENCODINGS: dict[str, type[PositionalEncoding]] = {
    "tape": TapeEncoding,
    "rope": RoPE,
    "nope": NoPE,
    "alibi": ALiBi,
    "randpe": RandPE,
    "fire": FIRE,
    "xpos": XPos,
    "t5": T5Bias,
}


def build_positional_encoding(cfg) -> PositionalEncoding:
    return ENCODINGS[cfg.pe](cfg)


__all__ = ["ENCODINGS", "PositionContext", "PositionalEncoding", "TapeStateUpdate",
           "build_positional_encoding"]
