"""Per-step host work of the trainer (docs/kernel.md, "Host overhead per step").

ZeRO-1/2 in bf16 run no per-gradient non-finite scan before the optimizer step
(``tape_train.train.engine.skip_bf16_overflow_scan``): the gradient norm DeepSpeed computes
next skips the same steps. That norm is one multi-tensor norm, not one per gradient
(``multi_tensor_grad_norm``), bit-identical to DeepSpeed's on CPU. Counted with
``benchmarks/step_ops.py``'s dispatch counter on the real trainer (negative control: the
counter sees the scan and the per-gradient norms once they are restored), and a NaN in one
gradient under a finite loss still leaves the fp32 weights and Adam moments untouched.

``Trainer.train()`` reads the gradient norm back (a host sync on a GPU, after the optimizer
step) only on the steps whose metrics it writes or prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WORKER = """
import json, sys
import torch
from deepspeed.utils import safe_get_full_fp32_param
from step_ops import StepOpCounter, count_step, restore_before
from tape_train.config import load_run_config
from tape_train.train.loop import Trainer

def scans(trainer):
    counter = count_step(trainer, warmup=0)
    return (sum(n for op, n in counter.by_op["optimizer_step/overflow scan"].items()
                if op in ("aten.amax.default", "aten.amin.default")),
            counter.counts[("optimizer_step/grad norm", "ops")])

def state(trainer):
    out = {}
    for name, p in trainer.engine.module.named_parameters():
        out[name] = safe_get_full_fp32_param(p).clone()
    for i, moments in enumerate(trainer.optimizer.state.values()):  # on the flat partitions
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{i}/{key}"] = moments[key].clone()
    return out

out = {}
trainer = Trainer(load_run_config(None, json.loads(sys.argv[1])))
try:
    trainer.setup()
    trainer.train_step()
    out["gradients"] = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    out["scan_after"], out["norm_ops_after"] = scans(trainer)
    zero = trainer.engine.optimizer
    ours, norms = zero.get_grad_norm_direct, []
    def both(gradients, params, norm_type=2):
        mine = ours(gradients, params, norm_type)
        norms.append([float(mine), float(type(zero).get_grad_norm_direct(zero, gradients, params,
                                                                          norm_type))])
        return mine
    zero.get_grad_norm_direct = both
    trainer.train_step()
    zero.get_grad_norm_direct = ours
    out["norms"] = norms
    poison = {"on": False}
    weight = trainer.model.layers[0].mlp.down_proj.weight
    weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    before = state(trainer)
    poison["on"] = True
    metrics = trainer.train_step()
    poison["on"] = False
    skipped = state(trainer)
    out["loss_finite"] = bool(torch.isfinite(torch.tensor(metrics["loss"])))
    out["grad_norm"] = str(metrics["grad_norm"])
    out["changed_by_skip"] = [k for k in before if not torch.equal(before[k], skipped[k])]
    trainer.train_step()
    out["moments"] = sum(k.endswith("exp_avg") for k in before)
    out["changed_after"] = sum(not torch.equal(skipped[k], v) for k, v in state(trainer).items())
    out["restored"] = restore_before(trainer)
    out["scan_before"], out["norm_ops_before"] = scans(trainer)
finally:
    trainer.close()
print(json.dumps(out))
"""


def _run(worker: str, tmp_path: Path, *overrides: str) -> dict:
    """``worker`` on the TINY trainer with ``overrides``, in a process of its own: a trainer
    sets up logging, a process group and signal handlers for its whole process."""
    overrides = [*TINY, f"train.run_dir={tmp_path}", *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", worker, json.dumps(overrides)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


TINY = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
        "model.intermediate_size=128", "model.vocab_size=256", "model.max_seq_len=64",
        "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
        "train.device=cpu", "train.synthetic_data=true", "logging.peak_tflops=1.0",
        "logging.tensorboard=false", "logging.progress_bar=false"]


def test_bf16_zero1_step_runs_no_per_gradient_scan_and_still_skips_nan_gradients(tmp_path):
    out = _run(_WORKER, tmp_path, "train.grad_accum_steps=2", "train.dtype=bf16",
               "parallel.zero_stage=1", "train.max_steps=10", "train.lr=1e-3",
               "train.warmup_steps=0")
    assert out["scan_after"] == 0
    # Negative control: DeepSpeed's scan restored, the counter sees it on every gradient.
    assert "DeepSpeed's per-gradient bf16 overflow scan" in out["restored"]
    assert out["scan_before"] == 2 * out["gradients"] > 0
    # The gradient norm: one multi-tensor norm per parameter group (2 groups) where DeepSpeed's
    # loop casts and norms each gradient (2 operators), the rest alike; bit-identical.
    assert out["norm_ops_before"] - out["norm_ops_after"] == 2 * out["gradients"] - 2
    assert len(out["norms"]) == 2 and all(a == b > 0 for a, b in out["norms"]), out["norms"]
    # A NaN gradient under a finite loss: the step is skipped, weights and moments untouched.
    assert out["loss_finite"] and out["grad_norm"] == "inf"
    assert out["changed_by_skip"] == [] and out["moments"] > 0
    assert out["changed_after"] > 0  # the next, clean step updates (the check can fail)


_LOOP_WORKER = """
import json, sys
from tape_train.config import load_run_config
from tape_train.train.loop import Trainer
from tape_train.train.metrics import read_metrics

trainer = Trainer(load_run_config(None, json.loads(sys.argv[1])))
reads = []
try:
    trainer.setup()
    norm = trainer.engine.get_global_grad_norm
    trainer.engine.get_global_grad_norm = lambda: reads.append(trainer.state.step) or norm()
    direct = trainer.train_step()["grad_norm"]
    code = trainer.train()
finally:
    trainer.close()
print(json.dumps({"reads": reads, "direct": direct, "code": code, "logged": {
    r["step"]: r.get("grad_norm") for r in read_metrics(trainer.run_dir, "train")}}))
"""


def test_the_loop_reads_the_grad_norm_on_logged_steps_only(tmp_path):
    out = _run(_LOOP_WORKER, tmp_path, "train.dtype=fp32", "parallel.zero_stage=1",
               "train.max_steps=7", "logging.interval=3", "logging.console_interval=6",
               "eval.interval=0")
    assert out["code"] == 0
    # Negative control: a direct train_step() reads it (step 1); train() at steps 3 and 6
    # (logging.interval; 6 is console_interval's too) and 7 (the last), not at 2, 4, 5.
    assert out["reads"] == [1, 3, 6, 7]
    assert set(map(int, out["logged"])) == {3, 6, 7}
    assert all(isinstance(v, float) and v > 0 for v in out["logged"].values()), out
    assert isinstance(out["direct"], float)


def test_step_ops_benchmark_counts_before_and_after_in_one_run(tmp_path):
    out = tmp_path / "ops.json"
    shrink = [a for o in TINY[1:8] for a in ("--override", o)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_ops.py"), "--model", "tiny",
         "--pe", "rope", "--seq-len", "32", "--warmup", "1", *shrink, "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    runs = json.loads(out.read_text())["runs"]
    before, after = runs["rope/before"], runs["rope/after"]
    assert before["phases"]["optimizer_step/overflow scan"]["ops"] > 0
    assert "optimizer_step/overflow scan" not in after["phases"]
    assert before["totals"]["reads"] - after["totals"]["reads"] == 2  # the scan, the norm
    assert before["phases"]["forward"] == after["phases"]["forward"]
    assert "after/before ops" in proc.stdout
