"""The dry run's memory estimate against the measured peak of a real training run (CPU, gloo).

The trainer runs a few steps in a fresh process; its peak resident growth since torch,
DeepSpeed and the process group were up (``VmHWM`` reset through ``/proc/self/clear_refs``) is
compared with ``estimate_memory`` without its runtime baseline, within ±25 %. The case with
activation checkpointing was not used to fit the estimate's measured constants. Negative
control: the estimate for four times the micro-batch is outside the tolerance of the same
measurement, so the comparison can tell configurations apart. The full table (tiny and 125m,
ZeRO-0/1/3, TP 2, SP 2) is benchmarks/memory_estimate.py's, in docs/training.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from distributed import run_distributed_test
from memory_utils import measure_rank
from tape_train.config import load_run_config
from tape_train.train.memory import CPU_RUNTIME_BYTES, estimate_memory, trace_activations

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.25


def _bench():
    spec = importlib.util.spec_from_file_location("memory_estimate",
                                                  ROOT / "benchmarks" / "memory_estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _estimate(overrides: list[str], world: int = 1) -> int:
    return estimate_memory(load_run_config(None, overrides), world).total_bytes - CPU_RUNTIME_BYTES


@pytest.mark.slow
def test_estimate_matches_measured_peak_with_activation_checkpointing(tmp_path):
    bench = _bench()
    world, case = bench.CASES["tiny-z3-ac"]
    overrides = [*bench.COMMON, *case]
    (measured,) = run_distributed_test(measure_rank, world_size=world,
                                       args=(overrides, 2, str(tmp_path)), timeout=600)
    growth = measured["growth"]
    estimate = _estimate(overrides, world)
    assert abs(estimate / growth - 1) <= TOLERANCE, (estimate, growth)
    bigger = _estimate([*overrides, "train.micro_batch_size=32"], world)
    assert abs(bigger / growth - 1) > TOLERANCE, (bigger, growth)


def test_traced_activations_scale_and_checkpointing_saves():
    """The meta-device trace: about linear in the micro-batch, checkpointing keeps less, tp splits
    the attention and MLP part only, and TAPE carries positional state where RoPE has none."""
    import torch

    cfg = load_run_config(None, ["model.base=tiny"]).model
    one = trace_activations(cfg, 1, 128, torch.float32)
    two = trace_activations(cfg, 2, 128, torch.float32)
    four = trace_activations(cfg, 4, 128, torch.float32)
    # Linear in the micro-batch plus a constant: the loss head's fp32 ∂W (V × C) and a few
    # (1, ...) tensors shared by the batch.
    per_sequence = two.saved - one.saved
    assert four.saved - two.saved == 2 * per_sequence
    head_dw = cfg.vocab_size * cfg.hidden_size * 4
    assert head_dw <= one.saved - per_sequence < 0.5 * one.saved
    assert one.layer_inputs + one.largest_layer + one.outside_layers < one.saved
    split = trace_activations(cfg, 1, 128, torch.float32, tp=2)
    assert one.saved / 2 < split.saved < one.saved
    assert one.positional > 0
    rope = load_run_config(None, ["model.base=tiny", "model.pe=rope"]).model
    assert trace_activations(rope, 1, 128, torch.float32).positional == 0


def test_zero3_model_states_agree_with_deepspeeds_estimator():
    """Anchor: DeepSpeed's own ZeRO-3 estimate (no offload: 18·Ψ/D + 4·largest layer, bf16)
    and ours (16·Ψ/D + gathered layers, see tape_train.train.memory) agree within 15 % for
    125m on 8 GPUs, where the per-parameter terms dominate."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    from tape_train.train.memory import model_state_bytes, parameter_split

    cfg = load_run_config(None, ["model.base=125m", "train.dtype=bf16", "parallel.zero_stage=3"])
    counts = parameter_split(cfg.model, 1, cfg.parallel.zero3_param_persistence_threshold)
    ours = sum(model_state_bytes(counts["local"], 3, True, 8).values()) + 2 * (
        2 * counts["largest_layer"] + counts["persistent"])
    _, theirs, _ = estimate_zero3_model_states_mem_needs(
        counts["local"], counts["largest_layer"], num_gpus_per_node=8, num_nodes=1,
        cpu_offload=False, cpu_offload_params=False)
    assert abs(ours / theirs - 1) < 0.15, (ours, theirs)


def test_offloaded_states_leave_the_device_for_the_host():
    from tape_train.train.memory import parameter_split

    base = ["model=tiny", "train.dtype=bf16", "parallel.zero_stage=3"]
    plain = estimate_memory(load_run_config(None, base), 4, device_type="cuda")
    off = estimate_memory(load_run_config(None, base + ["parallel.offload_optimizer=cpu",
                                                        "parallel.offload_params=cpu"]),
                          4, device_type="cuda")
    n = parameter_split(load_run_config(None, base).model, 1, 100_000)["local"]
    assert off.host_bytes == n * (4 + 8 + 4 + 2) // 4  # master, m+v, fp32 grads, bf16 weights
    assert plain.total_bytes - off.total_bytes == n * (4 + 8 + 2) // 4
    assert plain.host_bytes == 0 and "host memory per rank (offloaded)" in "\n".join(off.lines())
    cpu = estimate_memory(load_run_config(None, base + ["parallel.offload_optimizer=cpu"]), 4)
    assert cpu.host_bytes == 0 and "fp32 gradient partition (offloaded)" in cpu.parts


@pytest.mark.parametrize("world, per_node", [(1, 1), (4, 4), (16, 8)])
def test_the_dry_runs_host_memory_per_node_counts_the_ranks_on_one_node(world, per_node):
    # --gpus-per-node 8 without --nodes plans one rank: it said "8 rank(s) per node hold ...".
    from tape_train.train.preflight import run_preflight

    cfg = load_run_config(None, ["model=tiny", "train.dtype=bf16", "train.synthetic_data=true",
                                 "parallel.offload_optimizer=cpu"])
    report = run_preflight(cfg, world_size=world, gpus_per_node=8, check_data=False,
                           check_eval=False, check_resume=False)
    [line] = [line for line in report.lines if "per node hold" in line]
    host = estimate_memory(cfg, world, device_type="cuda").host_bytes
    assert line.startswith(f"host memory: {per_node} rank(s) per node hold "
                           f"~{host * per_node / 2**30:.2f} GiB"), line


def test_a_model_far_too_large_is_refused_before_it_is_built_and_traced(monkeypatch):
    """model.num_layers=100000 (a typo for 100, say) had the preflight build and trace the
    model on the meta device for most of an hour before it said "does not fit". The weights,
    gradients and AdamW states, counted without a model, already do not fit: refused at once.
    That count is a lower bound of the traced estimate (checked on a few layouts)."""
    from tape_train.train import memory
    from tape_train.train.memory import model_state_floor
    from tape_train.train.preflight import run_preflight

    for overrides, world in [([], 1), (["parallel.zero_stage=3"], 4), (["parallel.tp=2"], 2),
                             (["train.dtype=bf16", "parallel.sp=2"], 4)]:
        cfg = load_run_config(None, ["model=tiny", *overrides])
        assert model_state_floor(cfg, world) <= estimate_memory(cfg, world).total_bytes

    def plan(layers: int) -> list[str]:
        cfg = load_run_config(None, ["model=tiny", "train.device=cpu", "train.dtype=fp32",
                                     "train.synthetic_data=true", f"model.num_layers={layers}"])
        return run_preflight(cfg, world_size=1, check_data=False, check_eval=False,
                             check_resume=False, device_memory_gb=16).problems

    def memory_problems(layers: int) -> list[str]:
        return [p for p in plan(layers) if p.startswith("memory:")]  # the disk has its own

    traced = []
    monkeypatch.setattr(memory, "trace_activations",
                        lambda *a, **k: traced.append(a) or pytest.fail("model traced"))
    [problem] = memory_problems(100_000)
    assert problem.startswith("memory: 1 rank(s) on this node need more than ") and \
        "of 14.90 GiB (--device-memory-gb) for the weights, gradients and AdamW states " \
        "alone: does not fit" in problem, problem
    monkeypatch.undo()
    assert memory_problems(2) == []  # control: a model that fits is traced as before


_EVAL_FORWARD = """
import sys, torch
sys.path.insert(0, {tests!r})
from memory_utils import high_water_bytes, rss_bytes
from tape_train.config import load_run_config
from tape_train.model import TransformerLM
cfg = load_run_config(None, ["model.base=tiny"]).model
torch.manual_seed(0)
model = TransformerLM(cfg).eval()
ids = torch.randint(0, cfg.vocab_size, ({batch}, {length}))
with torch.no_grad():
    model(ids[:1, :64], labels=ids[:1, :64])  # thread pools and kernels up: not the batch's
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = rss_bytes()
    model(ids, labels=ids)
    print(high_water_bytes() - base)
"""


def test_the_evaluation_forward_estimate_against_a_measured_forward():
    """``eval_forward_bytes`` against the resident peak of the real no-grad forward with labels
    (the evaluation's call), TAPE, ``tiny``, fp32, 4 windows of 1024 tokens, in a fresh
    process (one thread: the measurement does not depend on the load). Negative control:
    the estimate for a quarter of the batch is outside the tolerance."""
    import subprocess
    import sys

    import torch

    from tape_train.train.memory import eval_forward_bytes

    batch, length = 4, 1024
    code = _EVAL_FORWARD.format(tests=str(ROOT / "tests"), batch=batch, length=length)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    measured = int(out.stdout.split()[-1])
    cfg = load_run_config(None, ["model.base=tiny"]).model
    estimate = eval_forward_bytes(cfg, batch, length, torch.float32)
    assert 0.9 <= estimate / measured <= 1.5, (estimate, measured)
    quarter = eval_forward_bytes(cfg, batch // 4, length, torch.float32)
    assert not 0.9 <= quarter / measured <= 1.5, (quarter, measured)


def _eval_plan(overrides: list[str], gb: float):
    from tape_train.train.preflight import run_preflight

    cfg = load_run_config(None, ["model=tiny", "train.device=cpu", "train.dtype=fp32",
                                 "train.synthetic_data=true", "train.seq_len=256",
                                 "train.micro_batch_size=2", *overrides])
    return run_preflight(cfg, world_size=1, check_data=False, check_eval=False,
                         check_resume=False, device_memory_gb=gb)


def test_a_scheduled_evaluation_that_does_not_fit_is_refused_at_start_up():
    """The steps fit and the evaluation (8 windows of 8 x 256 tokens by default) does not: the
    run would have ended at its first evaluation, eval.interval steps in. Controls: no
    scheduled evaluation, or a smaller eval.batch_size, and the same memory is no problem."""
    cfg = load_run_config(None, ["model=tiny", "train.dtype=fp32", "train.seq_len=256",
                                 "train.micro_batch_size=2", "eval.interval=100",
                                 "eval.batch_size=8"])
    est = estimate_memory(cfg, 1)
    assert est.evaluation.length == 2048 and est.evaluation.batch == 8
    assert est.evaluation.total_bytes > est.total_bytes
    between = (est.total_bytes + est.evaluation.total_bytes) / 2 / 1e9
    refused = _eval_plan(["eval.interval=100", "eval.batch_size=8"], between)
    [problem] = [p for p in refused.problems if "memory" in p]
    assert problem.startswith("memory for the scheduled evaluation (eval.batch_size=8 windows "
                              "of 2048 tokens, the longest of eval.lengths): 1 rank(s) on "
                              "this node need ~"), problem
    assert problem.endswith("does not fit; lower eval.batch_size or the longest of "
                            "eval.lengths"), problem
    assert not [p for p in _eval_plan(["eval.interval=0"], between).problems if "memory" in p]
    small = _eval_plan(["eval.interval=100", "eval.batch_size=1"], between)
    assert not [p for p in small.problems if "memory" in p]
    assert any(line.startswith("memory for the scheduled evaluation (eval.batch_size=1 ")
               for line in small.lines)


def test_an_out_of_memory_in_an_evaluation_names_eval_batch_size(caplog):
    import logging
    from types import SimpleNamespace

    import torch

    from tape_train.train.loop import Trainer

    def said(phase: str) -> str:
        fake = SimpleNamespace(
            watchdog=SimpleNamespace(phase=(phase, 0.0)),
            dist=SimpleNamespace(device=torch.device("cpu")),
            profiler=SimpleNamespace(after_out_of_memory=lambda step, where: None),
            state=SimpleNamespace(step=7),
            cfg=SimpleNamespace(eval=SimpleNamespace(batch_size=6),
                                profile=SimpleNamespace(enabled=False, memory_snapshot=False)))
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="tape_train"):
            Trainer._out_of_memory(fake)
        return caplog.records[-1].getMessage()

    line = said("the evaluation at step 7")
    assert "in the evaluation at step 7; an evaluation forward holds eval.batch_size=6 " \
           "windows of the longest of eval.lengths: lower eval.batch_size" in line, line
    assert "eval.batch_size" not in said("step 8")  # control: a training step's


def _floor_plan(overrides: list[str], **kwargs):
    from tape_train.train.preflight import run_preflight

    cfg = load_run_config(None, ["model=tiny", "train.device=cpu", "train.dtype=fp32",
                                 "train.synthetic_data=true", "train.seq_len=256", *overrides])
    kwargs = {"device_memory_gb": 16, **kwargs}
    return run_preflight(cfg, world_size=1, check_data=False, check_eval=False,
                         check_resume=False, **kwargs)


@pytest.mark.parametrize("key, value", [
    ("train.micro_batch_size", 10**6), ("train.micro_batch_size", 10**9),
    ("train.micro_batch_size", 10**18), ("train.micro_batch_size", 10**20),
    ("eval.batch_size", 10**6), ("eval.batch_size", 10**20)])
def test_a_micro_batch_far_too_large_is_refused_before_anything_is_traced(monkeypatch, key,
                                                                          value):
    """train.micro_batch_size=1000000 took the dry run 67 s (the trace looped over the loss's
    token chunks), 1e9 hours, 1e18 ended in torch's integer overflow. The floor (model states
    and the layer inputs one micro-batch keeps; one hidden state of the evaluation batch),
    counted in Python ints from the config, already does not fit: refused at once, naming the
    key and its value. Also with the device's memory unknown (CUDA planned without a GPU)."""
    import time

    from tape_train.train import memory

    monkeypatch.setattr(memory, "trace_activations",
                        lambda *a, **k: pytest.fail("model traced"))
    evaluation = ["eval.interval=100"] if key.startswith("eval.") else []
    start = time.perf_counter()
    report = _floor_plan([*evaluation, f"{key}={value}"])
    [problem] = [p for p in report.problems if p.startswith("memory")]
    assert f"{key}={value} " in problem and "does not fit" in problem, problem
    assert "of 14.90 GiB (--device-memory-gb)" in problem, problem
    assert time.perf_counter() - start < 10
    if value >= 10**18:  # beyond any device: refused without a trace where memory is unknown
        unknown = _floor_plan([*evaluation, f"{key}={value}"], device_memory_gb=None,
                              gpus_per_node=8)
        [problem] = [p for p in unknown.problems if p.startswith("memory")]
        assert f"{key}={value} " in problem and "1 PiB, more than any device has" in problem


def test_the_memory_floor_is_below_the_traced_estimate_and_a_normal_size_still_plans():
    """The floor is a lower bound of the estimate (a few layouts, encodings, checkpointing, an
    evaluation), and a normal micro-batch is traced and planned as before (control)."""
    from tape_train.train.memory import memory_floor

    for overrides, world in [([], 1), (["train.activation_checkpointing=true"], 1),
                             (["model.pe=rope", "train.dtype=bf16"], 1),
                             (["parallel.zero_stage=3", "parallel.sp=2"], 4),
                             (["parallel.tp=2", "model.pe=alibi"], 2)]:
        cfg = load_run_config(None, ["model=tiny", "train.dtype=fp32", "eval.interval=10",
                                     *overrides])
        floor, est = memory_floor(cfg, world), estimate_memory(cfg, world)
        assert 0 < floor.step <= est.total_bytes, (overrides, floor, est.total_bytes)
        assert 0 < floor.evaluation <= est.evaluation.total_bytes, overrides
    report = _floor_plan(["train.micro_batch_size=2", "eval.interval=100"])
    assert not [p for p in report.problems if p.startswith("memory")], report.problems
    assert any(line.startswith("memory: 1 rank(s) on this node need ~") for line in report.lines)


def test_a_cpu_runs_start_checks_the_floor_against_ram_in_either_precision(monkeypatch):
    """A real run (no plan) checks the same floor against the available RAM before the process
    group and the loader (which packed a micro-batch of 1e20 rows for ever, deaf to SIGTERM).
    With train.dtype=auto it is refused only when neither bf16 nor fp32 fits."""
    from tape_train.train import memory
    from tape_train.train.loop import Trainer
    from tape_train.train.preflight import PreflightError, run_preflight

    def start(overrides: list[str]) -> list[str]:
        cfg = load_run_config(None, ["model=tiny", "train.device=cpu",
                                     "train.synthetic_data=true", *overrides])
        return run_preflight(cfg, world_size=1, check_data=False, check_eval=False,
                             check_resume=False, plan=False, check_memory_floor=True).problems

    huge = f"train.micro_batch_size={10**20}"
    [problem] = start([huge])
    assert f"train.micro_batch_size={10**20} " in problem and "available RAM" in problem
    assert start(["train.micro_batch_size=2"]) == []  # control
    # RAM between the bf16 and the fp32 floor: auto fits (bf16), fp32 alone does not.
    sizes = ["train.micro_batch_size=64", "train.seq_len=256"]
    floors = {d: memory.memory_floor(load_run_config(None, ["model=tiny", *sizes,
                                                            f"train.dtype={d}"]), 1).step
              for d in ("bf16", "fp32")}
    assert floors["bf16"] < floors["fp32"]
    monkeypatch.setattr(memory, "device_memory",
                        lambda *a: ((floors["bf16"] + floors["fp32"]) // 2, "test RAM"))
    assert start([*sizes, "train.dtype=auto"]) == []
    assert len(start([*sizes, "train.dtype=fp32"])) == 1
    # The trainer asks for it, before any process group.
    monkeypatch.setattr(memory, "device_memory", lambda *a: (2**30, "test RAM"))
    cfg = load_run_config(None, ["model=tiny", "train.device=cpu", "train.synthetic_data=true",
                                 huge])
    with pytest.raises(PreflightError, match=f"train.micro_batch_size={10**20} "):
        Trainer(cfg, loader_factory=lambda *a: None, eval_documents=lambda: [])._preflight()


def test_a_cuda_runs_start_checks_the_floor_against_the_gpus_memory(monkeypatch):
    """On CUDA the run's start checks the floor per rank against the GPU's memory (read from
    its properties), not the host's RAM: a micro-batch of 1e20 is refused before the process
    group, and one that fits passes (control). The GPU is stood in for by device_memory."""
    from tape_train.train import memory
    from tape_train.train.preflight import run_preflight

    asked = []

    def gpu_memory(device_type, *rest):
        asked.append(device_type)
        return 80 * 10**9, "Test GPU, total memory"

    monkeypatch.setattr(memory, "device_memory", gpu_memory)

    def start(overrides: list[str]) -> list[str]:
        cfg = load_run_config(None, ["model=tiny", "train.device=cuda",
                                     "train.synthetic_data=true", *overrides])
        report = run_preflight(cfg, world_size=8, ranks_per_node=8, check_data=False,
                               check_eval=False, check_resume=False, plan=False,
                               check_memory_floor=True)
        return [p for p in report.problems if p.startswith("memory")]

    [problem] = start([f"train.micro_batch_size={10**20}"])
    assert "one rank needs" in problem and "Test GPU, total memory" in problem, problem
    assert f"train.micro_batch_size={10**20} " in problem
    assert set(asked) == {"cuda"}
    # 8 ranks of a node share its RAM on CPU, not one GPU: a floor a GPU holds passes.
    fits = (80 * 10**9) // 2 // (memory.memory_floor(load_run_config(
        None, ["model=tiny", "train.dtype=fp32", "train.micro_batch_size=1"]), 8).step)
    assert fits > 8
    assert start([f"train.micro_batch_size={fits}", "train.dtype=fp32"]) == []


def test_the_trace_runs_the_loss_as_one_chunk_with_the_same_bytes(monkeypatch):
    """The meta-device trace runs the chunked loss as one chunk: what it saves (∂h, ∂W) is the
    same as over many chunks, and its time no longer grows with the batch (one chunk's pass,
    where 1e6 sequences made thousands)."""
    import torch

    from tape_train.model import lm_head

    calls = []
    plain = lm_head._chunk_loss
    monkeypatch.setattr(lm_head, "_chunk_loss", lambda *a: calls.append(1) or plain(*a))
    monkeypatch.setattr(lm_head, "LOGITS_CHUNK_ELEMENTS", 1 << 16)  # 8 tokens per chunk
    cfg = load_run_config(None, ["model.base=tiny"]).model
    one = trace_activations(cfg, 2, 64, torch.float32)
    assert len(calls) == 1
    chunked = trace_activations(cfg, 2, 64, torch.float32, chunked_loss=True)
    assert len(calls) == 1 + 2 * 64 // lm_head.chunk_tokens(cfg.vocab_size) > 2
    assert one == chunked
