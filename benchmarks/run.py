"""The project's benchmark report, one command: training throughput, MFU and peak memory of
every positional encoding at N ∈ {256, 512, 1024, 2048}, TAPE/RoPE measured vs the FLOP model,
data pipeline throughput, and checkpoint save/load bandwidth next to raw disk I/O.

    python benchmarks/run.py                        # the full report -> docs/benchmarks.md
    python benchmarks/run.py --quick                # smoke run -> runs/benchmarks-quick/
    python benchmarks/run.py --parts checkpoint --checkpoint-model tiny

Writes ``<out-dir>/benchmarks.md`` and ``<out-dir>/benchmarks/`` (``benchmarks.json`` with
every raw number and the machine, ``throughput.png``, ``memory.png``). Nothing is asserted.

How each number is measured:

* training: full ``Trainer.train_step`` calls (synthetic data, forward + backward + DeepSpeed
  optimizer step) of ``--recipe`` (the README demo: ``tiny``, bf16, ZeRO-1, CPU) with a fixed
  number of tokens per step (micro-batch = tokens / N). Each (encoding, N) runs in its own
  spawned process, so its peak RSS (``ru_maxrss``) is its own; for one N all encodings are
  alive at once and their timed steps are interleaved round by round, so drifting machine load
  hits them alike. Warm-up steps are excluded; the median step counts. MFU = tokens/s ·
  ``training_flops_per_token`` / the best square-GEMM peak measured in the run
  (``tape_train.train.peak.measure_gemm_peak_tflops``, the trainer's CPU peak).
* data: ``benchmarks/data_throughput.py`` in a child process (its final JSON line).
* checkpoint: ``Trainer.save()`` and ``checkpoint.load_training_state`` of a real run, and in
  the same process a raw sequential write (+ fsync) and read of as many bytes in the same
  directory, alternated. Before each read the files' pages are dropped from this machine's
  page cache with ``posix_fadvise(DONTNEED)`` (a VM's host may still cache them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from benchmark_report import write_report  # noqa: E402
from checkpoint_io import measure_checkpoint  # noqa: E402
from trainer_process import (BenchmarkError, Child, build_trainer, peak_rss_mib,  # noqa: E402
                             trainer_overrides)

PARTS = ("data", "checkpoint", "training")
DATA_SEQ_LEN = 256  # the data benchmark packs blocks of this length
GIB = 2**30

# Defaults of the full report and of --quick; an option given explicitly wins over both.
FULL = dict(seq_lens=[256, 512, 1024, 2048], encodings=None, tokens_per_step=4096, warmup=2,
            rounds=4, steps=1, checkpoint_model="125m", checkpoint_reps=3, data_megabytes=8.0,
            data_repeats=3, out_dir=ROOT / "docs")
QUICK = dict(seq_lens=[128, 256], encodings=["tape", "rope"], tokens_per_step=1024, warmup=1,
             rounds=1, steps=2, checkpoint_model="tiny", checkpoint_reps=1, data_megabytes=0.5,
             data_repeats=1, out_dir=ROOT / "runs" / "benchmarks-quick")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"full-run defaults: {FULL}\n--quick defaults: {QUICK}")
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, a subset")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out-dir", type=Path, help="writes benchmarks.md and benchmarks/ here")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="scratch (run dirs, checkpoints, logs); its filesystem is the one the "
                        "checkpoint I/O measures (default: the system temp dir)")
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument("--update", action="store_true",
                   help="re-measure only --parts and merge them into the existing report in "
                        "--out-dir (e.g. one part that a busy machine disturbed)")
    p.add_argument("--recipe", type=Path, default=ROOT / "configs" / "train" / "demo.yaml")
    p.add_argument("--model", default="tiny", help="model size for the training part")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra run-config overrides for every trainer, e.g. "
                        "parallel.zero_stage=0 model.num_layers=2")
    p.add_argument("--encodings", nargs="+", help="default: all of POSITIONAL_ENCODINGS")
    p.add_argument("--seq-lens", nargs="+", type=int)
    p.add_argument("--tokens-per-step", type=int, help="micro-batch = this / N")
    p.add_argument("--warmup", type=int, help="untimed steps per worker")
    p.add_argument("--rounds", type=int, help="interleaved rounds over the encodings")
    p.add_argument("--steps", type=int, help="timed steps per encoding per round")
    p.add_argument("--checkpoint-model", help="model size whose checkpoint is saved/loaded")
    p.add_argument("--checkpoint-reps", type=int)
    p.add_argument("--data", type=Path, default=ROOT / "data" / "demo",
                   help="prepared corpus for the data part (tape-data prepare --demo)")
    p.add_argument("--tokenizer", type=Path, help="default: <data>/tokenizer.model")
    p.add_argument("--stdlib-text", action="store_true",
                   help="data part on Python's bundled text with a freshly trained tokenizer "
                        "instead of --data (no corpus needed)")
    p.add_argument("--data-megabytes", type=float)
    p.add_argument("--data-repeats", type=int)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tokenizer is None:
        args.tokenizer = args.data / "tokenizer.model"
    args.command = "python benchmarks/run.py" + "".join(f" {shlex.quote(a)}" for a in
                                                       (sys.argv[1:] if argv is None else argv))
    return args


def check_args(args) -> None:
    """Everything that can be wrong with the request, before anything slow runs."""
    from tape_train.config import load_run_config
    from tape_train.model import POSITIONAL_ENCODINGS, load_model_config
    from tape_train.model.flops import count_parameters

    if args.update and not (args.out_dir / "benchmarks" / "benchmarks.json").is_file():
        raise BenchmarkError(f"--update: no report to update in {args.out_dir} "
                             f"(benchmarks/benchmarks.json); run without --update first")
    if args.encodings is None:
        args.encodings = list(POSITIONAL_ENCODINGS)
    unknown = [pe for pe in args.encodings if pe not in POSITIONAL_ENCODINGS]
    if unknown:
        raise BenchmarkError(f"unknown encodings {unknown}; choose from {POSITIONAL_ENCODINGS}")
    if not args.recipe.is_file():
        raise BenchmarkError(f"--recipe {args.recipe} does not exist")
    if args.work_dir is not None and not args.work_dir.is_dir():
        raise BenchmarkError(f"--work-dir {args.work_dir} "
                             + ("is not a directory" if args.work_dir.exists()
                                else "does not exist") + "; the scratch is made inside it")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise BenchmarkError(f"--out-dir {args.out_dir} exists and is not a directory")
    if not args.data_megabytes > 0 or args.data_repeats < 1:
        raise BenchmarkError(f"--data-megabytes must be > 0 and --data-repeats >= 1, got "
                             f"{args.data_megabytes} and {args.data_repeats}")
    for n in args.seq_lens:
        if n <= 0:
            raise BenchmarkError(f"--seq-lens must be positive, got {n}")
        if args.tokens_per_step <= 0 or args.tokens_per_step % n:
            raise BenchmarkError(f"--tokens-per-step {args.tokens_per_step} is not a positive "
                                 f"multiple of N={n}: every N must see the same tokens per step")
    if min(args.warmup, args.rounds - 1, args.steps - 1, args.checkpoint_reps - 1) < 0:
        raise BenchmarkError("--warmup must be >= 0; --rounds, --steps, --checkpoint-reps >= 1")
    for size in (args.model, args.checkpoint_model):  # a bad recipe or size fails here
        load_run_config(args.recipe, trainer_overrides(size, args.encodings[0],
                                                       max(args.seq_lens), 1, Path("unused"))
                        + args.set)
    if "data" in args.parts and not args.stdlib_text:
        missing = [p for p in (args.data / "manifest.json", args.tokenizer) if not p.is_file()]
        if missing:
            raise BenchmarkError(
                f"the data part needs the demo corpus and tokenizer; missing: "
                f"{', '.join(map(str, missing))}. Build them with steps 1-2 of launch/demo.sh "
                f"(tape-data prepare --demo --out data/demo; tape-tokenizer train --input "
                f"data/demo --spec tokenizer/demo.yaml --out data/demo/tokenizer), or pass "
                f"--stdlib-text, or leave out the part (--parts training checkpoint)")
    if "training" in args.parts:
        # All encodings of one N are alive at once: fail now rather than be OOM-killed later.
        # Rough: 1.5 GiB (runtime + tiny's activations at 4k tokens) + bf16 weights, fp32
        # master, gradients and Adam moments (18 B per parameter) per worker.
        params = count_parameters(load_model_config(args.model))["total"]
        need = len(args.encodings) * (1.5 * GIB + 18 * params)
        available = _mem_available()
        if available is not None and need > available:
            raise BenchmarkError(
                f"{len(args.encodings)} {args.model} workers need ~{need / GIB:.1f} GiB, "
                f"{available / GIB:.1f} GiB are available: pass fewer --encodings")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class TrainWorker:
    """In a child: one Trainer (one encoding, one N) running timed steps."""

    def __init__(self, recipe: Path, overrides: list[str]) -> None:
        self.trainer = build_trainer(recipe, overrides)
        self.setup_peak_rss_mib = peak_rss_mib()
        self.losses: list[float] = []
        self.preemptions: list[int] = []

    def steps(self, count: int) -> list[float]:
        """Wall seconds of ``count`` full optimizer steps."""
        times = []
        for _ in range(count):
            switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
            start = time.perf_counter()
            self.losses.append(self.trainer.train_step()["loss"])
            times.append(time.perf_counter() - start)
            # Involuntary context switches: how often other processes took this one's CPU.
            self.preemptions.append(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
                                    - switches)
        return times

    def summary(self) -> dict:
        import torch

        return {"setup_peak_rss_mib": self.setup_peak_rss_mib, "peak_rss_mib": peak_rss_mib(),
                "threads": torch.get_num_threads(), "last_loss": self.losses[-1],
                "preemptions_per_step": self.preemptions}

    def close(self) -> None:
        self.trainer.close()


# ----------------------------------------------------------------------------------------------
# The three parts
# ----------------------------------------------------------------------------------------------


def measure_training(args, work: Path) -> dict:
    import torch

    from tape_train.config import load_run_config
    from tape_train.model.flops import training_flops_per_token
    from tape_train.train.peak import measure_gemm_peak_tflops

    def overrides(pe, n):
        return trainer_overrides(args.model, pe, n, args.tokens_per_step // n,
                                 work / f"{pe}-N{n}") + args.set

    configs = {(pe, n): load_run_config(args.recipe, overrides(pe, n))
               for n in args.seq_lens for pe in args.encodings}
    flops = {key: training_flops_per_token(cfg.model, key[1],
                                           micro_batch=cfg.train.micro_batch_size)
             for key, cfg in configs.items()}
    # The precision the trainers will resolve (``auto``: the same cached per-machine choice).
    from tape_train.precision import resolve_dtype

    dtype_name = resolve_dtype(next(iter(configs.values())).train.dtype, "cpu").dtype
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    steps_per_worker = args.warmup + args.rounds * args.steps
    total_work = sum(flops.values()) * steps_per_worker
    done_work, start = 0.0, time.perf_counter()
    peaks, rows = [], []
    for n in args.seq_lens:
        print(f"[training] N={n}: starting {len(args.encodings)} workers "
              f"(micro-batch {args.tokens_per_step // n})", flush=True)
        workers = {pe: Child(f"training worker {pe} N={n}", work / f"{pe}-N{n}.log",
                             TrainWorker, args.recipe, overrides(pe, n))
                   for pe in args.encodings}
        try:
            for worker in workers.values():
                worker.result()
            for pe, worker in workers.items():
                worker.call("steps", args.warmup)
                done_work += flops[pe, n] * args.warmup
            # Workers are idle now; the best peak of the run is MFU's denominator.
            peaks.append(measure_gemm_peak_tflops(dtype))
            times: dict[str, list[float]] = {pe: [] for pe in args.encodings}
            for rnd in range(args.rounds):
                k = rnd % len(args.encodings)  # rotate the order: no encoding always goes first
                for pe in args.encodings[k:] + args.encodings[:k]:
                    times[pe] += workers[pe].call("steps", args.steps)
                    done_work += flops[pe, n] * args.steps
                elapsed = time.perf_counter() - start
                eta = elapsed * (total_work - done_work) / done_work
                print(f"[training] N={n} round {rnd + 1}/{args.rounds}: " + ", ".join(
                    f"{pe} {statistics.median(t):.2f}s" for pe, t in times.items())
                    + f" per step | {100 * done_work / total_work:.0f}% of the training part, "
                    f"{elapsed / 60:.1f} min so far, ~{eta / 60:.1f} min left", flush=True)
            summary = {pe: worker.call("summary") for pe, worker in workers.items()}
        finally:
            for worker in workers.values():
                worker.close()
        for pe in args.encodings:
            step_s = statistics.median(times[pe])
            preempted = summary[pe]["preemptions_per_step"]
            summary[pe]["preemptions_per_step"] = preempted[args.warmup:]  # timed steps only
            rows.append({"pe": pe, "seq_len": n, "micro_batch": args.tokens_per_step // n,
                         "tokens_per_step": args.tokens_per_step, "step_times_s": times[pe],
                         "step_s": step_s, "tokens_per_s": args.tokens_per_step / step_s,
                         "flops_per_token": flops[pe, n], "load_1min": os.getloadavg()[0],
                         **summary[pe]})
    peak = max(peaks)
    from tape_train.train.peak import checked_mfu

    for row in rows:  # None where the result would exceed 100 %: then the peak is wrong
        row["mfu"] = checked_mfu(row["tokens_per_s"] * row["flops_per_token"], peak)
    return {"model": args.model, "overrides": args.set, "recipe": _shown(args.recipe),
            "dtype": dtype_name,
            "tokens_per_step": args.tokens_per_step, "warmup_steps": args.warmup,
            "rounds": args.rounds, "steps_per_round": args.steps,
            "gemm_peak_tflops": peak, "gemm_peak_tflops_per_n": dict(zip(args.seq_lens, peaks)),
            "memory_measure": "ru_maxrss of the worker process (one process per encoding and "
                              "N): peak resident set, including the Python/torch/DeepSpeed "
                              "runtime", "rows": rows, "tape_vs_rope": tape_vs_rope(rows)}


def tape_vs_rope(rows: list[dict]) -> list[dict]:
    """Per N: TAPE/RoPE median step time vs TAPE/RoPE training FLOPs per token."""
    by = {(r["pe"], r["seq_len"]): r for r in rows}
    out = []
    for (pe, n), tape in by.items():
        rope = by.get(("rope", n))
        if pe != "tape" or rope is None:
            continue
        time_ratio = tape["step_s"] / rope["step_s"]
        flop_ratio = tape["flops_per_token"] / rope["flops_per_token"]
        out.append({"seq_len": n, "time_ratio": time_ratio, "flop_ratio": flop_ratio,
                    "efficiency": flop_ratio / time_ratio})
    return out


def measure_data(args) -> dict:
    cmd = [sys.executable, str(HERE / "data_throughput.py"),
           "--megabytes", str(args.data_megabytes), "--repeats", str(args.data_repeats),
           "--train-steps", "1" if args.quick else "5", "--seq-len", str(DATA_SEQ_LEN)]
    if not args.stdlib_text:
        cmd += ["--data", str(args.data), "--tokenizer", str(args.tokenizer)]
    print(f"[data] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        print(f"[data]   {line.rstrip()}", flush=True)
    if proc.wait():
        raise BenchmarkError(f"benchmarks/data_throughput.py failed (exit {proc.returncode}); "
                             f"its output is above")
    summary = next((line for line in reversed(lines) if line.startswith("{")), None)
    if summary is None:
        raise BenchmarkError("benchmarks/data_throughput.py printed no JSON summary line")
    return {"command": " ".join(_shown(c) for c in cmd[1:]),
            "source": "stdlib text" if args.stdlib_text else _shown(args.data),
            "seq_len": DATA_SEQ_LEN,
            "log": [line.rstrip() for line in lines[:-1]], **json.loads(summary)}


# ----------------------------------------------------------------------------------------------


def machine_info() -> dict:
    from importlib.metadata import version

    import torch

    from tape_train.train.checkpoint import code_version

    fields = {}
    try:  # the first CPU's "key : value" lines
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = fields.get("model name") or platform.processor()
    # What bf16 GEMMs can use, hence what the MFU peak is made of.
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
           if f in fields.get("flags", "").split()]
    return {"cpu": cpu, "isa": isa, "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
            "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": version("deepspeed"), "platform": platform.platform(),
            "code_version": code_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (reports carry no machine paths)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def merge_into_existing(report: dict, args) -> dict:
    """The report in ``--out-dir`` with the parts just measured replaced, and the update
    recorded (command, date, load) so the page says which numbers are from which run."""
    path = args.out_dir / "benchmarks" / "benchmarks.json"
    if not path.is_file():
        raise BenchmarkError(f"--update: no report to update at {path}")
    merged = json.loads(path.read_text())
    for part in args.parts:
        merged[part] = report[part]
    merged.setdefault("updates", []).append(
        {"parts": list(args.parts), "command": args.command, "date": report["machine"]["date"],
         "load_average": report["load_average"]["end"],
         "code": report["machine"]["code_version"].get("git")})
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except (BenchmarkError, ValueError, FileNotFoundError) as exc:
        print(f"benchmarks/run.py: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="tape-bench-", dir=args.work_dir))
    print(f"benchmark report: parts {' '.join(args.parts)}; scratch {work}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    report = {"command": args.command, "machine": machine_info(),
              "load_average": {"start": os.getloadavg()}}
    start = time.perf_counter()
    try:
        if "data" in args.parts:
            report["data"] = measure_data(args)
        if "checkpoint" in args.parts:
            report["checkpoint"] = measure_checkpoint(args, work)
        if "training" in args.parts:
            report["training"] = measure_training(args, work)
    except BenchmarkError as exc:
        print(f"benchmarks/run.py: {exc}\n(scratch kept: {work})", file=sys.stderr)
        return 1
    report["load_average"]["end"] = os.getloadavg()
    report["elapsed_s"] = time.perf_counter() - start
    if args.update:
        report = merge_into_existing(report, args)
    written = write_report(report, args.out_dir)
    if not args.keep_work_dir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"done in {report['elapsed_s'] / 60:.1f} min; wrote "
          + ", ".join(str(p) for p in written), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
