"""End-to-end training through the real trainer: tokens/s, MFU and peak memory per model size
and encoding at the largest micro-batch that fits (searched upward by doubling, OOM caught).

Each (size, encoding) trainer lives in its own spawned process (``trainer_process.Child``),
so one's memory never limits another's, and an OOM or a crash loses only that row. After each
micro-batch that fits, one more step runs under torch.profiler: where that step's time goes
(device kernels by category on CUDA, operators' own CPU time on CPU, and the part of the step
the device was idle), so that a missed target comes with its reason.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch

from gpu.common import Budget, OutOfTime


# Kernel (CUDA) or operator (CPU) names, lower-cased, by category: the first match wins.
CATEGORIES = (
    ("TAPE attention (fused kernel)", ("tape_attention",)),
    ("attention (SDPA, flash, cuDNN, unfused)", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("communication", ("nccl", "all_gather", "allgather", "reduce_scatter", "reducescatter",
                       "all_reduce", "allreduce", "broadcast", "c10d", "gloo")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul", "aten::mm",
                "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("memory copies", ("memcpy", "memset", "copy")),
    # TorchInductor's generated kernels (train.compile): fused pointwise/reduction code.
    ("compiled (Inductor) kernels", ("triton_poi", "triton_red", "triton_per", "cpp_fused")),
)
OTHER = "other (elementwise, norms, TAPE state updates, ...)"
# What a CUDA probe records of the caching allocator; a row takes them from its micro-batch.
ALLOCATOR_KEYS = ("reserved_gib", "alloc_retries", "expandable_segments", "allocator")
TOP_KERNELS = 8


def categorize(name: str) -> str:
    """The category of a kernel or operator ``name`` (``CATEGORIES``; else ``OTHER``)."""
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), OTHER)


def time_breakdown(prof, steps: int, step_ms: float) -> dict:
    """Per-step milliseconds by category of a ``torch.profiler.profile`` of ``steps`` steps
    that took ``step_ms`` each: device kernels' time where the trace has any (CUDA), else the
    operators' own CPU time (their children excluded, so nothing counts twice)."""
    from torch.autograd import DeviceType

    events = list(prof.key_averages())
    # Kernels are events of their own; where a trace attributes them only to the operators
    # that launched them, those operators' own device time is the same sum. A
    # ``record_function`` range (torch.optim's ``Optimizer.step#...``, the trainer's
    # ``tape_train/...`` labels) is also a CUDA event on the device's timeline, spanning kernels
    # that are counted already: a user annotation, left out (as torch's own table does).
    device = ([e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
              or [e for e in events if getattr(e, "self_device_time_total", 0) > 0])
    if device:
        rows = [(e.key, e.self_device_time_total, e.count) for e in device]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in events
                if not e.key.startswith(("ProfilerStep", "tape_train/", "[memory]"))]
    rows = [(name, us / 1000 / steps, calls / steps) for name, us, calls in rows if us > 0]
    categories: dict[str, float] = {}
    for name, ms, _ in rows:
        categories[categorize(name)] = categories.get(categorize(name), 0.0) + ms
    busy = sum(categories.values())
    top = sorted(rows, key=lambda r: -r[1])[:TOP_KERNELS]
    # Where the host's time goes while the device idles: operators by their own CPU time.
    host = sorted(((e.key, e.self_cpu_time_total / 1000 / steps) for e in events
                   if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0
                   and not e.key.startswith("ProfilerStep")), key=lambda r: -r[1])[:TOP_KERNELS]
    return {"device": "cuda" if device else "cpu", "steps": steps, "step_ms": step_ms,
            "host_top": [{"name": name[:120], "ms": ms} for name, ms in host] if device else [],
            "busy_ms": busy, "idle_ms": max(step_ms - busy, 0.0) if device else None,
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top": [{"name": name[:120], "category": categorize(name), "ms": ms,
                     "calls": calls} for name, ms, calls in top]}


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks in this process so far, by reason (its first line): with
    ``train.compile`` the attention core is the only expected one (plus DeepSpeed ZeRO-3's
    hooks); any other is fusion lost on this device, worth a look."""
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        key = str(reason).strip().splitlines()[0][:160] if str(reason).strip() else "?"
        out[key] = out.get(key, 0) + count
    return out


class TrainerProbe:
    """A set-up ``Trainer`` (built in the child process) that the parent drives step by step."""

    def __init__(self, recipe: Path, overrides: list[str]) -> None:
        from trainer_process import build_trainer

        from tape_train.model.flops import training_flops_per_token

        self.trainer = build_trainer(recipe, overrides)
        self.device = self.trainer.dist.device
        cfg = self.trainer.cfg
        self.flops_per_token = training_flops_per_token(
            cfg.model, cfg.train.seq_len, micro_batch=cfg.train.micro_batch_size)

    def losses(self, steps: int) -> list[float]:
        """Per-step loss of ``steps`` real steps on the recipe's (synthetic) data."""
        return [float(self.trainer.train_step()["loss"]) for _ in range(steps)]

    def host_syncs(self, steps: int) -> dict:
        """What waits for the device in ``steps`` real steps, by the line that caused it, and
        what of it repeats for every micro-batch (``common.count_host_syncs``)."""
        from gpu.common import count_host_syncs

        with count_host_syncs(self.device) as syncs:
            for _ in range(steps):
                self.trainer.train_step()
        return {"steps": steps, "micro_batches": self.trainer.cfg.train.grad_accum_steps,
                "per_step": sum(syncs.sites.values()) / steps, "sites": dict(syncs.sites),
                "per_micro_batch": dict(syncs.mid_step)}

    def op_counts(self) -> dict:
        """Operators, views and host reads of one step by phase on the batches of the last
        ``measure`` (``benchmarks/step_ops.py``; the CPU figures are in docs/kernel.md)."""
        from step_ops import KINDS, count_step

        counter = count_step(self.trainer, warmup=0)
        return {"phases": counter.table(), "totals": {k: counter.total(k) for k in KINDS}}

    def profile(self, steps: int) -> dict:
        """``time_breakdown`` of ``steps`` more steps on the batches of the last ``measure``."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                self.trainer.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_ms = (time.perf_counter() - start) * 1000 / steps
        return time_breakdown(prof, steps, step_ms)

    def measure(self, micro_batch: int, warmup: int, steps: int) -> dict:
        """Median step of ``micro_batch`` × seq_len random tokens; ``{"oom": True}`` if it
        does not fit (the trainer is unusable afterwards: search upward, stop at the first).

        On CUDA also the caching allocator's side: its retries during the timed steps (each a
        device-wide sync: ``tape_train.train.cuda_allocator``), the peak reserved memory, and
        whether its segments are expandable (what the allocator reports of the segments it
        holds, so a platform that ignores the setting shows as off)."""
        cfg = self.trainer.cfg
        gen = torch.Generator().manual_seed(micro_batch)
        ids = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.train.seq_len + 1),
                            generator=gen)
        batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        self.trainer.data_iter = itertools.repeat(batch)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        times, losses = [], []
        retries = None
        try:
            for i in range(warmup + steps):
                if i == warmup and self.device.type == "cuda":
                    retries = self._alloc_retries()
                m = self.trainer.train_step()
                if i >= warmup:
                    times.append(m["step_time_s"])
                    losses.append(m["loss"])
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            if "out of memory" not in str(exc).lower():
                raise
            return {"micro_batch": micro_batch, "oom": True, "error": str(exc).splitlines()[0]}
        step = statistics.median(times)
        res = {"micro_batch": micro_batch, "oom": False, "step_s": step,
               # a step is grad_accum_steps micro-batches (the plan keeps 1; an override may not)
               "tokens_per_s": (micro_batch * cfg.train.grad_accum_steps * cfg.train.seq_len
                                / step),
               "loss": losses[-1], "finite": all(x == x for x in losses),
               "flops_per_token": self.flops_per_token}
        if cfg.train.compile:
            res["graph_breaks"] = graph_breaks()
        if self.device.type == "cuda":
            res["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            res["reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            res["alloc_retries"] = self._alloc_retries() - retries
            res["expandable_segments"] = self._expandable_segments()
            setting = self.trainer.dist.cuda_allocator
            res["allocator"] = setting.describe() if setting is not None else None
        else:
            import resource

            res["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return res

    def _alloc_retries(self) -> int:
        return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def _expandable_segments(self) -> bool | None:
        """Whether the allocator holds expandable segments on this device, from its snapshot
        (the segments' own flag); ``None`` where it holds no segment."""
        segments = [s for s in torch.cuda.memory._snapshot(self.device)["segments"]
                    if s.get("device", self.device.index) == self.device.index]
        return any(s.get("is_expandable", False) for s in segments) if segments else None

    def close(self) -> None:
        self.trainer.close()


def end_to_end(recipe: Path, work: Path, plan: dict, peak_tflops: float | None,
               budget: Budget, sink: list, flush) -> None:
    """For each (size, encoding, compile) of ``plan``: micro-batch 1, 2, 4, ... (from
    ``plan["min_micro_batch"]``, default 1) until OOM, the cap or the time budget; the last
    fitting one is the row's result (all probes are kept).

    ``plan["compile"]`` (default ``[False]``): with ``True`` as well, each (size, encoding)
    also runs with ``train.compile=true`` right after its eager row, side by side; that search
    starts at the eager row's micro-batch (compiling each new shape costs a minute)."""
    from trainer_process import BenchmarkError, Child, trainer_overrides

    from tape_train.train.peak import checked_mfu

    n = plan["seq_len"]
    first_mb = plan.get("min_micro_batch", 1)
    if not isinstance(first_mb, int) or first_mb < 1:
        raise ValueError(f"e2e.min_micro_batch must be an integer >= 1, got {first_mb!r}")
    work.mkdir(parents=True, exist_ok=True)
    eager_best: dict = {}
    for size, pe, compiled in itertools.product(plan["sizes"], plan["encodings"],
                                                plan.get("compile", [False])):
        name = f"{size} {pe}" + (" compiled" if compiled else "")
        budget.check(f"end-to-end {name}")
        row = {"size": size, "pe": pe, "compile": bool(compiled), "seq_len": n, "probes": [],
               "status": "running"}
        sink.append(row)
        tag = name.replace(" ", "_")
        overrides = [*trainer_overrides(size, pe, n, 1, work / tag), *plan["overrides"],
                     f"train.compile={str(bool(compiled)).lower()}"]
        child = Child(tag, work / f"{tag}.log", TrainerProbe, recipe, overrides)
        t0 = time.monotonic()
        try:
            # Bounded waits: a stuck run fails with its stacks instead of holding the lease.
            child.result(timeout=max(budget.left(), 60.0))
            row["setup_s"] = time.monotonic() - t0
            mb = (eager_best.get((size, pe), first_mb) if compiled else first_mb)
            while mb <= plan["max_micro_batch"]:
                budget.check(f"{name} micro-batch {mb}")
                probe = child.call("measure", mb, plan["warmup"], plan["steps"],
                                   timeout=max(budget.left(), 60.0))
                row["probes"].append(probe)
                flush()
                if probe["oom"]:
                    break
                if plan.get("profile_steps"):  # now: after an OOM the trainer is unusable
                    probe["profile"] = child.call("profile", plan["profile_steps"],
                                                  timeout=max(budget.left(), 60.0))
                # Once an eager row (they hardly depend on the batch; a dispatch mode would run
                # compiled blocks eagerly): docs/kernel.md, "Host overhead per step".
                if plan.get("op_counts") and not compiled and "op_counts" not in row:
                    row["op_counts"] = child.call("op_counts", timeout=max(budget.left(), 60.0))
                mb *= 2
            row["status"] = "done"
        except OutOfTime as exc:
            row["status"] = f"partial: {exc}"
        except BenchmarkError as exc:
            row["status"] = "failed"
            row["error"] = str(exc)[-3000:]
        finally:
            child.close(timeout=30.0)
        fits = [p for p in row["probes"] if not p["oom"]]
        if fits:
            best = fits[-1]
            if not compiled:
                eager_best[(size, pe)] = best["micro_batch"]
            row.update(micro_batch=best["micro_batch"], tokens_per_s=best["tokens_per_s"],
                       peak_mem_gib=best["peak_mem_gib"], finite=best["finite"],
                       flops_per_token=best["flops_per_token"])
            row.update({k: best[k] for k in (*ALLOCATOR_KEYS, "graph_breaks") if k in best})
            if "profile" in best:
                row["profile"] = best["profile"]
            if peak_tflops:
                achieved = best["tokens_per_s"] * row["flops_per_token"]
                mfu = checked_mfu(achieved, peak_tflops)
                if mfu is None:  # above 100 %: the peak is wrong, never a result
                    row["mfu_above_peak"] = (f"{achieved / 1e12:.1f} achieved vs {peak_tflops} "
                                             "peak TFLOP/s: MFU not reported")
                else:
                    row["mfu"] = mfu
        flush()
        if row["status"].startswith("partial"):
            raise OutOfTime(row["status"])
