"""End-to-end training through the real trainer: tokens/s, MFU and peak memory per model size
and encoding at the largest micro-batch that fits (searched upward by doubling, OOM caught).

Each (size, encoding) trainer lives in its own spawned process (``trainer_process.Child``),
so one's memory never limits another's, and an OOM or a crash loses only that row.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch

from gpu.common import Budget, OutOfTime


class TrainerProbe:
    """A set-up ``Trainer`` (built in the child process) that the parent drives step by step."""

    def __init__(self, recipe: Path, overrides: list[str]) -> None:
        from trainer_process import build_trainer

        from tape_train.model.flops import training_flops_per_token

        self.trainer = build_trainer(recipe, overrides)
        self.device = self.trainer.dist.device
        cfg = self.trainer.cfg
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)

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

    def measure(self, micro_batch: int, warmup: int, steps: int) -> dict:
        """Median step of ``micro_batch`` × seq_len random tokens; ``{"oom": True}`` if it
        does not fit (the trainer is unusable afterwards: search upward, stop at the first)."""
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
        try:
            for i in range(warmup + steps):
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
               "tokens_per_s": micro_batch * cfg.train.seq_len / step,
               "loss": losses[-1], "finite": all(x == x for x in losses),
               "flops_per_token": self.flops_per_token}
        if self.device.type == "cuda":
            res["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            res["reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        else:
            import resource

            res["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return res

    def close(self) -> None:
        self.trainer.close()


def end_to_end(recipe: Path, work: Path, plan: dict, peak_tflops: float | None,
               budget: Budget, sink: list, flush) -> None:
    """For each (size, encoding) of ``plan``: micro-batch 1, 2, 4, ... until OOM, the cap or the
    time budget; the last fitting one is the row's result (all probes are kept)."""
    from trainer_process import BenchmarkError, Child, trainer_overrides

    n = plan["seq_len"]
    work.mkdir(parents=True, exist_ok=True)
    for size, pe in itertools.product(plan["sizes"], plan["encodings"]):
        budget.check(f"end-to-end {size} {pe}")
        row = {"size": size, "pe": pe, "seq_len": n, "probes": [], "status": "running"}
        sink.append(row)
        overrides = [*trainer_overrides(size, pe, n, 1, work / f"{size}_{pe}"),
                     *plan["overrides"]]
        child = Child(f"{size}_{pe}", work / f"{size}_{pe}.log", TrainerProbe, recipe, overrides)
        t0 = time.monotonic()
        try:
            child.result()
            row["setup_s"] = time.monotonic() - t0
            mb = 1
            while mb <= plan["max_micro_batch"]:
                budget.check(f"{size} {pe} micro-batch {mb}")
                probe = child.call("measure", mb, plan["warmup"], plan["steps"])
                row["probes"].append(probe)
                flush()
                if probe["oom"]:
                    break
                mb *= 2
            row["status"] = "done"
        except OutOfTime as exc:
            row["status"] = f"partial: {exc}"
        except BenchmarkError as exc:
            row["status"] = "failed"
            row["error"] = str(exc)[-3000:]
        finally:
            child.close()
        fits = [p for p in row["probes"] if not p["oom"]]
        if fits:
            best = fits[-1]
            row.update(micro_batch=best["micro_batch"], tokens_per_s=best["tokens_per_s"],
                       peak_mem_gib=best["peak_mem_gib"], finite=best["finite"],
                       flops_per_token=best["flops_per_token"])
            if peak_tflops:
                row["mfu"] = best["tokens_per_s"] * row["flops_per_token"] / (peak_tflops * 1e12)
        flush()
        if row["status"].startswith("partial"):
            raise OutOfTime(row["status"])
