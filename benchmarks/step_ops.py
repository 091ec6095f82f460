"""Operators the real trainer dispatches per training step, by phase (one process, CPU or GPU).

Where a step's arithmetic is negligible (the 350m layer structure at width 64, N = 64,
micro-batch 1: ``benchmarks/shapes/350m-narrow.yaml``) its time is the host's: Python and one
dispatch per operator, each a kernel launch on a GPU. This counts, for one step of
``Trainer.train_step`` after warm-up steps, every ATen operator that reaches the dispatcher
(a ``TorchDispatchMode``, below autograd: the backward's operators included), split into

* ``ops``: operators that compute or copy (on a GPU: a kernel launch each, give or take),
* ``views``: views and aliases (no kernel, host time only),
* ``reads``: values read back to the host (``.item()``, ``float()``, ``bool()`` of a tensor;
  a host-device sync each on a GPU when the tensor is on the device),

by phase: ``data``, ``sync`` (the token and loss all-reduces), ``forward``, ``backward``
(``backward/gradient hooks``: ZeRO's per-parameter hooks), ``optimizer_step`` (ZeRO's
bookkeeping; ``optimizer_step/overflow scan``, ``/grad norm``, ``/clip``, ``/adamw``,
``/bf16 params`` where the ZeRO optimizer has those steps), ``metrics`` (the rest of
``train_step``) and ``logging`` (``Trainer._log_step`` of a logged step).

Variants: ``after`` is the trainer as it is; ``before`` restores what the trainer removed
(``restore_before``: DeepSpeed's per-gradient bf16 overflow scan,
``tape_train.train.engine.skip_bf16_overflow_scan``; its gradient norm one gradient at a time,
``multi_tensor_grad_norm``; the gradient norm read back on every step, not only on logged
ones), so both are counted in one run and the ratio printed. Counts are deterministic (no timing); the attention operators are those of the
device's path (CPU: the blocked TAPE attention / SDPA's CPU kernels; CUDA: the fused kernel or
flash), the rest is the same on any device.

    python benchmarks/step_ops.py                       # TAPE and RoPE, ZeRO-1, bf16
    python benchmarks/step_ops.py --stage 3 --dtype fp32 --pe tape --json ops.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("ops", "views", "reads")
# Operators that return an alias or a reshaped view and launch no kernel, besides those whose
# schema says so (``OpOverload.is_view``: view, t, transpose, slice, detach, alias, ...).
_NO_KERNEL = frozenset({"_unsafe_view", "lift_fresh", "split", "split_with_sizes", "unbind"})
_READS = frozenset({"_local_scalar_dense", "is_nonzero"})

# (object, method, phase): steps of DeepSpeed's ZeRO optimizers and of the inner AdamW, each
# counted in its own phase (a missing method is skipped: the stages differ).
ZERO_PHASES = (("check_overflow", "optimizer_step/overflow scan"),
               ("scaled_global_norm", "optimizer_step/grad norm"),
               ("_get_norm_groups", "optimizer_step/grad norm"),
               ("unscale_and_clip_grads", "optimizer_step/clip"),
               ("_update_model_bit16_weights", "optimizer_step/bf16 params"),
               ("process_gradients", "backward/gradient hooks"),
               ("reduce_ready_partitions_and_remove_grads", "backward/gradient hooks"))


class StepOpCounter(TorchDispatchMode):
    """Counts dispatched operators by (phase, kind) while active; ``phase(name)`` is a context
    that attributes what runs inside it to ``name`` (the innermost phase wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = ["metrics"]
        self.counts: collections.Counter = collections.Counter()
        self.by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase, name = self.stack[-1], func.overloadpacket.__name__
        kind = "views" if func.is_view or name in _NO_KERNEL else "ops"
        self.counts[(phase, kind)] += 1
        if name in _READS:
            self.counts[(phase, "reads")] += 1
        self.by_op[phase][str(func)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def table(self) -> dict[str, dict[str, int]]:
        """``{phase: {ops, views, reads}}`` in the order the phases ran."""
        out: dict[str, dict[str, int]] = {}
        for (phase, kind), n in self.counts.items():
            out.setdefault(phase, dict.fromkeys(KINDS, 0))[kind] += n
        return out

    def total(self, kind: str = "ops") -> int:
        return sum(n for (_, k), n in self.counts.items() if k == kind)


def _in_phase(counter: StepOpCounter, fn, name: str):
    def wrapped(*args, **kwargs):
        with counter.phase(name):
            return fn(*args, **kwargs)
    return wrapped


def instrument(trainer, counter: StepOpCounter):
    """Attribute a trainer's step to phases: its own labels (``RunProfiler.label``: data,
    sync, forward, backward, optimizer_step) and the ZeRO optimizer's and AdamW's steps.
    Returns a function that puts every method back as it was."""
    zero, missing, undo = trainer.engine.optimizer, object(), []

    def wrap(obj, method: str, name: str) -> None:
        undo.append((obj, method, vars(obj).get(method, missing)))
        setattr(obj, method, _in_phase(counter, getattr(obj, method), name))

    undo.append((trainer.profiler, "label", vars(trainer.profiler).get("label", missing)))
    trainer.profiler.label = counter.phase
    for method, name in ZERO_PHASES:
        if zero is not trainer.optimizer and callable(getattr(zero, method, None)):
            wrap(zero, method, name)
    wrap(trainer.optimizer, "step", "optimizer_step/adamw")

    def restore() -> None:
        for obj, method, before in reversed(undo):
            if before is missing:
                delattr(obj, method)
            else:
                setattr(obj, method, before)
    return restore


def restore_before(trainer) -> list[str]:
    """Undo what the trainer does to cut its per-step host work (the ``before`` variant; it
    also reads the gradient norm back every step, ``count_step(read_grad_norm=True)``);
    returns what was undone."""
    undone = ["the gradient norm read back every step"]
    zero = trainer.engine.optimizer
    if "check_overflow" in vars(zero):  # skip_bf16_overflow_scan's instance override
        del zero.check_overflow
        undone.append("DeepSpeed's per-gradient bf16 overflow scan")
    if "get_grad_norm_direct" in vars(zero):  # multi_tensor_grad_norm's
        del zero.get_grad_norm_direct
        undone.append("DeepSpeed's gradient norm, one gradient at a time")
    return undone


def build_trainer(args, pe: str, run_dir: Path):
    from tape_train.config import load_run_config
    from tape_train.train.loop import Trainer

    cfg = load_run_config(None, [
        f"model={args.model}", f"model.pe={pe}", f"train.run_dir={run_dir}",
        f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
        f"train.grad_accum_steps={args.grad_accum}", f"train.dtype={args.dtype}",
        f"train.device={args.device}", f"parallel.zero_stage={args.stage}",
        "train.synthetic_data=true", "train.max_steps=1000000", "checkpoint.interval=1000000",
        "eval.interval=0", "logging.peak_tflops=1.0", "logging.tensorboard=false",
        "logging.progress_bar=false", *args.override])
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer


def count_step(trainer, warmup: int, read_grad_norm: bool = False) -> StepOpCounter:
    """One step of ``trainer`` counted after ``warmup`` uncounted ones, as ``train()`` runs a
    step whose metrics it does not log (``read_grad_norm``: as it runs one it logs), and the
    metrics write of a logged step (``logging``)."""
    counter = StepOpCounter()
    for _ in range(warmup):
        trainer.train_step()
    restore = instrument(trainer, counter)
    try:
        with counter:
            trainer._read_grad_norm = read_grad_norm  # as train() sets it per step
            metrics = trainer.train_step()
            with counter.phase("logging"):
                trainer._log_step(trainer.state.step, metrics)
    finally:
        restore()
    return counter


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "benchmarks" / "shapes" / "350m-narrow.yaml"),
                   help="size name in configs/model or a model YAML (default: the 350m layer "
                        "structure at width 64)")
    p.add_argument("--pe", nargs="+", default=["tape", "rope"])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="bf16",
                   help="bf16 (default) as on a GPU; the counts do not depend on its speed")
    p.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--device", default="cpu")
    p.add_argument("--deepspeed-config-of", choices=["cpu", "cuda"], default=None,
                   help="the DeepSpeed settings the trainer writes for this device type "
                        "(default: the device's; cuda on a CPU counts a GPU run's ZeRO work: "
                        "contiguous_gradients on)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override for every trainer")
    p.add_argument("--json", default=None, help="also write the counts here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tape_train.files import write_atomic
    from tape_train.train import engine

    settings = ""
    if args.deepspeed_config_of:  # e.g. a GPU run's ZeRO settings, counted on a CPU
        ds_config, settings = engine.deepspeed_config, f" (DeepSpeed settings of " \
            f"{args.deepspeed_config_of})"
        engine.deepspeed_config = lambda cfg, _device=None: ds_config(
            cfg, args.deepspeed_config_of)

    tmp = Path(tempfile.mkdtemp(prefix="step_ops_"))
    results: dict = {"args": vars(args), "runs": {}}
    try:
        for pe in args.pe:
            for variant in ("before", "after"):
                trainer = build_trainer(args, pe, tmp / f"{pe}_{variant}")
                try:
                    undone = restore_before(trainer) if variant == "before" else []
                    counter = count_step(trainer, args.warmup, read_grad_norm=bool(undone))
                finally:
                    trainer.close()
                results["runs"][f"{pe}/{variant}"] = {
                    "phases": counter.table(), "undone": undone,
                    "totals": {k: counter.total(k) for k in KINDS},
                    "parameters": sum(1 for _ in trainer.model.parameters()),
                    "top_ops": {ph: dict(c.most_common(8)) for ph, c in counter.by_op.items()}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nops per step: {args.model} N={args.seq_len} b={args.micro_batch} "
          f"gas={args.grad_accum} {args.dtype} ZeRO-{args.stage} on {args.device}{settings}")
    for pe in args.pe:
        before, after = (results["runs"][f"{pe}/{v}"] for v in ("before", "after"))
        print(f"\n{pe} ({after['parameters']} parameter tensors); before = after + "
              f"{', '.join(before['undone'])}")
        print(f"{'phase':<30} {'ops before':>10} {'ops after':>10} {'views':>7} {'reads':>6}")
        for phase in dict.fromkeys([*before["phases"], *after["phases"]]):
            b = before["phases"].get(phase, dict.fromkeys(KINDS, 0))
            a = after["phases"].get(phase, dict.fromkeys(KINDS, 0))
            print(f"{phase:<30} {b['ops']:>10} {a['ops']:>10} {a['views']:>7} "
                  f"{b['reads']:>2}->{a['reads']:<2}")
        bt, at = before["totals"], after["totals"]
        print(f"{'total':<30} {bt['ops']:>10} {at['ops']:>10} {at['views']:>7} "
              f"{bt['reads']:>2}->{at['reads']:<2}   after/before ops {at['ops'] / bt['ops']:.3f}")
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
