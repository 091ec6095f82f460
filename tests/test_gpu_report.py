"""benchmarks/gpu_report.py: the --cpu-smoke run (the report's real code paths at tiny shapes:
fused kernel in Triton's interpreter, tiny model, trainer steps through DeepSpeed with gloo)
writes a complete JSON + Markdown report with finite numbers; target verdicts and partial
reports; the GPU lease command stays within the device tool's limits."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu.render import evaluate_targets, markdown  # noqa: E402


def _numbers(obj):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


@pytest.mark.slow
@pytest.mark.integration
def test_cpu_smoke_report_is_complete_and_finite(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_report.py", "--cpu-smoke",
                           "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["complete"] and data["smoke"]
    assert list(data["sections"]) == ["correctness", "kernel_speed", "end_to_end", "sweep"]
    for name, sec in data["sections"].items():
        assert sec["status"] == "done", (name, sec.get("error"))
    corr = data["sections"]["correctness"]["results"]
    kernel = [r for r in corr if "errors" in r]
    assert {(r["D"], r["dq"]) for r in kernel} == {(32, "atomic"), (32, "deterministic"),
                                                   (64, "atomic"), (64, "deterministic")}
    assert all(r["ok"] and max(r["errors"].values()) < 1e-4 for r in kernel)
    assert set(kernel[0]["errors"]) == {"O", "E0_hat", "E1_hat", "dq", "dk", "dv", "dE0", "dE1"}
    control = next(r["control"] for r in corr if "control" in r)
    assert control["ok"] and control["error"] > 0.1  # negative control: must differ
    checks = {r.get("check"): r for r in corr if "check" in r}
    assert checks["model_backend"]["ok"] and checks["kv_cache"]["ok"]
    trainer = checks["trainer"]
    assert trainer["ok"] and not trainer["failures"]
    assert set(trainer["losses"]) == {"zero1_fp32", "zero1_bf16", "zero3_fp32", "zero3_bf16",
                                      "zero3_bf16_deterministic",
                                      "zero3_bf16_deterministic_again", "zero3_fp32_offload"}
    assert len(trainer["comparisons"]) == 6
    assert trainer["comparisons"]["fp32: zero3 offloaded vs on the device"] <= 2e-3
    assert trainer["comparisons"]["bf16 deterministic: run vs the same run again"] == 0.0
    syncs = checks["host_syncs"]  # judged: 2 micro-batches per step, none read back in each
    assert syncs["ok"] and set(syncs["runs"]) == {"zero1_bf16", "zero3_bf16"}
    assert all(r["micro_batches"] == 2 and r["per_step"] >= 4 for r in syncs["runs"].values())
    update, *attention = data["sections"]["kernel_speed"]["results"]
    assert update["kind"] == "state_update" and set(update["variants"]) == {"plain", "node"}
    for v in update["variants"].values():
        assert v["ms"] > 0 and v["host_ms"] > 0 and v["kept_mib"] > 0
    assert update["variants"]["node"]["kept_mib"] < update["variants"]["plain"]["kept_mib"]
    speed = attention[0]["methods"]
    for name in ("tape_fused", "tape_unfused", "rope_flash"):
        assert speed[name]["fwd_bwd_ms"] > 0, name
    e2e = data["sections"]["end_to_end"]["results"]
    assert {(r["size"], r["pe"]) for r in e2e} == {("tiny", "tape"), ("tiny", "rope")}
    assert all(r["tokens_per_s"] > 0 and r["finite"] and r["status"] == "done" for r in e2e)
    for r in e2e:  # one profiled step at the largest micro-batch: CPU operators' own time
        prof = r["profile"]
        assert prof["device"] == "cpu" and prof["categories"]["matmul"] > 0, prof
        assert 0 < prof["busy_ms"] <= 1.05 * prof["step_ms"], prof
        ops = r["op_counts"]  # a step's operators by phase (benchmarks/step_ops.py)
        assert {"forward", "backward", "optimizer_step/adamw"} <= set(ops["phases"]), ops
        scan = ops["phases"].get("optimizer_step/overflow scan", {"ops": 0})  # ZeRO-1 bf16:
        assert "optimizer_step/grad norm" in ops["phases"] and scan["ops"] == 0, ops  # none
        assert ops["totals"]["ops"] > ops["phases"]["forward"]["ops"] > 0, ops
    sweep = data["sections"]["sweep"]
    assert {r["kernel"] for r in sweep["results"]} == {"fwd", "bwd_dkv", "bwd_dq"}
    assert all(r["ok"] for r in sweep["results"]) and len(sweep["paste"]) == 3
    assert all(math.isfinite(x) for x in _numbers(data))
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# GPU report\n") and "PARTIAL" not in md
    for heading in ("## Targets", "## correctness", "## kernel speed", "## end to end", "## sweep"):
        assert heading in md
    assert "| matmul | " in md and "Where a step's time goes" in md
    assert "- TAPE state update (one block, both tables;" in md
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["end_to_end.png", "kernel_speed.png"]


def _speed_row(n, d, fused, flash):
    return {"N": n, "D": d, "heads": 16, "batch": 1,
            "methods": {"tape_fused": {"fwd_bwd_tflops": fused},
                        "rope_flash": {"fwd_bwd_tflops": flash}}}


def _report(speed, e2e, complete=True):
    return {"complete": complete, "command": "x", "started": "now", "elapsed_s": 1.0,
            "machine": {"name": "GPU"}, "targets": {},
            "sections": {"kernel_speed": {"status": "done", "results": speed},
                         "end_to_end": {"status": "done", "results": e2e}}}


def test_targets_met_missed_and_not_measured():
    speed = [_speed_row(1024, 64, 100.0, 400.0),  # N=1k: outside the target's range
             _speed_row(2048, 64, 300.0, 400.0), _speed_row(4096, 128, 200.0, 400.0)]
    e2e = [{"size": "350m", "pe": "tape", "tokens_per_s": 95.0},
           {"size": "350m", "pe": "rope", "tokens_per_s": 100.0},
           {"size": "1b", "pe": "rope", "tokens_per_s": 1.0, "mfu": 0.35}]
    t = evaluate_targets(_report(speed, e2e))
    assert t["kernel"]["status"] == "missed"
    assert t["kernel"]["worst"] == pytest.approx(0.5) and t["kernel"]["worst_at"] == "D=128 H=16 N=4096"
    assert t["kernel"]["gap"] == pytest.approx(0.1)
    assert t["e2e_ratio"]["status"] == "met" and t["e2e_ratio"]["worst"] == pytest.approx(0.95)
    assert t["rope_mfu"]["status"] == "missed" and t["rope_mfu"]["gap"] == pytest.approx(0.05)
    empty = evaluate_targets(_report([_speed_row(1024, 64, 1.0, 1.0)], []))
    assert {v["status"] for v in empty.values()} == {"not measured"}


def test_end_to_end_targets_judge_the_better_setting_and_show_both():
    """With ``train.compile`` rows beside the eager ones, TAPE/RoPE and RoPE's MFU are each
    compared like with like (eager with eager, compiled with compiled) and judged on the
    better setting; the report names both and marks compiled rows."""
    from gpu.render import target_lines

    e2e = [{"size": "350m", "pe": "tape", "tokens_per_s": 80.0, "status": "done"},
           {"size": "350m", "pe": "tape", "compile": True, "tokens_per_s": 99.0,
            "status": "done"},
           {"size": "350m", "pe": "rope", "tokens_per_s": 100.0, "status": "done"},
           {"size": "350m", "pe": "rope", "compile": True, "tokens_per_s": 120.0,
            "status": "done"},
           {"size": "1b", "pe": "rope", "tokens_per_s": 1.0, "mfu": 0.30, "status": "done"},
           {"size": "1b", "pe": "rope", "compile": True, "tokens_per_s": 1.0, "mfu": 0.42,
            "status": "done"}]
    t = evaluate_targets(_report([], e2e))
    # eager 0.80, compiled 0.825: neither mixes a compiled TAPE with an eager RoPE (0.99).
    assert t["e2e_ratio"]["status"] == "missed"
    assert t["e2e_ratio"]["worst"] == pytest.approx(99 / 120)
    assert t["e2e_ratio"]["all"] == {"350m N=2048": pytest.approx(0.8),
                                     "350m N=2048 compiled": pytest.approx(99 / 120)}
    assert t["rope_mfu"]["status"] == "met" and t["rope_mfu"]["worst_at"] == "1b N=2048 compiled"
    line = next(x for x in target_lines(t) if x.startswith("target e2e_ratio"))
    assert "best" in line and "350m N=2048: 0.800" in line
    data = _report([], e2e)
    data["targets"] = t
    md = markdown(data)
    assert "| 350m | tape +compile |" in md and "| 350m | tape |" in md
    assert "Graph breaks" not in md                      # no compiled row recorded any
    e2e[1]["graph_breaks"] = {"Skip calling `torch.compiler.disable()`d function": 4,
                              "Unsupported: call_function get_device_capability": 2}
    md = markdown(data)
    assert ("- 350m tape +compile: Skip calling `torch.compiler.disable()`d function ×4; "
            "Unsupported: call_function get_device_capability ×2") in md


def test_partial_report_is_marked():
    data = _report([], [], complete=False)
    data["targets"] = evaluate_targets(data)
    assert markdown(data).startswith("# GPU report — PARTIAL")


# The device tool's limits: 600 s a command, 15 minutes of device time a session in all
# (machine start, transfers and idle time included; a start took 1-2 minutes).
DEVICE_SECONDS, START_S, CALL_OVERHEAD_S = 900, 120, 60


def test_lease_command_fits_the_device_tool():
    """One line per device call. The first alone settles the issue's core (correctness on the
    device, the kernel-speed and end-to-end targets: it must run those three sections); the
    calls together fit one session's device time with a machine start and, per call, the
    wheel install, the report's start-up and final write; each inside 600 s."""
    import gpu_report
    from gpu.correctness import trainer_run_names

    cmds = (REPO / "benchmarks/gpu/lease_command.txt").read_text().strip().splitlines()
    spent = START_S
    for i, cmd in enumerate(cmds):
        assert len(cmd) <= 2000
        assert "--no-index --no-deps" in cmd and ".lease/whl/*.whl" in cmd
        assert "benchmarks/gpu_report.py --out-dir $OUT" in cmd
        budget = float(cmd.split("--time-budget ")[1].split()[0])
        assert budget + CALL_OVERHEAD_S <= 600
        spent += budget + CALL_OVERHEAD_S
        args = gpu_report.parse_args(shlex.split(
            cmd.split("gpu_report.py ")[1].split(" 2>&1")[0].replace("$OUT", "/out")))
        plan = gpu_report.apply_plan_overrides(gpu_report.FULL, args.plan)
        trainer_run_names(plan["trainer"]["runs"])  # no unknown run name
        if i == 0:
            assert {"correctness", "kernel_speed", "end_to_end"} <= set(args.sections)
            assert "rope" in plan["e2e"]["encodings"] and "1b" in plan["e2e"]["sizes"]
    assert spent <= DEVICE_SECONDS
    assert ".lease/" in (REPO / ".gitignore").read_text().split()


class _FakeTrainerRun:
    """A trainer process of the correctness section that reports ``losses`` at once."""

    def __init__(self, losses):
        self._losses = losses

    def result(self, timeout=None):
        return None

    def call(self, method, *args, timeout=None):
        if method == "host_syncs":
            return {"steps": 1, "micro_batches": 2, "per_step": 0, "sites": {},
                    "per_micro_batch": {}}
        return list(self._losses)

    def close(self, timeout=None):
        return None


def test_a_subset_of_trainer_runs_is_judged_on_its_own_comparisons():
    """``--plan trainer.runs=[...]`` starts only those runs: the checks judge the comparisons
    whose two runs were started (a missing one is not needed), and a started run that never
    reported leaves the result unjudged, never passed. An unknown name is refused up front."""
    import time as _time

    from gpu import correctness
    from gpu.common import Budget

    assert correctness.trainer_run_names(["zero3_bf16", "zero1_bf16"]) == ["zero1_bf16",
                                                                           "zero3_bf16"]
    assert correctness.COMPILE_RUN not in correctness.trainer_run_names(None, compile_run=False)
    with pytest.raises(ValueError, match="'zero2_bf16'.*one of zero1_fp32"):
        correctness.trainer_run_names(["zero1_bf16", "zero2_bf16"])
    with pytest.raises(ValueError, match="list of run names"):
        correctness.trainer_run_names("zero1_bf16")

    def judge(runs):
        sink = []
        correctness.trainer_checks(runs, 2, Budget(60.0, _time.monotonic() + 60.0), sink,
                                   lambda: None)
        return next(r for r in sink if r["check"] == "trainer")

    four = {n: _FakeTrainerRun([5.0, 4.9])
            for n in ("zero1_fp32", "zero1_bf16", "zero3_fp32", "zero3_bf16")}
    res = judge(four)
    assert res["ok"] is True and set(res["comparisons"]) == {
        "zero1: bf16 vs fp32", "zero3: bf16 vs fp32", "fp32: zero3 vs zero1",
        "bf16: zero3 vs zero1"}
    four["zero3_bf16"] = _FakeTrainerRun([])          # started, no losses: not judged
    assert judge(four)["ok"] is None
    four["zero3_bf16"] = _FakeTrainerRun([5.0, 4.9 * 1.1])  # 10 % off fp32: failed
    assert judge(four)["ok"] is False


def test_a_crashing_check_fails_alone_and_the_next_ones_run(capsys):
    """On a device a kernel may fail to compile or launch: that check is recorded as crashed
    (ok False, the error in one line, the traceback in the log) and the following checks still
    run; the Markdown names it. Running out of time still stops the section."""
    import torch

    from gpu import correctness
    from gpu.common import Budget, OutOfTime

    calls = []

    def case(device, dtype, d, n, det, b, m):
        calls.append((d, n, det))
        if d == 64:
            raise RuntimeError("out of resource: shared memory, Required: 232448")
        return {"dtype": "float32", "D": d, "N": n, "batch": b, "heads": m,
                "dq": "deterministic" if det else "atomic", "errors": {"o": 1e-7},
                "tolerance": {"o": 1e-5}, "ok": True}

    shapes = {"dtypes": ["float32"], "head_dims": [32, 64], "lengths": [128], "batch": 1,
              "heads": 2}
    sink = []
    original = correctness.kernel_case, correctness.kernel_control
    correctness.kernel_case = case
    correctness.kernel_control = lambda *a: {"what": "control", "error": 1.0, "ok": True}
    try:
        correctness.kernel_checks(torch.device("cpu"), shapes,
                                  Budget(seconds=60, deadline=time.monotonic() + 60), sink,
                                  lambda: None)
    finally:
        correctness.kernel_case, correctness.kernel_control = original
    assert calls == [(32, 128, False), (32, 128, True), (64, 128, False), (64, 128, True)]
    crashed = [r for r in sink if "crash" in r]
    assert len(crashed) == 2 and all(r["ok"] is False and r["D"] == 64 for r in crashed)
    assert crashed[0]["crash"] == "RuntimeError: out of resource: shared memory, Required: 232448"
    assert "Traceback" in capsys.readouterr().err
    data = _report([], [])
    data["sections"]["correctness"] = {"status": "done", "results": sink}
    data["targets"] = evaluate_targets(data)
    md = markdown(data)
    assert "| float32 | 64 | 128 | atomic | crashed: RuntimeError: out of resource" in md
    assert "| float32 | 32 | 128 | atomic | 1.0e-07 | yes |" in md
    with pytest.raises(OutOfTime):  # the budget, unlike a crash, ends the section
        correctness.guarded(lambda: Budget(seconds=0, deadline=time.monotonic()).check("x"))


class _Event:
    def __init__(self, key, device_us=0.0, cpu_us=0.0, count=1, cuda=False, annotation=False):
        from torch.autograd import DeviceType

        self.key, self.count, self.is_user_annotation = key, count, annotation
        self.self_device_time_total, self.self_cpu_time_total = device_us, cpu_us
        self.device_type = DeviceType.CUDA if cuda else DeviceType.CPU


class _Profile:
    def __init__(self, events):
        self.events = events

    def key_averages(self):
        return self.events


def test_a_profiled_steps_time_is_split_by_kernel_category():
    """Device kernels by category per step (the operators that launched them not counted
    again, nor a record_function range's span on the device's timeline: torch.optim's step
    is one), the idle rest of the step, the largest kernels first; names no category knows
    are "other" (negative control)."""
    from gpu.end_to_end import OTHER, categorize, time_breakdown

    prof = _Profile([
        _Event("aten::mm", device_us=9000, cpu_us=300),  # an operator: its kernels count
        _Event("sm90_xmma_gemm_bf16bf16_bf16f32", device_us=9000, count=4, cuda=True),
        _Event("tape_attention_fwd_kernel", device_us=4000, count=2, cuda=True),
        _Event("tape_attention_bwd_dkv_kernel", device_us=6000, count=2, cuda=True),
        _Event("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", device_us=2000, cuda=True),
        _Event("Memcpy HtoD (Pageable -> Device)", device_us=500, cuda=True),
        _Event("void at::native::vectorized_elementwise_kernel", device_us=1500, cuda=True),
        _Event("Optimizer.step#FusedAdam.step", device_us=3000, cuda=True, annotation=True),
        _Event("tape_train/backward", device_us=12000, cuda=True, annotation=True),
    ])
    out = time_breakdown(prof, steps=2, step_ms=15.0)
    assert out["device"] == "cuda"
    assert out["categories"] == pytest.approx({
        "TAPE attention (fused kernel)": 5.0, "matmul": 4.5, "communication": 1.0,
        OTHER: 0.75, "memory copies": 0.25})
    assert out["busy_ms"] == pytest.approx(11.5) and out["idle_ms"] == pytest.approx(3.5)
    assert [k["name"] for k in out["top"][:2]] == ["sm90_xmma_gemm_bf16bf16_bf16f32",
                                                   "tape_attention_bwd_dkv_kernel"]
    assert out["top"][0]["calls"] == 2
    # the host's side: operators by their own CPU time, device kernels not among them
    assert [(h["name"], h["ms"]) for h in out["host_top"]] == [("aten::mm", 0.15)]
    assert categorize("flash_fwd_kernel") == "attention (SDPA, flash, cuDNN, unfused)"
    assert categorize("some_new_kernel") == OTHER
    cpu = time_breakdown(_Profile([_Event("aten::mm", cpu_us=4000),
                                   _Event("ProfilerStep#3", cpu_us=100)]), 1, 5.0)
    assert cpu["device"] == "cpu" and cpu["categories"] == {"matmul": 4.0}
    assert cpu["idle_ms"] is None


def test_plan_and_share_overrides_are_checked_and_applied():
    """A lease's call runs a chosen slice: --plan replaces one plan entry (type-checked, unknown
    names refused with the valid ones), --share one section's share, --sections their order."""
    import gpu_report

    args = gpu_report.parse_args(["--sections", "sweep", "correctness", "--share", "sweep=0.5",
                                  "--plan", "sweep.head_configs=[[128, 8]]",
                                  "--plan", "speed.lengths=[2048]"])
    assert args.sections == ["sweep", "correctness"] and args.shares["sweep"] == 0.5
    assert args.shares["correctness"] == gpu_report.SHARE["correctness"]
    plan = gpu_report.apply_plan_overrides(gpu_report.FULL, args.plan)
    assert plan["sweep"]["head_configs"] == [[128, 8]] and plan["speed"]["lengths"] == [2048]
    assert plan["kernel"] == gpu_report.FULL["kernel"]
    assert gpu_report.FULL["speed"]["lengths"] != [2048]  # the default plan is untouched
    for bad, message in (("sweep.nope=1", "unknown entry 'sweep.nope'"),
                         ("speed.lengths=2048", "expected a list"),
                         ("speed.lengths=[2048", "not JSON")):
        with pytest.raises(SystemExit, match=message):
            gpu_report.apply_plan_overrides(gpu_report.FULL, [bad])
    for bad in ("sweep=2", "nope=0.1", "sweep=x"):
        with pytest.raises(SystemExit):
            gpu_report.parse_args(["--share", bad])


def _sleeper(seconds):
    print("asleep", flush=True)  # into the child's log
    time.sleep(seconds)
    return seconds


class _Slow:
    def __init__(self, seconds: float) -> None:
        _sleeper(seconds)

    def close(self) -> None:
        pass


def test_a_stuck_child_gives_up_with_its_stack(tmp_path):
    """A trainer that never answers (a compile taking minutes, a hang) must not hold the lease:
    the wait ends at its timeout with the child's own stack (SIGUSR1 -> faulthandler) in the
    error; a child that answers in time is waited for (control)."""
    from trainer_process import BenchmarkError, Child

    log = tmp_path / "stuck.log"
    stuck = Child("stuck", log, _Slow, 600.0)
    # Its stack is asked for once it is inside _sleeper (a spawned child can take longer than
    # the timeout to get there on a busy machine; a signal before faulthandler is set kills it).
    deadline = time.monotonic() + 120
    while not (log.exists() and "asleep" in log.read_text()):
        assert time.monotonic() < deadline and stuck.proc.is_alive()
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(BenchmarkError, match="no answer in 3 s") as err:
        stuck.result(timeout=3.0)
    assert time.monotonic() - start < 60
    assert "in _sleeper" in str(err.value)  # the child's stack, from its log
    stuck.close(timeout=1.0)
    assert not stuck.proc.is_alive()
    quick = Child("quick", tmp_path / "quick.log", _Slow, 0.0)
    assert quick.result(timeout=120.0) is None
    quick.close()


def test_a_child_that_ends_before_it_opens_its_log_is_a_benchmark_error(tmp_path):
    """A child gone before its log exists (here: the log's directory is missing) is reported as
    died, saying there is no log; reading the log was a FileNotFoundError instead."""
    from trainer_process import BenchmarkError, Child

    gone = Child("gone", tmp_path / "missing" / "gone.log", _Slow, 0.0)
    with pytest.raises(BenchmarkError, match=r"gone died \(exit code 1\)") as err:
        gone.result(timeout=120.0)
    assert "(no log: the child never opened it)" in str(err.value)
    gone.close()


def test_compiled_end_to_end_rows_follow_their_eager_row(monkeypatch, tmp_path):
    """``e2e.compile=[false, true]``: after each eager row the same model runs with
    ``train.compile=true`` (and only then), its micro-batch search starting where the eager
    one ended; a compiled row that fits more goes on doubling."""
    import time as _time

    import trainer_process
    from gpu import end_to_end
    from gpu.common import Budget

    fits = {False: 4, True: 8}   # the largest micro-batch that fits, eager / compiled
    built = []

    class FakeChild:
        def __init__(self, name, log, factory, recipe, overrides):
            self.compiled = "train.compile=true" in overrides
            assert ("train.compile=false" in overrides) != self.compiled
            built.append((name, self.compiled))

        def result(self, timeout=None):
            return None

        def call(self, method, *args, timeout=None):
            if method == "profile":
                return {"device": "cpu", "categories": {}, "step_ms": 1.0, "top": []}
            if method == "op_counts":
                return {"totals": {"ops": 1}}
            mb = args[0]
            if mb > fits[self.compiled]:
                return {"micro_batch": mb, "oom": True}
            return {"micro_batch": mb, "oom": False, "step_s": 1.0, "tokens_per_s": mb * 32.0,
                    "loss": 1.0, "finite": True, "flops_per_token": 1.0, "peak_mem_gib": 1.0}

        def close(self, timeout=None):
            return None

    monkeypatch.setattr(trainer_process, "Child", FakeChild)
    plan = {"sizes": ["tiny"], "encodings": ["tape"], "seq_len": 32, "compile": [False, True],
            "max_micro_batch": 64, "warmup": 0, "steps": 1, "profile_steps": 1,
            "op_counts": True, "overrides": []}
    rows = []
    end_to_end.end_to_end(REPO / "configs/train/demo.yaml", tmp_path, plan, None,
                          Budget(60.0, _time.monotonic() + 60.0), rows, lambda: None)
    assert built == [("tiny_tape", False), ("tiny_tape_compiled", True)]
    eager, compiled = rows
    assert [p["micro_batch"] for p in eager["probes"]] == [1, 2, 4, 8]
    assert [p["micro_batch"] for p in compiled["probes"]] == [4, 8, 16]
    assert (eager["compile"], eager["micro_batch"]) == (False, 4)
    assert (compiled["compile"], compiled["micro_batch"]) == (True, 8)
    # Operators counted once, in the eager row (a dispatch mode runs compiled blocks eagerly).
    assert eager["op_counts"] == {"totals": {"ops": 1}} and "op_counts" not in compiled
    # e2e.min_micro_batch: the eager search starts there (a short lease skips the small ones)
    built.clear()
    rows = []
    end_to_end.end_to_end(REPO / "configs/train/demo.yaml", tmp_path,
                          dict(plan, compile=[False], min_micro_batch=2), None,
                          Budget(60.0, _time.monotonic() + 60.0), rows, lambda: None)
    assert [p["micro_batch"] for p in rows[0]["probes"]] == [2, 4, 8]
    with pytest.raises(ValueError, match="e2e.min_micro_batch must be an integer >= 1, got 0"):
        end_to_end.end_to_end(REPO / "configs/train/demo.yaml", tmp_path,
                              dict(plan, min_micro_batch=0), None,
                              Budget(60.0, _time.monotonic() + 60.0), [], lambda: None)


def test_an_end_to_end_mfu_above_100_percent_is_never_a_result(monkeypatch, tmp_path):
    """The GPU report's MFU goes through the trainer's guard: above the device peak the peak
    (or the GPU's identification) is wrong, so the row gets no `mfu`, which the targets and
    the table then treat as not measured; a plausible one is kept (the control)."""
    import time as _time

    import trainer_process
    from gpu import end_to_end, render
    from gpu.common import Budget

    class FakeChild:
        def __init__(self, name, log, factory, recipe, overrides):
            self.tokens_per_s = {"rope": 1e12, "tape": 1e11}[name.split("_")[1]]

        def result(self, timeout=None):
            return None

        def call(self, method, *args, timeout=None):
            return {"micro_batch": args[0], "oom": args[0] > 1, "step_s": 1.0,
                    "tokens_per_s": self.tokens_per_s, "loss": 1.0, "finite": True,
                    "flops_per_token": 4.0, "peak_mem_gib": 1.0}

        def close(self, timeout=None):
            return None

    monkeypatch.setattr(trainer_process, "Child", FakeChild)
    plan = {"sizes": ["1b"], "encodings": ["rope", "tape"], "seq_len": 32,
            "max_micro_batch": 4, "warmup": 0, "steps": 1, "overrides": []}
    rows = []
    end_to_end.end_to_end(REPO / "configs/train/demo.yaml", tmp_path, plan, 1.0,
                          Budget(60.0, _time.monotonic() + 60.0), rows, lambda: None)
    rope, tape = rows
    assert "mfu" not in rope and "4.0 achieved vs 1.0 peak" in rope["mfu_above_peak"]
    assert tape["mfu"] == pytest.approx(0.4) and "mfu_above_peak" not in tape
    data = {"sections": {"end_to_end": {"status": "done", "results": rows}}}
    assert render.evaluate_targets(data)["rope_mfu"]["status"] == "not measured"


class _RetryingTrainer:
    """What ``TrainerProbe.measure`` uses of a trainer, on a faked CUDA rank whose allocator
    retries twice in every step."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from tape_train.train.cuda_allocator import choose_allocator_setting

        self.cfg = SimpleNamespace(model=SimpleNamespace(vocab_size=50),
                                   train=SimpleNamespace(seq_len=8, grad_accum_steps=1,
                                                         compile=False))
        self.dist = SimpleNamespace(cuda_allocator=choose_allocator_setting(True, {}))
        self.retries = 3  # before the probe: set-up's and an earlier micro-batch's

    def train_step(self):
        self.retries += 2
        return {"step_time_s": 0.5, "loss": 1.0}


def test_a_cuda_probe_records_the_allocators_retries_of_the_timed_steps(monkeypatch):
    import torch

    from gpu.end_to_end import TrainerProbe

    device = torch.device("cuda", 0)
    probe = TrainerProbe.__new__(TrainerProbe)  # its trainer faked, not built
    probe.trainer, probe.device, probe.flops_per_token = _RetryingTrainer(), device, 1.0
    segments = [{"device": 0, "is_expandable": True}, {"device": 1, "is_expandable": False}]
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 2**30)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(cuda, "memory_stats",
                        lambda device=None: {"num_alloc_retries": probe.trainer.retries})
    monkeypatch.setattr(cuda.memory, "_snapshot", lambda device=None: {"segments": segments})
    res = probe.measure(2, warmup=3, steps=4)
    assert res["alloc_retries"] == 8  # the 4 timed steps' retries, not the warm-up's
    assert res["reserved_gib"] == 3.0 and res["peak_mem_gib"] == 1.0
    assert res["expandable_segments"] is True
    assert res["allocator"].startswith("CUDA caching allocator: expandable_segments:True")
    segments[0]["is_expandable"] = False  # control: this device's segments are fixed-size
    assert probe.measure(2, warmup=1, steps=1)["expandable_segments"] is False
    segments.clear()
    assert probe.measure(2, warmup=1, steps=1)["expandable_segments"] is None


def test_the_end_to_end_table_shows_the_allocator():
    rows = [{"size": "350m", "pe": "rope", "status": "done", "micro_batch": 16,
             "tokens_per_s": 74000.0, "peak_mem_gib": 70.2, "reserved_gib": 77.51,
             "alloc_retries": 12, "expandable_segments": False,
             "allocator": "CUDA caching allocator: torch's defaults (off)"},
            {"size": "350m", "pe": "tape", "status": "done", "micro_batch": 16,
             "tokens_per_s": 70000.0, "peak_mem_gib": 71.0, "reserved_gib": 72.0,
             "alloc_retries": 0, "expandable_segments": True,
             "allocator": "CUDA caching allocator: expandable_segments:True (on)"},
            {"size": "1b", "pe": "rope", "status": "failed"}]
    data = _report([], rows)
    data["targets"] = evaluate_targets(data)
    md = markdown(data)
    assert ("| size | pe | micro-batch | tokens/s | MFU | peak mem (GiB) | peak reserved (GiB) "
            "| alloc retries | expandable segments | status |") in md
    assert "| 350m | rope | 16 | 74000 | – | 70.2 | 77.5 | 12 | off | done |" in md
    assert "| 350m | tape | 16 | 70000 | – | 71.0 | 72.0 | 0 | on | done |" in md
    assert "| 1b | rope | – | – | – | – | – | – | – | failed |" in md
    assert "- CUDA caching allocator: torch's defaults (off)\n" in md
    # A CPU run records no allocator: its cells are empty and no allocator line is written.
    cpu = markdown(_report([], [{"size": "tiny", "pe": "tape", "status": "done",
                                 "micro_batch": 2, "tokens_per_s": 10.0, "peak_mem_gib": 0.5}]))
    assert "| tiny | tape | 2 | 10 | – | 0.5 | – | – | – | done |" in cpu
    assert "CUDA caching allocator" not in cpu


def test_the_trainer_checks_compare_the_compiled_run_with_its_eager_one():
    """The ``train.compile`` run (ZeRO-3 fp32) is compared with the eager ZeRO-3 fp32 run at the
    fp32 tolerance, and counts towards a judged result only where it was started."""
    import time as _time

    from gpu import correctness
    from gpu.common import Budget

    base = [5.0, 4.9, 4.8]
    names = ["zero1_fp32", "zero1_bf16", "zero3_fp32", "zero3_bf16",
             *correctness.DETERMINISTIC_RUNS, correctness.OFFLOAD_RUN]

    def check(compiled_losses):
        runs = {name: _FakeTrainerRun(base) for name in names}
        if compiled_losses is not None:
            runs[correctness.COMPILE_RUN] = _FakeTrainerRun(compiled_losses)
        sink = []
        correctness.trainer_checks(runs, 3, Budget(60.0, _time.monotonic() + 60.0), sink,
                                   lambda: None)
        return next(r for r in sink if r["check"] == "trainer")

    good = check([5.0, 4.9, 4.8 * (1 + 1e-4)])
    assert good["ok"] is True
    assert good["comparisons"][correctness.COMPILE_KEY] == pytest.approx(1e-4)
    bad = check([5.0, 4.9, 4.8 * (1 + 1e-2)])               # beyond the fp32 tolerance
    assert bad["ok"] is False
    assert check(None)["ok"] is True                        # not started: not required


@pytest.mark.parametrize("argv, builds", [
    (["--cpu-smoke"], True),
    (["--cpu-smoke", "--sections", "kernel_speed", "end_to_end"], False),  # no trainer runs
    (["--cpu-smoke", "--plan", 'trainer.runs=["zero1_fp32"]'], False),  # no offloaded run
])
def test_the_smoke_builds_cpu_adam_before_its_clock(monkeypatch, argv, builds):
    """A fresh venv builds DeepSpeed's CPU Adam op for the offloaded trainer run (minutes on a
    busy machine): the smoke does it before its sections' time budget starts, and only when
    that run is planned."""
    import gpu_report

    import tape_train.train.optim as optim

    calls = []
    monkeypatch.setattr(optim, "cpu_adam_problem", lambda: calls.append(1) or time.sleep(0.3))
    took = gpu_report.build_cpu_adam_first(gpu_report.parse_args(argv))
    assert calls == ([1] if builds else [])
    assert (took >= 0.3) == builds
