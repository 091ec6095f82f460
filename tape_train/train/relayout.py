"""Resuming a checkpoint on another parallel layout (dp, sp, tp): what is allowed, and how.

A run saved on 64 GPUs can continue on 32, or with another TP/SP split. What continues
exactly:

- weights and AdamW moments: DeepSpeed's universal checkpoint (``checkpoint.ensure_universal``,
  converted once and cached inside the tag) re-partitions them for the new layout;
- step, token counters and the learning-rate schedule: ours, in the checkpoint metadata;
- the global token stream, when the global batch (micro_batch_size × grad_accum_steps × dp, in
  sequences) is unchanged and either dp is unchanged or ``data.sharding: global`` (whose stream
  does not depend on the number of ranks). ``micro_batch_size`` and ``grad_accum_steps`` may
  change for that purpose (e.g. dp 2 → 1 with grad_accum_steps 1 → 2).

The ZeRO stage may change among 1, 2 and 3 the same way (a 1b run trained with ZeRO-3 on 4
nodes continues with ZeRO-1 on one): a change into or out of ZeRO-3 goes through the universal
form, fitted for the new stage's engine (``loading._fit_for_stage``), also at the same layout.
ZeRO-0 cannot change stage (``unloadable``).

What cannot continue exactly: per-process random streams. Each new rank continues the RNG of
the saved rank holding its data-parallel coordinate (only RandPE and TAPE's
``tape_train_offset`` draw random numbers in training), so those two encodings resume on a
deterministic but different random stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Config keys whose change between a checkpoint and a resumed run would silently corrupt the
# run (another model, other data, another batch geometry or numerics). Prefix match.
PROTECTED_KEYS = ("model.", "data.", "parallel.", "train.seq_len", "train.micro_batch_size",
                  "train.grad_accum_steps", "train.seed", "train.dtype", "train.synthetic")
# Keys under a protected prefix that are safe to change. ZeRO-Offload moves states between
# device and host and changes the AdamW kernel (DeepSpeed's CPU Adam: the same update to the
# last bits; docs/training.md, "ZeRO-Offload"); the checkpoint format is the same. Gathering
# whole blocks under ZeRO-3 changes when parameters are fetched, not what is computed.
HARMLESS_KEYS = ("model.name", "model.attn_backend", "data.prefetch", "data.eval_sources",
                 "data.eval_max_documents", "data.eval_min_tokens",
                 "data.skip_bad_records", "parallel.offload_optimizer", "parallel.offload_params",
                 "parallel.zero3_gather_blocks")
# A source's label (logs and messages only; it defaults to the path, so it moves with it).
_LABEL = re.compile(r"data\.sources\[\d+\]\.name")
# Keys that say only where the data lies: a local source's path, the tokenizer file. A resume
# may change them: what the data is (file names, sizes and content samples, token manifests,
# the tokenizer's sha256) is compared by the resume data check (``data.loader.
# resume_differences``, in the preflight before DeepSpeed) and by the loader's fingerprint
# when it loads its state, which refuse other data at the new place.
_LOCATION = re.compile(r"data\.(tokenizer|sources\[\d+\]\.path)")

# Data keys added after checkpoints were first written, whose absence from a checkpoint's
# config is no change: its loader state resumes the stream it was saved with
# (``data.loader.saved_before_block_windows``: a state without block windows keeps packing
# order). A value on both sides that differs is a change like any other.
_LOADER_STATE_DECIDES = ("data.block_shuffle_window",)

# Config keys a layout change may legitimately change (checked by ``problems`` instead). The
# ZeRO stage says how the same weights and AdamW state are partitioned, as dp does: a change
# among ZeRO-1/2/3 continues the run within a relayout's tolerance (tests/test_train_relayout
# .py); ZeRO-0's changes are ``unloadable``.
LAYOUT_KEYS = ("parallel.dp", "parallel.sp", "parallel.tp", "parallel.zero_stage",
               "train.micro_batch_size", "train.grad_accum_steps")


def unloadable(marker: dict, cfg) -> str | None:
    """Why this run's engine cannot load the checkpoint at all (not even with
    ``--allow-config-change``), or ``None``.

    Into or out of ZeRO-0, DeepSpeed 0.19.8 has no route: a ZeRO-0 checkpoint has no
    optimizer shards for the universal conversion, and a ZeRO-0 engine has no universal
    load (it reads the whole optimizer state from the model-states file, where ZeRO-1/2/3
    keep none). Changes among ZeRO-1, 2 and 3 load: within ZeRO-1/2 the files are the same,
    into or out of ZeRO-3 through the universal form fitted for the new stage (``plan``).
    Nor can a ZeRO-0 checkpoint change tp: its files hold each tensor-parallel rank's
    shard of the weights, which no route re-splits (a resume on another tp failed in the
    engine's load with a size mismatch per weight)."""
    saved, now = saved_zero_stage(marker), cfg.parallel.zero_stage
    if saved == now == 0:
        from tape_train.train.checkpoint import saved_layout

        tp = saved_layout(marker)["tp"]
        if tp != cfg.parallel.tp:
            return (f"a ZeRO-0 checkpoint stores one weight shard per tensor-parallel rank and "
                    f"cannot be re-split (saved tp={tp}, now tp={cfg.parallel.tp}); DeepSpeed's "
                    f"universal conversion needs ZeRO-1/2/3: resume with parallel.tp={tp}")
    if saved == now or 0 not in (saved, now):
        return None
    return (f"parallel.zero_stage changes from {saved} to {now}: DeepSpeed cannot load a "
            f"ZeRO-{saved} checkpoint into a ZeRO-{now} engine (universal form included: "
            f"ZeRO-0 keeps no optimizer shards, and a ZeRO-0 engine has no universal load); "
            f"resume with parallel.zero_stage={'0' if saved == 0 else '1, 2 or 3'}")


def saved_zero_stage(marker: dict) -> int:
    """The ZeRO stage a checkpoint was written with (3 for markers older than the key)."""
    return int(marker.get("zero_stage", 3))


@dataclass(frozen=True)
class ConfigChanges:
    """``diff_configs(saved, current)`` of a resume, by what a resume may do with each
    ``(key, old, new)``: ``protected`` would corrupt the run; ``layout`` (the layout and batch
    split) may change when the run continues the same way (``problems``); ``moved`` says only
    where the data lies (the data check compares what it is); ``applied`` is taken as it is
    now (``train.max_steps``, ``train.lr``, logging, evaluation, ...)."""

    protected: list
    layout: list
    moved: list
    applied: list

    def describe(self, which: str) -> str:
        """``key: old -> new`` of the changes of one kind, ``; ``-separated."""
        return describe_changes(getattr(self, which))


def describe_changes(changes: list) -> str:
    """``key: old -> new`` of ``(key, old, new)`` changes, ``; ``-separated."""
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)


def classify_changes(diffs: list[tuple[str, object, object]]) -> ConfigChanges:
    """The one rule of what a resume may change, for the preflight and the trainer alike.
    ``train.dtype: auto`` is not a change: a resumed ``auto`` run keeps the checkpoint's
    resolved dtype; nor is a ``_LOADER_STATE_DECIDES`` key the checkpoint's config lacks."""
    out: dict[str, list] = {"protected": [], "layout": [], "moved": [], "applied": []}
    paths = {key: (old, new) for key, old, new in diffs if key.endswith(".path")}
    for key, old, new in diffs:
        if _LOCATION.fullmatch(key) and _is_path(old) and _is_path(new):
            kind = "moved"
        elif _LABEL.fullmatch(key) and [old, new] == [
                _default_name(p) for p in paths.get(key[:-len("name")] + "path", ())]:
            continue  # the default label, the path: it moved with it
        elif key in _LOADER_STATE_DECIDES and old == "<absent>":
            continue
        elif not key.startswith(PROTECTED_KEYS) or key.startswith(HARMLESS_KEYS) \
                or _LABEL.fullmatch(key) or (key == "train.dtype" and new == "auto"):
            kind = "applied"
        else:
            kind = "layout" if key.startswith(LAYOUT_KEYS) else "protected"
        out[kind].append((key, old, new))
    return ConfigChanges(**out)


def _default_name(path: object) -> object:
    """A source's ``name`` when none is given (``SourceConfig``): its path, a list joined."""
    return ",".join(path) if isinstance(path, list) else path


def _is_path(value: object) -> bool:
    """A local path (or list of them) on this side of a change, not an absent key or a Hub
    source's ``path: null``."""
    return bool(value) and value != "<absent>" and (isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)))


def resume_config_problems(marker: dict, cfg, grid) -> tuple[list[str], ConfigChanges]:
    """Why resuming the checkpoint of ``marker`` with ``cfg`` on ``grid`` would not continue
    the same run (one line each; empty: it would), and its config changes. The preflight
    (dry run, tape-submit, Slurm start-up checks) and the trainer both rule with this."""
    from tape_train.config import diff_configs

    changes = classify_changes(diff_configs(marker.get("config") or {}, cfg.to_dict()))
    found = problems(marker, cfg, grid)
    if changes.protected:
        found.append("these config changes would corrupt the run: "
                     + describe_changes(changes.protected))
    return found, changes


@dataclass(frozen=True)
class Relayout:
    """A resume whose layout, or ZeRO stage family (ZeRO-3 vs ZeRO-1/2), differs from the
    checkpoint's.

    Attributes:
        saved / current: ``{"dp", "sp", "tp"}``.
        universal: load through DeepSpeed's universal form (ZeRO-1/2/3); ZeRO-0 checkpoints
            hold whole replicated weights per tensor-parallel rank and load directly when only
            dp or sp change.
        saved_stage / stage: the checkpoint's ZeRO stage and this run's.
    """

    saved: dict
    current: dict
    universal: bool
    saved_stage: int = 3
    stage: int = 3

    def describe(self) -> str:
        fmt = lambda d: f"dp={d['dp']} sp={d['sp']} tp={d['tp']}"  # noqa: E731
        route = "DeepSpeed universal checkpoint" if self.universal else "direct load"
        zero = (f"ZeRO-{self.saved_stage} -> ZeRO-{self.stage}, "
                if self.saved_stage != self.stage else "")
        return f"{fmt(self.saved)} -> {fmt(self.current)} ({zero}{route})"


def current_layout(grid) -> dict[str, int]:
    return {"dp": grid.dp, "sp": grid.sp, "tp": grid.tp}


def plan(marker: dict, cfg, grid) -> Relayout | None:
    """``None`` when the checkpoint described by ``marker`` loads directly: this run's layout,
    and a ZeRO stage whose engine reads the saved files (the same, or ZeRO-1 <-> 2)."""
    from tape_train.train.checkpoint import saved_layout

    saved, current = saved_layout(marker), current_layout(grid)
    saved_stage, stage = saved_zero_stage(marker), cfg.parallel.zero_stage
    if saved == current and (saved_stage == 3) == (stage == 3):
        return None
    return Relayout(saved, current, universal=saved_stage >= 1, saved_stage=saved_stage,
                    stage=stage)


def global_batch(train: dict, dp: int) -> int:
    """Sequences per optimizer step over all data-parallel ranks."""
    return int(train.get("micro_batch_size", 1)) * int(train.get("grad_accum_steps", 1)) * dp


def problems(marker: dict, cfg, grid) -> list[str]:
    """Why resuming this checkpoint with ``cfg`` on ``grid`` would not continue the same run
    (empty: it would). Covers layout and batch-geometry changes only; other config keys are
    compared by the trainer."""
    from tape_train.train.checkpoint import saved_layout

    saved, current = saved_layout(marker), current_layout(grid)
    saved_cfg = marker.get("config") or {}
    saved_train = saved_cfg.get("train") or {}
    now_train = {"micro_batch_size": cfg.train.micro_batch_size,
                 "grad_accum_steps": cfg.train.grad_accum_steps}
    found = []
    before, after = global_batch(saved_train, saved["dp"]), global_batch(now_train, current["dp"])
    if before != after:
        per_step = cfg.train.micro_batch_size * current["dp"]
        fix = (f"; set train.grad_accum_steps={before // per_step} to keep it"
               if before % per_step == 0 else
               f"; no train.grad_accum_steps keeps it at train.micro_batch_size="
               f"{cfg.train.micro_batch_size} and dp={current['dp']}")
        found.append(
            f"the global batch changes from {before} to {after} sequences "
            f"(train.micro_batch_size × train.grad_accum_steps × dp = "
            f"{saved_train.get('micro_batch_size')} × {saved_train.get('grad_accum_steps')} × "
            f"{saved['dp']} then, {now_train['micro_batch_size']} × "
            f"{now_train['grad_accum_steps']} × {current['dp']} now){fix}")
    synthetic = bool(saved_train.get("synthetic_data"))
    sharding = (saved_cfg.get("data") or {}).get("sharding", "documents")
    tokens = (saved_cfg.get("data") or {}).get("format") == "tokens"  # one global stream
    if saved["dp"] != current["dp"] and not synthetic and sharding != "global" and not tokens:
        found.append(f"data.sharding={sharding!r} ties the token stream to the number of "
                     f"data-parallel ranks (saved dp={saved['dp']}, now dp={current['dp']}); "
                     f"resume at dp={saved['dp']}, or train with data.sharding: global (or "
                     f"data.format: tokens) to be able to change it")
    return found


def source_rank(saved: dict, grid) -> int:
    """The saved rank whose trainer state (data-loader position, RNG) this rank continues:
    the one at data-parallel coordinate ``grid.dp_rank mod saved dp``, sp = tp = 0. Its loader
    state is the right one for ``documents`` sharding at the same dp, and equals every other
    rank's in ``global`` sharding (the global position after a step is rank-independent)."""
    return (grid.dp_rank % saved["dp"]) * saved["sp"] * saved["tp"]
