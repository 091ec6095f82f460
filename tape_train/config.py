"""The run configuration: every section's dataclass composed into one ``RunConfig``.

A run is described by one YAML file (``configs/train/*.yaml``) plus dotted command-line
overrides (``model.pe=rope train.lr=3e-4``; values are parsed as YAML scalars)::

    cfg = load_run_config("configs/train/demo.yaml", ["train.max_steps=50"])
    cfg.to_dict()        # plain, YAML-able; RunConfig.from_dict(cfg.to_dict()) == cfg

Sections and who owns them:

- ``model``      ``tape_train.model.ModelConfig``; in YAML a size name (``model: tiny``) or a
  mapping ``{base: tiny, pe: rope, ...}`` (``base`` omitted: every field given explicitly).
- ``data``       ``tape_train.data.config.DataConfig`` (built with ``DataConfig.from_dict``).
- ``eval``       ``tape_train.eval.config.EvalConfig`` (built with ``EvalConfig.from_dict``).
- ``train``, ``optim``, ``checkpoint``, ``parallel``, ``logging``, ``profile``: defined here.

Every section validates itself in ``__post_init__`` (the one place its invariants live).
Unknown keys and ill-typed values fail with a ``ConfigError`` naming the file and line (or the
override) and the full dotted key, with a did-you-mean suggestion.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tape_train import hints
from tape_train.hints import (MAX_SEED, did_you_mean, read_yaml,  # noqa: F401 - MAX_SEED: public
                              yaml_problem)
from tape_train.model.config import (MODEL_CONFIG_DIR, SHAPE_FIELDS, ModelConfig,
                                     load_model_config)
from tape_train.resources import named_file, resource_dir

SECTIONS = ("model", "data", "eval", "train", "optim", "checkpoint", "parallel", "logging",
            "profile")


# The longest collective/start-up timeout: faulthandler's timer (the watchdog's backstop) and
# threading's waits overflow at about 9.2e9 s; a year is far beyond any job's time limit.
MAX_TIMEOUT_S = 365 * 86400


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and its source."""


# ----------------------------------------------------------------------------------------------
# Sections owned by the trainer
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """What to train for how long, and the learning-rate schedule.

    Attributes:
        run_dir: directory of the run: ``config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
            ``checkpoints/``. Re-running with the same run_dir resumes. A leading ``~`` is the
            home directory (the shell leaves it alone in ``train.run_dir=~/runs/x``).
        seq_len: L, tokens per training sequence.
        micro_batch_size: sequences per rank per forward/backward.
        grad_accum_steps: micro-batches per optimizer step; the global batch is
            ``micro_batch_size * grad_accum_steps * dp`` sequences.
        max_steps: optimizer steps of the whole run (the schedule's horizon).
        lr: peak learning rate, reached at the end of warm-up.
        warmup_steps: linear warm-up length in steps; ``None`` means ``warmup_fraction``.
        warmup_fraction: warm-up as a fraction of ``max_steps`` when ``warmup_steps`` is None
            (spec §6: 2 %).
        decay: shape after warm-up: ``linear`` or ``cosine`` to ``min_lr_ratio * lr`` at
            ``max_steps``, or ``constant``.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        dtype: ``auto`` (default: ``bf16`` where the device has fast native bf16, else
            ``fp32``; ``tape_train.precision``), ``bf16`` (parameters and activations in
            bfloat16, fp32 master weights) or ``fp32``. A run records the resolved value in its
            ``config.yaml``; a resumed ``auto`` run keeps its checkpoint's dtype.
        activation_checkpointing: recompute each decoder layer in the backward pass.
        compile: ``torch.compile`` each decoder layer (TorchInductor fuses the norms, SwiGLU,
            rotary/TAPE updates and residual adds around the GEMMs; the attention kernel stays
            as it is): fewer kernels and less memory traffic per step. The first step, and the
            first evaluation at each new length, compile (a minute or more). Values match the
            eager model to rounding, not bit for bit; a resume may switch it (the run goes on
            to rounding, like a change of ``model.attn_backend``). On CPU it needs a C++
            compiler (``CXX``, or g++ / clang++ on PATH).
        seed: seeds Python, NumPy and torch on every rank (rank-specific streams derive from
            it); an integer from 0 to ``MAX_SEED`` (2**32 - 1).
        max_bad_steps: stop (with a checkpoint) after this many consecutive steps whose loss
            was NaN/inf; such steps are skipped, not applied.
        device: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``.
        keep_freed_memory: on CPU, set glibc's malloc to reuse freed memory instead of
            returning large buffers to the OS every step (``tape_train.host_memory``; faster).
        cuda_expandable_segments: on CUDA, PyTorch's caching allocator grows its segments
            (``expandable_segments:True``) instead of reserving fixed-size ones that fragment
            and, near capacity, make it free its cache and retry a failed ``cudaMalloc`` (a
            device-wide sync). Set on every rank before anything is allocated
            (``tape_train.train.cuda_allocator``); a ``PYTORCH_CUDA_ALLOC_CONF`` or
            ``PYTORCH_ALLOC_CONF`` in the environment wins over it. No effect on CPU.
        synthetic_data: train (and evaluate) on deterministic random tokens instead of the
            ``data`` section: no corpus or tokenizer needed (benchmarks, smoke tests).
        synthetic_mask_fraction: with ``synthetic_data``, mask a random prefix of up to this
            fraction of every row's labels (uneven target-token counts).
        collective_timeout_s: seconds a rank waits in one collective for the other ranks
            during a training step before the run fails (one line naming this key); a step
            that makes no progress for half of it on one rank, outside a collective, ends the
            run with that rank's stacks in its log (``tape_train.train.watchdog``).
        startup_timeout_s: the same for the phases that may legitimately take longer: start-up
            (DeepSpeed, a resume's checkpoint load), the first step of each process
            (compilation, autotuning), every evaluation and checkpoint save.
        deterministic: bit-reproducible GPU training: ``torch.use_deterministic_algorithms``
            (an op without a deterministic CUDA implementation warns once, naming it),
            ``CUBLAS_WORKSPACE_CONFIG``, cuDNN without autotuning, the fused TAPE kernel's
            atomic-free dq (backward 13U instead of 9U) and flash-attn's deterministic
            backward. CPU training is bit-reproducible either way.
    """

    run_dir: str = "runs/default"
    seq_len: int = 256
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    max_steps: int = 1000
    lr: float = 1e-4
    warmup_steps: int | None = None
    warmup_fraction: float = 0.02
    decay: Literal["linear", "cosine", "constant"] = "linear"
    min_lr_ratio: float = 0.0
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    seed: int = 1234
    max_bad_steps: int = 5
    device: Literal["auto", "cpu", "cuda"] = "auto"
    keep_freed_memory: bool = True
    cuda_expandable_segments: bool = True
    synthetic_data: bool = False
    synthetic_mask_fraction: float = 0.0
    collective_timeout_s: float = 600.0
    startup_timeout_s: float = 1800.0
    deterministic: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "train")
        for key in ("seq_len", "micro_batch_size", "grad_accum_steps", "max_steps",
                    "max_bad_steps"):
            _require(getattr(self, key) > 0, f"train.{key} must be > 0, got {getattr(self, key)}")
        _require(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        _require(0 <= self.seed <= MAX_SEED,
                 f"train.seed must be in [0, {MAX_SEED}] (2**32 - 1), got {self.seed}")
        _require(0.0 <= self.warmup_fraction < 1.0,
                 f"train.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.warmup_steps is not None:
            _require(0 <= self.warmup_steps <= self.max_steps,
                     f"train.warmup_steps must be in [0, train.max_steps={self.max_steps}], "
                     f"got {self.warmup_steps} (override it too, e.g. "
                     f"train.warmup_steps={self.max_steps // 10}, or set train.warmup_steps=null "
                     f"to warm up for train.warmup_fraction of the steps)")
        _require(0.0 <= self.min_lr_ratio <= 1.0,
                 f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _require(bool(self.run_dir), "train.run_dir must not be empty")
        # `train.run_dir=~/runs/x` on a command line reaches us unexpanded (no shell expands a
        # ~ after `=` in an argument): it would create a directory named `~` here.
        self.run_dir = os.path.expanduser(self.run_dir)
        _require(0.0 <= self.synthetic_mask_fraction < 1.0,
                 f"train.synthetic_mask_fraction must be in [0, 1), got "
                 f"{self.synthetic_mask_fraction}")
        for key in ("collective_timeout_s", "startup_timeout_s"):
            _require(0 < getattr(self, key) <= MAX_TIMEOUT_S,
                     f"train.{key} must be > 0 and at most {MAX_TIMEOUT_S} seconds (a year; "
                     f"the watchdog's timers cannot wait much longer), got "
                     f"{getattr(self, key):g}")
        _require(self.collective_timeout_s <= self.startup_timeout_s,
                 f"train.collective_timeout_s={self.collective_timeout_s:g} must be <= "
                 f"train.startup_timeout_s={self.startup_timeout_s:g} (start-up, first steps, "
                 f"evaluations and saves get at least a step's allowance): raise both")

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(round(self.warmup_fraction * self.max_steps))


@dataclass
class OptimConfig:
    """AdamW hyper-parameters (the schedule lives in ``train``).

    Attributes:
        betas: AdamW (β1, β2).
        eps: AdamW ε.
        weight_decay: decoupled weight decay on matrices. Never applied to norms, biases and
            TAPE's gates (W_pa, W_up, W_dn, spec §6).
        decay_embeddings: also decay the token embedding and the LM head.
        grad_clip: global gradient-norm clip; 0 disables. Always passed to DeepSpeed explicitly
            (its silent default is 1.0).
    """

    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_embeddings: bool = True
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        check_field_types(self, "optim")
        _require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
                 f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        _require(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")
        _require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got "
                 f"{self.weight_decay}")
        _require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got "
                 f"{self.grad_clip}")


@dataclass
class CheckpointConfig:
    """When to write sharded checkpoints and how many to keep.

    Attributes:
        interval: save every this many optimizer steps (and always at the end and on a stop
            signal).
        keep: number of complete checkpoints kept (≥ 2, so a checkpoint being written never
            leaves the run without a complete one).
    """

    interval: int = 1000
    keep: int = 2

    def __post_init__(self) -> None:
        check_field_types(self, "checkpoint")
        _require(self.interval > 0, f"checkpoint.interval must be > 0, got {self.interval}")
        _require(self.keep >= 2, f"checkpoint.keep must be >= 2 (the previous complete "
                 f"checkpoint is kept while the next one is written), got {self.keep}")


@dataclass
class ParallelConfig:
    """Parallel degrees and ZeRO settings.

    Attributes:
        dp: data-parallel degree; ``None`` infers ``world_size / (sp * tp)``. The layout is
            checked against the world size by ``tape_train.parallel.RankGrid`` at start-up.
        sp: sequence-parallel (Ulysses) degree.
        tp: tensor-parallel degree.
        zero_stage: DeepSpeed ZeRO stage 0–3 (3 shards parameters, gradients and optimizer).
        zero3_param_persistence_threshold: ZeRO-3 keeps parameters with fewer elements than
            this unpartitioned (fewer gathers for small tensors such as norms and TAPE gates).
        zero3_gather_blocks: ZeRO-3 gathers (and releases) each decoder block's parameters
            at once, with one pair of hooks per block, instead of per Linear/norm/gate module
            (DeepSpeed's "z3 leaf modules"): the same values and memory plan (the estimate
            already counts whole blocks), far less host work per step (docs/training.md,
            "Compiling the blocks"). ``false``: per module (a block wider than GPU memory).
        offload_optimizer: ZeRO-Offload: ``cpu`` keeps the fp32 master weights and the AdamW
            moments of each rank's partition in host memory and runs the AdamW update there
            (DeepSpeed's CPU Adam); ``none`` keeps them on the device. Needs ZeRO >= 1.
        offload_params: ``cpu`` also keeps ZeRO-3's parameter partitions in host memory,
            fetched to the device layer by layer; ``none`` keeps them on the device. Needs
            ZeRO-3. See docs/training.md, "ZeRO-Offload".
    """

    dp: int | None = None
    sp: int = 1
    tp: int = 1
    zero_stage: int = 3
    zero3_param_persistence_threshold: int = 100_000
    zero3_gather_blocks: bool = True
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_params: Literal["none", "cpu"] = "none"

    def __post_init__(self) -> None:
        check_field_types(self, "parallel")
        _require(self.dp is None or self.dp > 0, f"parallel.dp must be > 0, got {self.dp}")
        _require(self.zero_stage in (0, 1, 2, 3),
                 f"parallel.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _require(self.zero3_param_persistence_threshold >= 0,
                 "parallel.zero3_param_persistence_threshold must be >= 0")
        _require(self.sp >= 1, f"parallel.sp must be >= 1, got {self.sp}")
        _require(self.tp >= 1, f"parallel.tp must be >= 1, got {self.tp}")
        _require(self.offload_optimizer == "none" or self.zero_stage >= 1,
                 f"parallel.offload_optimizer={self.offload_optimizer} needs parallel.zero_stage "
                 f">= 1 (ZeRO offloads the optimizer partitions it owns), got "
                 f"{self.zero_stage}")
        _require(self.offload_params == "none" or self.zero_stage == 3,
                 f"parallel.offload_params={self.offload_params} needs parallel.zero_stage=3 "
                 f"(only ZeRO-3 partitions the parameters), got {self.zero_stage}")


@dataclass
class LoggingConfig:
    """Metrics and console output.

    Attributes:
        interval: write metrics (TensorBoard, metrics.jsonl) every this many steps.
        console_interval: print the one-line summary every this many steps.
        tensorboard: write TensorBoard events under ``<run_dir>/tensorboard``.
        progress_bar: tqdm bar with ETA on rank 0: ``true``/``on``, ``false``/``off``, or
            ``auto`` (only when stderr is a terminal).
        all_ranks: log from every rank (prefixed with the rank), not only rank 0.
        peak_tflops: peak FLOP/s (in TFLOP/s) per device used for MFU; ``None`` measures a
            GEMM peak at start-up on CPU and uses a known table value on GPU when possible.
        wandb: opt-in Weights & Biases logging, ``{project, entity, name, mode, group,
            tags}`` (mode: online, offline or disabled); the same scalars as TensorBoard and
            the resolved config; a restart continues the same W&B run.
    """

    interval: int = 1
    console_interval: int = 10
    tensorboard: bool = True
    progress_bar: bool | Literal["auto"] = "auto"
    all_ranks: bool = False
    peak_tflops: float | None = None
    wandb: dict | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "logging")
        if self.wandb is not None:
            from tape_train.train.wandb_sink import check_wandb_settings

            problem = check_wandb_settings(self.wandb)
            _require(problem is None, problem or "")
        _require(self.interval > 0, f"logging.interval must be > 0, got {self.interval}")
        _require(self.console_interval > 0,
                 f"logging.console_interval must be > 0, got {self.console_interval}")
        _require(self.peak_tflops is None or self.peak_tflops > 0,
                 f"logging.peak_tflops must be > 0, got {self.peak_tflops}")


@dataclass
class ProfileConfig:
    """Opt-in profiling of chosen training steps (``tape_train.train.profiling``): torch.profiler
    traces and CUDA memory snapshots under ``<run_dir>/profile/``. Off: nothing is recorded.

    Attributes:
        enabled: profile the steps below on the ranks below.
        start_step: the first traced optimizer step (1-based, the step numbers of the logs).
        active_steps: steps traced in each window (the trace of a window is one file).
        warmup_steps: steps just before each window that the profiler runs and discards
            (its own start-up would otherwise distort the first traced step).
        repeat: number of windows; 0: one every ``interval`` steps until the run ends.
        interval: steps from the start of one window to the next (needed when repeat is not 1;
            at least ``warmup_steps + active_steps``).
        ranks: the ranks that profile: a list (checked against the world size at start-up and
            by ``--dry-run``) or ``all``.
        trace: write a torch.profiler trace per window and rank (Chrome trace JSON).
        record_shapes: record the input shapes of every op (grouping by shape; some overhead).
        profile_memory: record tensor allocations and frees in the trace (more overhead).
        with_stack: record the Python stack of every op (much larger traces and overhead).
        memory_snapshot: CUDA only: record the caching allocator's history from start-up, write a
            snapshot at the end of every window and when a CUDA out-of-memory error ends the run
            (pytorch.org/memory_viz opens it); on CPU a warning at start-up, nothing recorded.
        memory_snapshot_entries: allocator events kept in the history (a ring buffer: the newest).
    """

    enabled: bool = False
    start_step: int = 5
    active_steps: int = 2
    warmup_steps: int = 1
    repeat: int = 1
    interval: int | None = None
    ranks: list[int] | Literal["all"] = field(default_factory=lambda: [0])
    trace: bool = True
    record_shapes: bool = True
    profile_memory: bool = False
    with_stack: bool = False
    memory_snapshot: bool = False
    memory_snapshot_entries: int = 100_000

    def __post_init__(self) -> None:
        check_field_types(self, "profile")
        for key in ("start_step", "active_steps", "memory_snapshot_entries"):
            _require(getattr(self, key) > 0, f"profile.{key} must be > 0, got "
                     f"{getattr(self, key)}")
        for key in ("warmup_steps", "repeat"):
            _require(getattr(self, key) >= 0, f"profile.{key} must be >= 0, got "
                     f"{getattr(self, key)}")
        _require(self.warmup_steps < self.start_step,
                 f"profile.warmup_steps={self.warmup_steps} must be < profile.start_step="
                 f"{self.start_step}: the warm-up steps run before the first traced step")
        span = self.warmup_steps + self.active_steps
        if self.repeat == 1:
            _require(self.interval is None, f"profile.interval={self.interval} is only used "
                     f"with profile.repeat other than 1 (several windows); remove it or set "
                     f"profile.repeat")
        else:
            _require(self.interval is not None and self.interval >= span,
                     f"profile.repeat={self.repeat} needs profile.interval (steps from the "
                     f"start of one window to the next) >= profile.warmup_steps + "
                     f"profile.active_steps = {span}, got {self.interval}")
        if isinstance(self.ranks, list):
            _require(bool(self.ranks) and all(r >= 0 for r in self.ranks),
                     f"profile.ranks must be a non-empty list of ranks >= 0 or 'all', got "
                     f"{self.ranks}")
            self.ranks = sorted(set(self.ranks))
        if self.enabled:
            _require(self.trace or self.memory_snapshot, "profile.trace and "
                     "profile.memory_snapshot are both false: profiling would record nothing")

    def window_from(self, step: int) -> tuple[int, int] | None:
        """(first, last) traced step of the earliest window whose warm-up starts at ``step`` or
        later; ``None`` when no window is left (``train.max_steps`` is not considered)."""
        first, index = self.start_step, 0
        late = step - (self.start_step - self.warmup_steps)
        if late > 0:
            if self.interval is None:
                return None
            index = -(-late // self.interval)
            first += index * self.interval
        if self.repeat and index >= self.repeat:
            return None
        return first, first + self.active_steps - 1

    def profiles_rank(self, rank: int) -> bool:
        return self.ranks == "all" or rank in self.ranks


_OWN_SECTIONS = {"train": TrainConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig,
                 "parallel": ParallelConfig, "logging": LoggingConfig,
                 "profile": ProfileConfig}


def _external_section_classes() -> dict[str, type]:
    """Data and eval sections are owned by their packages; imported lazily."""
    from tape_train.data.config import DataConfig
    from tape_train.eval.config import EvalConfig

    return {"data": DataConfig, "eval": EvalConfig}


# ----------------------------------------------------------------------------------------------
# The composed run configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """Everything that defines a training run. Build with ``load_run_config`` or ``from_dict``."""

    model: ModelConfig
    data: Any
    eval: Any
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        # Cross-section checks, before any process group exists: can this model be split this
        # way (heads over tp·sp, encoding support), and can the sequence be cut over sp?
        from tape_train.parallel import RankGrid

        sp, tp = self.parallel.sp, self.parallel.tp
        RankGrid.from_sizes(sp * tp, sp=sp, tp=tp, rank=0).check_model(self.model)
        _require(self.train.seq_len % sp == 0, f"train.seq_len={self.train.seq_len} is not "
                 f"divisible by parallel.sp={sp} (each rank holds seq_len/sp tokens)")
        profile = self.profile
        if profile.enabled:
            last = profile.start_step + profile.active_steps - 1
            _require(last <= self.train.max_steps,
                     f"profile.start_step={profile.start_step} with profile.active_steps="
                     f"{profile.active_steps} traces steps {profile.start_step}-{last}, beyond "
                     f"train.max_steps={self.train.max_steps}")
            if profile.repeat > 1:
                last += (profile.repeat - 1) * profile.interval
                _require(last <= self.train.max_steps,
                         f"profile.repeat={profile.repeat} windows every profile.interval="
                         f"{profile.interval} steps end at step {last}, beyond "
                         f"train.max_steps={self.train.max_steps} (profile.repeat=0: windows "
                         f"until the run ends)")

    def to_dict(self) -> dict:
        """Plain nested dict (YAML/JSON-able); ``model`` is fully expanded (no ``base``)."""
        return {name: _section_to_dict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>",
                  lines: dict[str, int] | None = None) -> "RunConfig":
        """Build and validate from a nested mapping (as read from YAML, overrides applied).

        ``lines`` maps dotted keys to line numbers in ``source`` for error messages.
        """
        lines = lines or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a run config must be a mapping of sections, got "
                              f"{type(data).__name__}")
        classes = {**_OWN_SECTIONS, **_external_section_classes()}
        fields = _section_keys()
        _check_unknown(data, SECTIONS, "", source, lines, fields)
        built: dict[str, Any] = {}
        for name in SECTIONS:
            raw = data.get(name)
            where = _where(source, lines, name)
            if name == "model":
                built[name] = _build_model(raw, source, lines, fields)
                continue
            raw = {} if raw is None else raw
            if not isinstance(raw, dict):
                raise ConfigError(f"{where}: section '{name}' must be a mapping, got {raw!r}")
            section_cls = classes[name]
            _check_unknown(raw, fields[name], name + ".", source, lines, fields)
            try:  # keys checked above; the message gets one location, the key's line
                built[name] = section_cls(**raw)
            except ConfigError as exc:
                raise ConfigError(f"{_where_of_message(source, lines, exc)}: {exc}") from None
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{_where_of_message(source, lines, exc)}: {exc}") from None
        try:
            return cls(**built)
        except ValueError as exc:
            raise ConfigError(f"{_where_of_message(source, lines, exc)}: {exc}") from None


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
                    ) -> RunConfig:
    """Read a YAML run config (a path, or a shipped config's name such as ``demo``), apply
    dotted ``key=value`` overrides, validate.

    Raises ``ConfigError`` naming the file and line (or the override) and the full key path.
    """
    data: dict = {}
    lines: dict[str, int] = {}
    source = "<defaults>"
    if path is not None:
        given = Path(path)
        path = named_file(path, "configs/train")  # `demo` -> the shipped configs/train/demo.yaml
        if not path.exists() and given.is_dir():  # `--config runs/x`: not a shipped name either
            path = given
        source = str(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; give the run config YAML "
                              f"in it")
        if path.exists() and not path.is_file():  # every rank reads it: a pipe reads once
            raise ConfigError(f"config file {path} is not a regular file (a device or a pipe?); "
                              f"give the run config YAML file")
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in resource_dir("configs/train").glob("*.yaml")))
            raise ConfigError(f"config file {path} does not exist (shipped configs, usable by "
                              f"name: {shipped})")
        text, data = read_yaml(path, ConfigError)
        data = data or {}
        lines = _key_lines(yaml.compose(text))
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides:
        _apply_override(data, item)
        parts = item.split("=", 1)[0].strip().split(".")
        given = ".".join(parts)  # what the file said below this key is replaced with it
        for key in [k for k in lines if k.startswith((given + ".", given + "["))]:
            del lines[key]
        for n in range(len(parts), 0, -1):  # an unknown section is reported at its prefix
            key = ".".join(parts[:n])
            if n == len(parts) or key not in lines:
                lines[key] = f"override '{item}'"  # type: ignore[assignment]
    return RunConfig.from_dict(data, source=source, lines=lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"train.lr=3e-4"`` → (["train", "lr"], 3e-4). Values are YAML scalars (or flow lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        value = raw.strip()
        cut = value[:1] in ("[", "{") and value[-1:] in (",", ":")  # `[256,` of `[256, 512]`
        closer = "]" if value[:1] == "[" else "}"
        hint = (f"; the shell splits an unquoted override at its spaces: quote the whole of it, "
                f"e.g. '{key.strip()}={value} ...{closer}'" if cut else "")
        problem = yaml_problem(exc)[1].replace("column ", "character ")
        raise ConfigError(f"override {item!r}: value is not valid YAML{hint} ({problem})"
                          ) from None
    return parts, value


def diff_configs(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ between two ``RunConfig.to_dict()`` results.

    A key ``old`` lacks (a checkpoint of a version before the key existed) whose ``new`` value
    is the key's default is no difference: that version behaved as the default does."""
    flat_old, flat_new = _flatten(old), _flatten(new)
    defaults = _section_defaults()
    diffs = [(k, flat_old.get(k, "<absent>"), flat_new.get(k, "<absent>"))
             for k in sorted(set(flat_old) | set(flat_new))
             if flat_old.get(k, "<absent>") != flat_new.get(k, "<absent>")
             and not (k not in flat_old and k in defaults and flat_new[k] == defaults[k])]
    # A list entry only one side has (a source added or removed) is one difference, the
    # whole entry, not one per field.
    out, whole = [], set()
    for key, _, _ in diffs:
        entry = re.match(r".*?\[\d+\](?=\.)", key)
        if entry is None:
            continue
        fields = {side: {k[entry.end() + 1:]: v for k, v in flat.items()
                         if k.startswith(entry.group() + ".")}
                  for side, flat in (("old", flat_old), ("new", flat_new))}
        if (not fields["old"] or not fields["new"]) and entry.group() not in whole:
            whole.add(entry.group())
            out.append((entry.group(), fields["old"] or "<absent>", fields["new"] or "<absent>"))
    out += [d for d in diffs if not any(d[0].startswith(w + ".") for w in whole)]
    return sorted(out, key=lambda d: d[0])


def _section_defaults() -> dict[str, Any]:
    """Flat defaults of the sections that have them (train, optim, …; not model/data/eval)."""
    return _flatten({f.name: _section_to_dict(f.default_factory())
                     for f in dataclasses.fields(RunConfig)
                     if f.default_factory is not dataclasses.MISSING})


def check_field_types(obj: Any, section: str) -> None:
    """The field type check of every section (``tape_train.hints.check_field_types``),
    raising ``ConfigError``."""
    hints.check_field_types(obj, section, ConfigError)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# ----------------------------------------------------------------------------------------------
# Helpers: model section, unknown keys, line numbers, overrides
# ----------------------------------------------------------------------------------------------


def _build_model(raw: Any, source: str, lines: dict,
                 sections: dict[str, list[str]]) -> ModelConfig:
    """The model section: a size name, or a mapping with ``base`` and field overrides
    (``sections``: each section's keys, for the hint on a key in the wrong section)."""
    where = _where(source, lines, "model")
    if raw is None:
        raise ConfigError(f"{source}: section 'model' is required (a size name such as 'tiny' "
                          f"or a mapping with 'base: <size>' and field overrides)")
    if isinstance(raw, str):
        raw = {"base": raw}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'model' must be a size name or a mapping, got {raw!r}")
    raw = dict(raw)
    known = [f.name for f in dataclasses.fields(ModelConfig)] + ["base"]
    _check_unknown(raw, known, "model.", source, lines, sections)
    base = raw.pop("base", None)
    missing = [f"model.{key}" for key in SHAPE_FIELDS if key not in raw]
    if base is None and missing:
        sizes = ", ".join(sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml")))
        raise ConfigError(f"{where}: 'model' without 'base' gives the whole shape itself; "
                          f"missing {', '.join(missing)} (or start from a size: base: one of "
                          f"{sizes})")
    try:
        if base is not None:
            return load_model_config(str(base), **raw)
        return ModelConfig.from_dict(raw, source=source)
    except FileNotFoundError as exc:
        raise ConfigError(f"{_where(source, lines, 'model.base')}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{_where_of_message(source, lines, exc)}: {exc}") from None


def _section_keys() -> dict[str, list[str]]:
    """Each section's keys, by section name."""
    classes = {**_OWN_SECTIONS, **_external_section_classes(), "model": ModelConfig}
    return {name: [f.name for f in dataclasses.fields(classes[name])] for name in SECTIONS}


def _check_unknown(mapping: dict, known: Any, prefix: str, source: str, lines: dict,
                   sections: dict[str, list[str]] | None = None) -> None:
    """Refuse the first key of ``mapping`` not in ``known``, naming where it is and what was
    meant: a close key here, or the section it belongs to (``sections``: each section's
    keys), e.g. ``train.weight_decay`` -> ``optim.weight_decay``."""
    known = list(known)
    for key in mapping:
        if key in known:
            continue
        full = f"{prefix}{key}"
        hint = did_you_mean(key, known, prefix, cutoff=0.5)
        owners = [name for name, keys in (sections or {}).items()
                  if key in keys and f"{name}." != prefix]
        if owners:
            hint = (f" (a key of section{'s' if len(owners) > 1 else ''} "
                    f"{', '.join(repr(o) for o in owners)}: "
                    f"{', '.join(f'{o}.{key}' for o in owners)})")
        head, dot, tail = str(key).partition(".")
        if dot and head in known and tail:  # `train.lr: 1` in a YAML file
            hint = (f" (dotted keys are for command-line overrides; in YAML write "
                    f"'{head}:' and '{tail}:' indented under it)")
        raise ConfigError(f"{_where(source, lines, full)}: unknown key '{full}'{hint}; valid "
                          f"keys{' under ' + prefix.rstrip('.') if prefix else ''}: "
                          f"{', '.join(known)}")


def _where(source: str, lines: dict, key: str) -> str:
    """``file:line`` (or the override) for a dotted key, falling back to its parents."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        k = ".".join(parts[:n])
        # data.sources[1].weight, then data.sources[1], data.sources (an override of the
        # whole list), data
        for candidate in (k, k.split("[", 1)[0]) if k.endswith("]") else (k,):
            if candidate in lines:
                loc = lines[candidate]
                return loc if isinstance(loc, str) else f"{source}:{loc}"
    return source


def _where_of_message(source: str, lines: dict, exc: Exception) -> str:
    """Locate a validation message by the dotted keys (``section.key``) it mentions: the first
    one given itself by an override, else in the file, else the first one (by its section's
    line).
    ``model.hidden_size (256) must be divisible by model.num_heads (5)`` from ``model: tiny``
    and the override ``model.num_heads=5`` is the override's fault, not ``model``'s line."""
    import re

    keys = [m.group(0) for m in re.finditer(
        r"\b(?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])*)+",
        str(exc))]
    given = [key for key in keys if key in lines]
    # An override among them first: it changed what the file had, which held together.
    given.sort(key=lambda key: not isinstance(lines[key], str))
    return _where(source, lines, (given or keys)[0]) if keys else source


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Map dotted keys of a composed YAML mapping to 1-based line numbers; the items of a
    list are ``key[i]`` (``data.sources[1].weight``)."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = key_node.start_mark.line + 1
            out.update(_key_lines(value_node, key + "."))
    elif isinstance(node, yaml.SequenceNode) and prefix:
        for i, item in enumerate(node.value):
            key = f"{prefix[:-1]}[{i}]"
            out[key] = item.start_mark.line + 1
            out.update(_key_lines(item, key + "."))
    return out


def _apply_override(data: dict, item: str) -> None:
    parts, value = parse_override(item)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if i == 0 and part == "model" and isinstance(child, str):
            child = {"base": child}  # `model: tiny` + `model.pe=rope` → {base: tiny, pe: rope}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: '{'.'.join(parts[:i + 1])}' is {child!r}, "
                              f"not a section")
        node[part] = child
        node = child
    node[parts[-1]] = value


def _section_to_dict(section: Any) -> dict:
    if hasattr(section, "to_dict"):
        return section.to_dict()
    return dataclasses.asdict(section)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested mappings; a list of mappings (``data.sources``) is flattened by
    index (``data.sources[0].path``), so that a difference names the field that differs."""
    if isinstance(data, list) and data and all(isinstance(item, dict) for item in data):
        flat: dict[str, Any] = {}
        for i, item in enumerate(data):
            flat.update(_flatten(item, f"{prefix.rstrip('.')}[{i}]."))
        return flat
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out
