"""What ``tape-eval`` measures with: each setting from its option, else from the ``eval:``
section of the evaluated checkpoints' runs, else ``EvalConfig``'s default.

A checkpoint's marker stores its run's whole config, and the ``eval:`` section there is what
the run's scheduled evaluation measured with; following it, ``tape-eval`` without options
gives the numbers the run logged. A section written before one of its keys existed (or a run
config without the section) gives that key ``EvalConfig``'s default, as the trainer did.

Checkpoints evaluated together go into one report, so they are measured alike: a setting
whose runs' sections disagree is refused, naming the runs and the key, unless its option
chooses one value for all. (``lengths: null`` is one value: L, 2L, 4L, 8L of each run's own
``train.seq_len``, as each run's scheduled evaluation had it.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tape_train.eval.config import EvalConfig, config_key

log = logging.getLogger("tape_train.eval")

# The settings tape-eval takes, each with the option that sets it (not ``interval``: it says
# when a run evaluates, not how).
OPTION_OF_KEY = {"lengths": "--lengths", "protocols": "--protocols",
                 "sliding_stride": "--stride", "max_tokens": "--max-tokens",
                 "batch_size": "--batch-size"}


def option_name(key: str) -> str:
    """An ``EvalConfig`` setting as the command line spells it, for its errors: the option
    the user typed (``sliding_stride`` -> ``--stride``; an element ``lengths[1]`` -> ``--lengths
    (value 2)``); a setting with no option keeps its config key."""
    base, bracket, index = key.partition("[")
    option = OPTION_OF_KEY.get(base)
    if option is None:
        return config_key(key)
    return f"{option} (value {int(index.rstrip(']')) + 1})" if bracket else option


def run_eval_config(meta: dict, where: str) -> EvalConfig:
    """The ``eval:`` section of the run config stored in a checkpoint's marker ``meta``;
    keys it lacks (an older checkpoint) take their defaults. ``where`` names the checkpoint
    in an error."""
    section = (meta.get("config") or {}).get("eval")
    if section is None:
        return EvalConfig()
    return EvalConfig.from_dict(section, source=f"{where}: its run config")


def unused_stride(protocols: list[str], whose: str) -> str | None:
    """Why a ``--stride`` is refused with ``protocols`` (chosen by ``whose``), or None: only
    the sliding protocol uses it, and it would be recorded in eval.json and ignored."""
    if "sliding" in protocols:
        return None
    return (f"--stride is only used by --protocols sliding, which is not asked for "
            f"({whose} {' '.join(protocols)}): add sliding (--protocols "
            f"{' '.join(protocols)} sliding), or drop --stride")


@dataclass
class EvalSettings:
    """The settings of one ``tape-eval`` and where each came from.

    Attributes:
        config: the settings; ``lengths`` None means L, 2L, 4L, 8L of each checkpoint's own
            ``train.seq_len`` (``lengths_for``).
        origin: for each key of ``OPTION_OF_KEY``, the option that gave it or the run
            sections it was read from, in words (for log lines and errors).
    """

    config: EvalConfig
    origin: dict[str, str]

    def spell(self, key: str) -> str:
        """A setting (or element, ``lengths[1]``) as its errors name it: the option when the
        user typed one, else the run config's key."""
        base = key.partition("[")[0]
        return option_name(key) if self.origin.get(base) == OPTION_OF_KEY.get(base) \
            else config_key(key)

    def where(self, *keys: str) -> str:
        """Where ``keys`` came from, for an error about them: ``lengths from --lengths,
        sliding_stride from the run's eval: section``."""
        return ", ".join(f"{key} from {self.origin[key]}" for key in keys)

    def lengths_for(self, train_seq_len: int | None, checkpoint: str) -> list[int]:
        """The lengths one checkpoint is evaluated at: the settings' lengths, or L, 2L, 4L, 8L
        of its run's ``train_seq_len`` (``checkpoint`` names it in an error)."""
        if self.config.lengths is not None:
            return list(self.config.lengths)
        if train_seq_len is None:
            raise ValueError(f"{checkpoint}: the checkpoint's config has no train.seq_len, so "
                             f"its lengths L, 2L, 4L, 8L are unknown; pass --lengths")
        try:  # a stride too large for them
            return self.config.resolve_lengths(train_seq_len, self.spell)
        except ValueError as exc:
            raise ValueError(f"{checkpoint}: {exc}; without --lengths the lengths are L, 2L, "
                             f"4L, 8L of its train.seq_len={train_seq_len} "
                             f"({self.where('sliding_stride')})") from None


def merge_settings(given: Mapping[str, Any], runs: Mapping[str, EvalConfig]) -> EvalSettings:
    """The settings of one evaluation: ``given`` (the options typed, by ``EvalConfig`` key)
    over ``runs`` (each checkpoint's run section, by checkpoint name, in order), checked as a
    whole. Logs one line for each setting that is not the default, saying where it came from.

    Raises ``ValueError`` naming the key and the runs when their sections disagree on a
    setting no option gives, and naming each setting's origin when they do not fit together
    (a run's stride not below a ``--lengths``)."""
    from_runs = ("the run's eval: section" if len(runs) == 1 else
                 f"the eval: sections of the {len(runs)} checkpoints' runs")
    values, origin = {}, {}
    for key, option in OPTION_OF_KEY.items():
        if key in given:
            values[key], origin[key] = given[key], option
            continue
        groups: list[tuple[Any, list[str]]] = []  # each value and the runs that have it
        for name, cfg in runs.items():
            value = getattr(cfg, key)
            for seen, have in groups:
                if seen == value:
                    have.append(name)
                    break
            else:
                groups.append((value, [name]))
        if len(groups) > 1:
            differ = "; ".join(f"{_yaml(value, key)} in {', '.join(have)}"
                               for value, have in groups)
            example = next((value for value, _ in groups if value is not None), None)
            raise ValueError(
                f"the checkpoints' runs evaluated with different {config_key(key)} ({differ}): "
                f"checkpoints in one report are measured alike, so choose for all with "
                f"{option} (e.g. {option} {_words(key, example)}), or evaluate them "
                f"separately")
        values[key], origin[key] = groups[0][0], from_runs
    if "sliding_stride" in given and "protocols" not in given:
        problem = unused_stride(values["protocols"], f"{from_runs}: eval.protocols")
        if problem:
            raise ValueError(problem)
    if "sliding" not in values["protocols"]:
        values["sliding_stride"] = None  # a run's stride that nothing here uses
    chosen = EvalSettings(None, origin)
    try:
        chosen.config = EvalConfig(**values, name=chosen.spell)
    except ValueError as exc:
        raise ValueError(f"{exc} ({chosen.where('lengths', 'sliding_stride')})") from None
    default = EvalConfig()
    for key in OPTION_OF_KEY:
        value = getattr(chosen.config, key)
        if value != getattr(default, key):
            log.info("%s %s (from %s)", key.replace("_", " "), _words(key, value), origin[key])
    return chosen


def _yaml(value: Any, key: str) -> str:
    """A setting as a run config's YAML writes it (a null with what it means)."""
    if value is None:
        return {"lengths": "null (L, 2L, 4L, 8L of its train.seq_len)",
                "sliding_stride": "null (L // 2)", "max_tokens": "null (all)"}.get(key, "null")
    if isinstance(value, list):
        return f"[{', '.join(map(str, value))}]"
    return str(value)


def _words(key: str, value: Any) -> str:
    """A setting as its option takes it: ``1024 2048``, ``all``, ``auto``."""
    if value is None:
        return "all" if key == "max_tokens" else "auto"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)
