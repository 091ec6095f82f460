"""Evaluation configuration: the run config's ``eval:`` section, validated at construction.

Every error names the offending key as ``eval.<field>`` so a bad YAML value or dotted override
(``eval.lengths=[256,512]``) fails before any training step runs; a command line building the
settings from its own options passes ``name`` to spell each setting as its option instead
(tape-eval: ``--stride``, not ``eval.sliding_stride``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from tape_train.hints import choice_error, unknown_keys

PROTOCOLS = ("nonoverlap", "sliding")
# How many multiples of the training length the default schedule evaluates (L, 2L, 4L, 8L).
DEFAULT_LENGTH_MULTIPLES = (1, 2, 4, 8)


def config_key(key: str) -> str:
    """A setting as a run config names it: ``sliding_stride`` -> ``eval.sliding_stride`` (an
    element as ``lengths[1]``). The default ``name`` of the checks below."""
    return f"eval.{key}"


@dataclass
class EvalConfig:
    """Scheduled perplexity evaluation at growing context lengths (spec §7).

    Attributes:
        interval: evaluate every ``interval`` optimizer steps (and at the end of training);
            0 switches scheduled evaluation off.
        lengths: context lengths L, in tokens the model sees per window. ``None`` means
            L_train, 2·L_train, 4·L_train, 8·L_train (see ``resolve_lengths``).
        protocols: any of ``nonoverlap`` (consecutive windows, every token predicted once
            with 1..L tokens of context) and ``sliding`` (windows of L advancing by
            ``sliding_stride``; only each window's new tokens are scored).
        sliding_stride: S, in tokens, for the sliding protocol; must be smaller than every
            length. ``None`` means L // 2 for each length L, so every scored token after a
            document's first window sees at least L/2 + 1 tokens, at twice the cost of
            ``nonoverlap``.
        max_tokens: scored-token cap per (length, protocol). The first ``max_tokens``
            predicted tokens of the held-out stream are scored, the same tokens for every
            length and protocol, which keeps the numbers comparable and the evaluation
            cheap. ``None`` scores the whole held-out stream.
        batch_size: windows per forward call (per data-parallel rank).

    ``name`` (not a setting: neither stored nor in ``to_dict``) spells a setting in the errors
    of the checks, default ``config_key``; a command line passes the option the user typed.
    """

    interval: int = 0
    lengths: list[int] | None = None
    protocols: list[str] = field(default_factory=lambda: list(PROTOCOLS))
    sliding_stride: int | None = None
    max_tokens: int | None = 32768
    batch_size: int = 4
    name: InitVar[Callable[[str], str] | None] = None

    def __post_init__(self, name: Callable[[str], str] | None) -> None:
        name = name or config_key
        _check_int(name("interval"), self.interval, minimum=0)
        _check_int(name("batch_size"), self.batch_size, minimum=1)
        if self.max_tokens is not None:
            _check_int(name("max_tokens"), self.max_tokens, minimum=1)
        if self.sliding_stride is not None:
            _check_int(name("sliding_stride"), self.sliding_stride, minimum=1)
        if self.lengths is not None:
            if isinstance(self.lengths, (str, bytes)) or not hasattr(self.lengths, "__iter__"):
                raise ValueError(f"{name('lengths')} must be a list of positive integers or "
                                 f"null, got {self.lengths!r}")
            self.lengths = list(self.lengths)
            if not self.lengths:
                raise ValueError(f"{name('lengths')} is empty: give at least one length, or "
                                 f"null for the default L, 2L, 4L, 8L of the training length")
            for i, length in enumerate(self.lengths):
                _check_int(name(f"lengths[{i}]"), length, minimum=1)
            duplicates = sorted({x for x in self.lengths if self.lengths.count(x) > 1})
            if duplicates:
                raise ValueError(f"{name('lengths')} has duplicates: {duplicates}")
        if isinstance(self.protocols, str):
            self.protocols = [self.protocols]
        self.protocols = list(self.protocols)
        if not self.protocols:
            raise ValueError(f"{name('protocols')} is empty: choose from "
                             f"{', '.join(PROTOCOLS)}")
        for i, protocol in enumerate(self.protocols):
            if protocol not in PROTOCOLS:
                raise ValueError(choice_error(name(f"protocols[{i}]"), protocol, PROTOCOLS))
        if len(set(self.protocols)) != len(self.protocols):
            raise ValueError(f"{name('protocols')} has duplicates: {self.protocols}")
        if self.lengths is not None:
            for length in self.lengths:
                self.resolve_stride(length, name)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def resolve_lengths(self, train_seq_len: int,
                        name: Callable[[str], str] = config_key) -> list[int]:
        """The lengths to evaluate: ``lengths`` or L, 2L, 4L, 8L for L = ``train_seq_len``."""
        if not isinstance(train_seq_len, int) or isinstance(train_seq_len, bool) \
                or train_seq_len < 1:
            raise ValueError(f"training sequence length must be a positive integer, "
                             f"got {train_seq_len!r}")
        if self.lengths is not None:
            return list(self.lengths)
        lengths = [m * train_seq_len for m in DEFAULT_LENGTH_MULTIPLES]
        for length in lengths:
            self.resolve_stride(length, name)
        return lengths

    def resolve_stride(self, length: int, name: Callable[[str], str] = config_key) -> int:
        """The sliding-window stride S for windows of ``length`` tokens (always S < length)."""
        return resolve_stride(length, self.sliding_stride, name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "eval config") -> "EvalConfig":
        """Build from a YAML mapping; unknown keys fail with the key path and a suggestion."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: the eval section must be a mapping, got "
                             f"{type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown_keys(unknown, known, 'eval.')}; "
                             f"known: {', '.join(known)}")
        try:
            return cls(**data)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def resolve_stride(length: int, stride: int | None,
                   name: Callable[[str], str] = config_key) -> int:
    """Sliding stride for ``length``: ``stride`` if given (must be < length) else length // 2.

    The degenerate length 1 gets stride 1 (sliding then equals nonoverlap).
    """
    if stride is None:
        return max(1, length // 2)
    if stride >= length:
        raise ValueError(f"{name('sliding_stride')}={stride} must be smaller than every evaluation "
                         f"length, got length {length} (a stride >= L scores tokens with no "
                         f"more context than nonoverlap)")
    return stride


def _check_int(what: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{what} must be {bound}, got {value!r}")

