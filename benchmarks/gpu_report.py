"""The GPU report, one command on any CUDA machine (≤ 10 min on one H100): correctness on the
device, attention-kernel speed, a launch-config sweep of the fused kernel, and end-to-end
training, with the targets of docs/kernel.md evaluated as met / missed.

    python benchmarks/gpu_report.py                       # -> docs/gpu/<gpu-model>/
    python benchmarks/gpu_report.py --out-dir $OUT --time-budget 540
    python benchmarks/gpu_report.py --sections sweep --sweep-extra   # the autotune table's data
    python benchmarks/gpu_report.py --cpu-smoke           # same code paths, tiny, CPU (tests)

Writes ``report.json`` (every number, the machine, ``"complete": false`` until the end),
``report.md`` (marked PARTIAL until the end) and ``kernel_speed.png`` / ``end_to_end.png``,
rewritten after every measurement, so a run cut short keeps what it measured. Sections run in
order, each with a share of the time left before the global deadline; one failing section is
recorded with its traceback and the next one runs. Exit code 1 if a correctness check failed
or a section crashed. ``--cpu-smoke`` runs the fused kernel in Triton's interpreter (fp32 only:
the interpreter's bf16 ``tl.dot`` is wrong in Triton 3.9), a tiny model and trainer (gloo).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTIONS = ("correctness", "kernel_speed", "end_to_end", "sweep")
SHARE = {"correctness": 0.2, "kernel_speed": 0.25, "end_to_end": 0.45, "sweep": 0.10}
STACK_DUMP_S = 90.0  # seconds past a section's budget before its stacks are printed

MODEL_SMALL = dict(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4,
                   intermediate_size=512, tape_position_size=16, max_seq_len=4096)
FULL = {
    "kernel": {"dtypes": ["float32", "bfloat16"], "head_dims": [32, 64, 128],
               "lengths": [128, 1000, 2065], "batch": 2, "heads": 3},
    "model": {"model": MODEL_SMALL, "seq": 1000, "batch": 2, "prompt": 300, "new": 8},
    "trainer": {"overrides": ["model.base=tiny", "model.pe=tape", "train.seq_len=256",
                              "train.micro_batch_size=4", "train.grad_accum_steps=2"],
                "steps": 4, "compile": True, "runs": None},
    # (D, heads): the 350m, 1b and 125m configs at D=64 and the same widths at D=128,
    # alternating D so that a run cut short still has both head dims.
    "speed": {"head_configs": [(64, 16), (128, 8), (64, 32), (128, 16), (64, 12), (128, 6)],
              "lengths": [1024, 2048, 4096, 8192, 16384], "tokens": 32768, "dtype": "bfloat16",
              "warmup": 3, "reps": 10,
              # TAPE's state update (M, D, P, N): 350m's heads, head dim, gate width and N
              "update_shape": [16, 64, 64, 2048]},
    "sweep": {"head_configs": [(64, 16), (128, 8)], "length": 4096, "tokens": 32768,
              "dtype": "bfloat16", "check_len": 300, "warmup": 2, "reps": 5, "extra": False},
    # compile: [false, true] adds a train.compile row after each eager one (side by side).
    "e2e": {"sizes": ["350m", "1b", "125m"], "encodings": ["tape", "rope"], "seq_len": 2048,
            "compile": [False], "min_micro_batch": 1, "max_micro_batch": 64, "warmup": 2,
            "steps": 3,
            "profile_steps": 1, "op_counts": True,
            "overrides": ["train.device=auto", "train.dtype=bf16", "parallel.zero_stage=1"]},
}
_TINY_TRAIN = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=2",
               "model.intermediate_size=128", "model.vocab_size=512"]
SMOKE = {
    "kernel": {"dtypes": ["float32"], "head_dims": [32, 64], "lengths": [40], "batch": 1,
               "heads": 2},
    "model": {"model": dict(MODEL_SMALL, vocab_size=97, hidden_size=64, num_heads=2,
                            intermediate_size=96, max_seq_len=64), "seq": 24, "batch": 2,
              "prompt": 16, "new": 4},
    # No train.compile run here: the suite tests compiling (tests/test_train_compile.py);
    # on a busy 2-core machine it would double this smoke's time.
    "trainer": {"overrides": ["model.base=tiny", "model.pe=tape", "train.seq_len=32",
                              "train.micro_batch_size=2", "train.grad_accum_steps=2",
                              *_TINY_TRAIN], "steps": 2, "compile": False, "runs": None},
    "speed": {"head_configs": [(32, 2)], "lengths": [32], "tokens": 64, "dtype": "float32",
              "warmup": 0, "reps": 1, "update_shape": [2, 32, 8, 32]},
    "sweep": {"head_configs": [(32, 2)], "length": 32, "tokens": 32, "dtype": "float32",
              "check_len": 24, "warmup": 0, "reps": 1, "extra": False, "max_per_kernel": 1},
    "e2e": {"sizes": ["tiny"], "encodings": ["tape", "rope"], "seq_len": 32, "compile": [False],
            "min_micro_batch": 1, "max_micro_batch": 2, "warmup": 1, "steps": 1, "profile_steps": 1,
            "op_counts": True,
            "overrides": ["train.device=cpu", "train.dtype=bf16", "parallel.zero_stage=1",
                          *_TINY_TRAIN]},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, help="default: docs/gpu/<gpu-model-slug>/")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="sections to run, in this order (default: all, in the order listed)")
    p.add_argument("--share", action="append", default=[], metavar="SECTION=FRACTION",
                   help="a section's share of the time budget (default: "
                        + ", ".join(f"{k}={v}" for k, v in SHARE.items()) + ")")
    p.add_argument("--plan", action="append", default=[], metavar="GROUP.KEY=JSON",
                   help="override one entry of the plan, e.g. "
                        "'sweep.head_configs=[[128, 8]]' or 'speed.lengths=[2048, 16384]'")
    p.add_argument("--time-budget", type=float,
                   help="seconds for the whole report (global deadline); default 540 on a GPU, "
                        "1500 with --cpu-smoke (Triton's interpreter on a busy CPU)")
    p.add_argument("--sweep-extra", action="store_true",
                   help="sweep larger tiles beyond the tables' entries too")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU, the kernel in Triton's interpreter")
    p.add_argument("--work-dir", type=Path, help="trainer run dirs and logs (default: a temp dir)")
    args = p.parse_args(argv)
    args.shares = dict(SHARE)
    for item in args.share:
        name, _, value = item.partition("=")
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if name not in SHARE or not 0 < fraction <= 1:
            p.error(f"--share {item!r}: expected SECTION=FRACTION with SECTION one of "
                    f"{', '.join(SECTIONS)} and 0 < FRACTION <= 1")
        args.shares[name] = fraction
    args.command = "python benchmarks/gpu_report.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
    return args


class Report:
    """The JSON document, rewritten (with its Markdown) after every result."""

    def __init__(self, out_dir: Path, command: str, smoke: bool) -> None:
        self.out_dir, self.t0 = out_dir, time.monotonic()
        self.data = {"complete": False, "smoke": smoke, "command": command,
                     "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "elapsed_s": 0.0, "machine": {}, "sections": {}, "targets": {}}

    def section(self, name: str) -> list:
        self.data["sections"][name] = {"status": "running", "results": []}
        return self.data["sections"][name]["results"]

    def flush(self) -> None:
        from gpu.render import evaluate_targets, markdown

        self.data["elapsed_s"] = time.monotonic() - self.t0
        self.data["targets"] = evaluate_targets(self.data)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in (("report.json", json.dumps(self.data, indent=1, default=str)),
                           ("report.md", markdown(self.data))):
            tmp = self.out_dir / f".{name}.tmp"
            tmp.write_text(text + "\n")
            tmp.replace(self.out_dir / name)


def run_section(name: str, args, plan: dict, report: Report, device, deadline: float,
                remaining: list[str], work: Path) -> bool:
    """Run one section inside its budget; returns False if it crashed or a check failed."""
    from gpu import correctness, end_to_end, kernel_speed
    from gpu.common import Budget, OutOfTime

    shares = sum(args.shares[s] for s in remaining)
    budget = Budget(seconds=(deadline - time.monotonic()) * args.shares[name] / shares,
                    deadline=deadline)
    sink, flush = report.section(name), report.flush
    sec = report.data["sections"][name]
    print(f"gpu_report: {name} (budget {budget.left():.0f} s)", flush=True)
    # A section running long past its budget (a compile taking minutes, a hung call) prints
    # every thread's stack, and again each STACK_DUMP_S after, into the log.
    faulthandler.dump_traceback_later(budget.left() + STACK_DUMP_S, repeat=True)
    ok = True
    try:
        if name == "correctness":
            tp = plan["trainer"]
            overrides = [*tp["overrides"], f"train.device={device.type}",
                         "train.synthetic_data=true", "train.max_steps=1000",
                         "eval.interval=0", "logging.tensorboard=false",
                         "logging.progress_bar=false", "logging.peak_tflops=1.0"]
            trainers = correctness.start_trainers(
                ROOT / "configs/train/demo.yaml", work / "trainer", overrides,
                correctness.trainer_run_names(tp["runs"], tp["compile"]))
            # Model and KV-cache checks while the trainers set up; the many kernel cases last,
            # so that a short budget cuts kernel cases, not whole kinds of check.
            try:
                mp = plan["model"]
                sink.append({"check": "model_backend", **correctness.guarded(
                    correctness.model_backend_check, device, mp["model"], mp["seq"],
                    mp["batch"])})
                flush()
                budget.check("KV-cache check")
                sink.append({"check": "kv_cache", **correctness.guarded(
                    correctness.kv_cache_check, device, mp["model"], mp["prompt"], mp["new"])})
                flush()
            finally:  # skipped, not failed, when time is out; always closes the trainers
                correctness.trainer_checks(trainers, tp["steps"], budget, sink, flush)
            correctness.kernel_checks(device, plan["kernel"], budget, sink, flush)
            ok = not any(r.get("ok", r.get("control", {}).get("ok")) is False for r in sink)
        elif name == "kernel_speed":
            kernel_speed.kernel_speed(device, plan["speed"], budget, sink, flush)
        elif name == "sweep":
            from tape_train.kernels.tape_attention_configs import arch_for_capability

            arch = (arch_for_capability(*__import__("torch").cuda.get_device_capability(device))
                    if device.type == "cuda" else 90)
            sweep_plan = dict(plan["sweep"], extra=plan["sweep"]["extra"] or args.sweep_extra)
            try:
                kernel_speed.sweep(device, sweep_plan, arch, budget, sink, flush)
            finally:  # a sweep cut short still ranks what it measured
                sec["paste"] = kernel_speed.table_lines(sink, arch)
        elif name == "end_to_end":
            end_to_end.end_to_end(ROOT / "configs/train/demo.yaml", work / "e2e", plan["e2e"],
                                  report.data["machine"].get("bf16_peak_tflops"), budget, sink,
                                  flush)
        sec["status"] = "done"
    except OutOfTime as exc:
        sec["status"] = f"partial ({exc})"
    except Exception:  # noqa: BLE001 - one section's crash must not lose the others
        sec["status"] = "failed"
        sec["error"] = traceback.format_exc()
        print(sec["error"], file=sys.stderr, flush=True)
        ok = False
    finally:
        faulthandler.cancel_dump_traceback_later()
    sec["elapsed_s"] = round(time.monotonic() - budget.start, 1)
    report.flush()
    print(f"gpu_report: {name}: {sec['status']} ({sec['elapsed_s']:.0f} s)", flush=True)
    return ok


def apply_plan_overrides(plan: dict, items: list[str]) -> dict:
    """A copy of ``plan`` with ``GROUP.KEY=JSON`` entries replaced (the value's JSON type must
    match the default's: a list stays a list)."""
    plan = json.loads(json.dumps(plan))
    for item in items:
        path, _, text = item.partition("=")
        group, _, key = path.partition(".")
        if group not in plan or key not in plan[group]:
            keys = ", ".join(f"{g}.{k}" for g in plan for k in plan[g])
            raise SystemExit(f"gpu_report: --plan {item!r}: unknown entry {path!r}; one of {keys}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"gpu_report: --plan {item!r}: value is not JSON ({exc})") from None
        default = plan[group][key]
        if default is not None and type(value) is not type(default) and not (
                isinstance(default, float) and isinstance(value, int)):
            raise SystemExit(f"gpu_report: --plan {item!r}: expected a {type(default).__name__} "
                             f"like {json.dumps(default)}")
        plan[group][key] = value
    return plan


def build_cpu_adam_first(args) -> float:
    """``--cpu-smoke`` with the offloaded trainer run: build DeepSpeed's CPU Adam op (a minute
    or more on a fresh venv, cached afterwards) before the sections' clock runs, so a cold
    cache does not eat the correctness section's share; returns the seconds it took."""
    from gpu.correctness import OFFLOAD_RUN, trainer_run_names

    plan = apply_plan_overrides(SMOKE, args.plan)
    try:
        runs = trainer_run_names(plan["trainer"]["runs"])
    except ValueError:
        return 0.0  # main() names the bad run
    if "correctness" not in args.sections or OFFLOAD_RUN not in runs:
        return 0.0
    from tape_train.train.distributed import use_venv_extensions_dir
    from tape_train.train.optim import cpu_adam_problem

    start = time.monotonic()
    print(f"gpu_report: loading DeepSpeed's CPU Adam op for {OFFLOAD_RUN} (built once into "
          f"{use_venv_extensions_dir()}, before the time budget starts)", flush=True)
    problem = cpu_adam_problem()
    took = time.monotonic() - start
    print(f"gpu_report: CPU Adam op {'unavailable: ' + problem if problem else 'ready'} "
          f"({took:.0f} s)", flush=True)
    return took


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.time_budget is None:
        args.time_budget = 1500.0 if args.cpu_smoke else 540.0
    deadline = time.monotonic() + args.time_budget
    if args.cpu_smoke:  # must precede the first import of Triton
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [str(ROOT), str(HERE)]
    import torch

    if args.cpu_smoke:
        deadline += build_cpu_adam_first(args)

    from gpu.common import device_facts, gpu_slug, measure_matmul_tflops
    from gpu.render import plots, target_lines

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_report: no CUDA device (use --cpu-smoke to check the code paths on CPU)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    plan = apply_plan_overrides(SMOKE if args.cpu_smoke else FULL, args.plan)
    from gpu.correctness import trainer_run_names

    try:  # a mistyped run name before any device work
        trainer_run_names(plan["trainer"]["runs"])
    except ValueError as exc:
        print(f"gpu_report: --plan trainer.runs: {exc}", file=sys.stderr)
        return 2
    facts = device_facts(device)
    out_dir = args.out_dir or ROOT / "docs" / "gpu" / gpu_slug(facts["name"])
    report = Report(out_dir, args.command, args.cpu_smoke)
    report.data["machine"] = facts
    if device.type == "cuda":
        facts["matmul_tflops"] = measure_matmul_tflops(device, 8192, reps=10)
    report.flush()
    work_ctx = (tempfile.TemporaryDirectory(prefix="gpu_report_") if args.work_dir is None
                else None)
    work = Path(work_ctx.name) if work_ctx else args.work_dir
    ok = True
    order = list(dict.fromkeys(args.sections))
    try:
        for i, name in enumerate(order):
            ok &= run_section(name, args, plan, report, device, deadline, order[i:], work)
    finally:
        if work_ctx is not None:
            work_ctx.cleanup()
    report.data["complete"] = True
    report.flush()
    report.data["plots"] = plots(report.data, out_dir)
    report.flush()
    print("\n".join(target_lines(report.data["targets"])))
    if "sweep" in report.data["sections"]:
        print("autotune rows (paste into tape_attention_configs.TABLE):")
        print("\n".join(report.data["sections"]["sweep"].get("paste", [])))
    print(f"gpu_report: wrote {out_dir}/report.md ({report.data['elapsed_s']:.0f} s, "
          f"{'all checks passed' if ok else 'SOME CHECKS FAILED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
