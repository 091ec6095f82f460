"""The CUDA-only code paths, checked on a CPU-only machine.

- Device mistakes made visible: the model (every encoding, every backend that runs off CUDA,
  training and evaluation mode, KV-cache generation) and the trainer's micro-batch loop run
  with parameters and inputs on the ``meta`` device, where a tensor created on the CPU by
  accident meets a meta tensor and raises as it would meet a CUDA tensor, and where reading a
  value back to the host (``.cpu()``, ``.item()``) raises as it would drain a GPU's queue.
- Host syncs counted: one real trainer step of 3 micro-batches reads values back once per
  step, never once per micro-batch (``benchmarks/gpu/common.count_host_syncs``, which the GPU
  report runs on CUDA with torch's sync debug mode).
- The selection logic fed CUDA facts by monkeypatching ``torch.cuda``: device index from
  LOCAL_RANK, NCCL vs gloo, attention backend, peak FLOP/s by GPU name, DeepSpeed's GPU config,
  the RNG state of a rank's own GPU.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from model_utils import small_config
from tape_train.model import TransformerLM
from tape_train.model.pe import ENCODINGS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

META = torch.device("meta")
OFF_CUDA_BACKENDS = ("eager", "sdpa", "blocked", "auto")


def _meta_model(pe: str, backend: str, dtype=torch.float32) -> TransformerLM:
    return TransformerLM(small_config(pe, attn_backend=backend)).to(device=META, dtype=dtype)


def _cases():
    for pe, spec in ENCODINGS.items():
        for backend in OFF_CUDA_BACKENDS:
            if backend == "blocked" and spec.dense_bias:
                continue  # refused with a message (test_model_backends)
            yield pe, backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pe,backend", list(_cases()))
def test_model_creates_nothing_off_its_device(pe, backend, dtype):
    model = _meta_model(pe, backend, dtype)
    ids = torch.zeros(2, 16, dtype=torch.long, device=META)
    model.train()  # RandPE and TAPE's train_offset draw positions here
    out = model(ids, labels=ids, return_logits=True)
    out.loss_sum.backward()
    assert out.loss_sum.device == META and out.logits.shape == (2, 16, 97)
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters()
               if p.requires_grad)
    model.eval()
    assert model(ids, labels=ids, return_logits=True).logits.device == META
    assert model(ids, labels=ids).loss_sum.device == META


@pytest.mark.parametrize("pe", list(ENCODINGS))
def test_kv_cache_generation_creates_nothing_off_its_device(pe):
    model = _meta_model(pe, "auto").eval()
    ids = torch.zeros(2, 5, dtype=torch.long, device=META)
    # Greedy without eos: sampling's multinomial and the eos stop read values (data-dependent)
    out = model.generate(ids, 3)
    assert out.shape == (2, 8) and out.device == META


def test_meta_catches_a_tensor_made_on_the_cpu(monkeypatch):
    # Negative control: positions made without device= (the mistake this file looks for).
    from tape_train.model.pe.base import PositionalEncoding

    monkeypatch.setattr(PositionalEncoding, "layer0_positions",
                        lambda self, batch, length, offset, device:
                        torch.arange(offset, offset + length)[None])
    model = _meta_model("rope", "sdpa")
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(torch.zeros(1, 8, dtype=torch.long, device=META))


class _MetaEngine:
    """What ``forward_backward`` uses of a DeepSpeed engine, around a model on ``meta``."""

    device = META

    def __init__(self, model) -> None:
        self.model, self.steps, self.inputs = model, 0, []

    def __call__(self, input_ids, labels=None, **kwargs):
        self.inputs.append((input_ids, labels, kwargs.get("positions")))
        return self.model(input_ids, labels=labels, **kwargs)

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        self.steps += 1


@pytest.mark.parametrize("sp", [1, 2])
def test_micro_batch_loop_keeps_the_loss_on_the_device(sp):
    """The per-micro-batch ``loss_sum.cpu()`` was a host sync per micro-batch (and a meta
    tensor cannot be copied out): the sum now stays on ``engine.device`` until the step."""
    from tape_train.parallel import RankGrid
    from tape_train.train.engine import forward_backward

    engine = _MetaEngine(_meta_model("tape", "auto").train())
    grid = RankGrid.from_sizes(sp, sp=sp, rank=0)
    batches = [{"input_ids": torch.zeros(2, 16, dtype=torch.long),
                "labels": torch.ones(2, 16, dtype=torch.long)} for _ in range(3)]
    seen = []
    total = forward_backward(engine, batches, grid=grid, global_tokens=96,
                             before_last_step=seen.append)
    assert engine.steps == 3 and len(seen) == 1 and seen[0] is total
    assert total.device == META and total.dtype == torch.float64
    for input_ids, labels, positions in engine.inputs:
        assert input_ids.device == labels.device == META and input_ids.shape == (2, 16 // sp)
        assert (positions is None) == (sp == 1) and (positions is None or positions.device == META)


_SYNC_WORKER = """
import json, sys
from gpu.common import count_host_syncs
from tape_train.config import load_run_config
from tape_train.train.loop import Trainer

trainer = Trainer(load_run_config(None, json.loads(sys.argv[1])))
try:
    trainer.setup()
    trainer.train_step()  # the first step: DeepSpeed's one-off set-up work
    with count_host_syncs(trainer.dist.device) as syncs:
        for _ in range(int(sys.argv[2])):
            trainer.train_step()
finally:
    trainer.close()
print(json.dumps({"total": sum(syncs.sites.values()), "sites": {str(k): v for k, v in
                  syncs.sites.items()}, "mid_step": {str(k): v for k, v in
                  syncs.mid_step.items()}}))
"""


def test_a_training_step_reads_values_back_once_per_step_not_per_micro_batch(tmp_path):
    # In a process of its own: a trainer sets up logging, a process group and signal handlers
    # for its whole process, which later tests in this one must not inherit.
    import json
    import os
    import subprocess

    micro, steps = 3, 2
    overrides = [
        "model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
        "model.intermediate_size=128", "model.vocab_size=256", "model.max_seq_len=64",
        f"train.run_dir={tmp_path}", "train.seq_len=32", "train.micro_batch_size=2",
        f"train.grad_accum_steps={micro}", "train.dtype=fp32", "train.device=cpu",
        "train.synthetic_data=true", "train.max_steps=10", "logging.peak_tflops=1.0",
        "logging.tensorboard=false", "logging.progress_bar=false"]
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(repo), str(repo / "benchmarks"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _SYNC_WORKER, json.dumps(overrides),
                           str(steps)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    syncs = json.loads(proc.stdout.strip().splitlines()[-1])
    # Once per step: G, the loss all-reduce, the grad norm, the stop agreement (and more).
    assert syncs["total"] >= 4 * steps, "the counter missed reads: it would pass"
    assert syncs["mid_step"] == {}, syncs["sites"]


def test_the_sync_counter_sees_a_read_per_micro_batch():
    # Negative control of the counter: the old accumulation (a copy to the host per
    # micro-batch) in a function it takes for the trainer's micro-batch loop.
    from gpu.common import count_host_syncs

    code = compile("def forward_backward(micro_batches):\n"
                   "    total = torch.zeros((), dtype=torch.float64)\n"
                   "    for i, loss in enumerate(micro_batches):\n"
                   "        total += loss.double().cpu()\n", "/x/tape_train/train/engine.py", "exec")
    scope = {"torch": torch}
    exec(code, scope)
    with count_host_syncs(torch.device("cpu")) as syncs:
        scope["forward_backward"]([torch.ones(())] * 3)
    assert syncs.sites == {"tape_train/train/engine.py:4": 3}
    assert syncs.mid_step == {"tape_train/train/engine.py:4": 2}  # not the step's last one


def test_evaluation_keeps_its_sums_on_the_device():
    """Evaluation read each batch's NLL and token count back (two host syncs per batch); the
    sums now stay on the model's device until the end of the ``evaluate_perplexity`` call."""
    from gpu.common import count_host_syncs
    from tape_train.eval.perplexity import _evaluate_length, evaluate_perplexity, \
        materialize_documents

    docs = materialize_documents([(list(range(1, n + 1)), n) for n in (9, 17, 30, 5)])
    model = _meta_model("tape", "auto").eval()
    with count_host_syncs(META) as syncs, torch.no_grad():
        sums, info = _evaluate_length(model, docs, 8, "sliding", None, None, 2, META, False, 0,
                                      1)
    assert syncs.sites == {} and sums.device == META and sums.dtype == torch.float64
    assert info["windows"] > 4                      # several batches ran

    def reads(batch_size):
        cpu_model = TransformerLM(small_config("tape")).eval()
        with count_host_syncs(torch.device("cpu")) as syncs:
            evaluate_perplexity(cpu_model, docs, lengths=[4, 8], protocol="sliding",
                                batch_size=batch_size)
        return sum(n for site, n in syncs.sites.items() if "eval/perplexity" in site)
    # 1 window per batch vs. all of a length's in one: the reads do not follow the batches
    # (each call also validates its documents on the host, one read per document).
    assert reads(1) == reads(64) > 0


# ------------------------------------------------------------------------------------------------
# Selection logic fed CUDA facts
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda`` of a node whose processes each see ``visible`` GPUs ("NVIDIA H100 80GB
    HBM3", sm90); records ``set_device`` calls. Nothing here touches a real GPU."""
    state = types.SimpleNamespace(visible=8, current=0, set_device=[], rng={})

    def set_device(device):
        index = torch.device(device).index if not isinstance(device, int) else device
        if not 0 <= index < state.visible:
            raise RuntimeError("CUDA error: invalid device ordinal")
        state.set_device.append(index)
        state.current = index

    def get_rng_state(device="cuda"):
        index = state.current if device == "cuda" else torch.device("cuda", device).index
        return state.rng.get(index, torch.tensor([index], dtype=torch.uint8))

    def set_rng_state(new_state, device="cuda"):
        index = state.current if device == "cuda" else device
        if not 0 <= index < state.visible:
            raise IndexError("tuple index out of range")
        state.rng[index] = new_state

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: state.visible)
    monkeypatch.setattr(cuda, "set_device", set_device)
    monkeypatch.setattr(cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(cuda, "get_rng_state_all",
                        lambda: [get_rng_state(i) for i in range(state.visible)])
    monkeypatch.setattr(cuda, "set_rng_state_all",
                        lambda states: [set_rng_state(s, i) for i, s in enumerate(states)])
    return state


def test_each_rank_takes_the_gpu_of_its_local_rank(fake_cuda):
    from tape_train.devices import pick_device

    for local_rank in range(8):
        assert pick_device("auto", local_rank) == torch.device("cuda", local_rank)
        assert fake_cuda.set_device[-1] == local_rank and fake_cuda.current == local_rank
    assert pick_device("cpu", 5) == torch.device("cpu")


def test_a_local_rank_without_a_gpu_fails_in_one_line(fake_cuda, monkeypatch):
    from tape_train.devices import DeviceError, pick_device

    fake_cuda.visible = 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(DeviceError, match=r"LOCAL_RANK=2 but this process sees 2 CUDA "
                                          r"device\(s\) \(CUDA_VISIBLE_DEVICES=0,1\): start at "
                                          r"most 2 process"):
        pick_device("cuda", 2)
    assert fake_cuda.set_device == []  # refused before any CUDA call


def test_no_cuda_is_one_line_naming_the_setting(monkeypatch):
    from tape_train.devices import DeviceError, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"^--device cuda: no CUDA device here "):
        pick_device("cuda", 0, "--device")
    assert pick_device("auto", 3) == torch.device("cpu")


class _Stop(Exception):
    """Raised where the process group would start (``deepspeed.init_distributed``)."""


def _stop_at_process_group(monkeypatch, events: list) -> None:
    """DeepSpeed's ``init_distributed`` records its backend in ``events`` and raises _Stop."""
    import deepspeed

    def init_distributed(dist_backend, **kwargs):
        events.append(dist_backend)
        raise _Stop

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)


def test_the_trainer_starts_nccl_on_cuda_and_gloo_on_cpu(fake_cuda, monkeypatch):
    from tape_train.train import distributed as tdist

    chosen = []
    _stop_at_process_group(monkeypatch, chosen)
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("LOCAL_RANK", "5")
    for device, backend in (("auto", "nccl"), ("cpu", "gloo")):
        with pytest.raises(_Stop):
            tdist.init_distributed(device)
        assert chosen[-1] == backend
    assert fake_cuda.set_device == [5]


def test_the_cuda_allocator_is_set_before_nccl_starts(fake_cuda, monkeypatch):
    """``train.cuda_expandable_segments`` is applied right after the device is chosen, before
    the process group (NCCL allocates on the device); not on CPU, not over the user's
    PYTORCH_CUDA_ALLOC_CONF, not when the caller does not ask (``None``)."""
    from tape_train.train import cuda_allocator
    from tape_train.train import distributed as tdist

    events = []
    _stop_at_process_group(monkeypatch, events)
    monkeypatch.setattr(cuda_allocator, "set_allocator_settings", events.append)
    for name in cuda_allocator.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "9")  # else init_distributed sets a 1-rank world's variables
    monkeypatch.setenv("LOCAL_RANK", "1")
    for device, expandable, expected in (("auto", True, [cuda_allocator.EXPANDABLE, "nccl"]),
                                         ("auto", False, ["nccl"]), ("auto", None, ["nccl"]),
                                         ("cpu", True, ["gloo"])):
        events.clear()
        with pytest.raises(_Stop):
            tdist.init_distributed(device, cuda_expandable_segments=expandable)
        assert events == expected, (device, expandable)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    events.clear()
    with pytest.raises(_Stop):
        tdist.init_distributed("auto", cuda_expandable_segments=True)
    assert events == ["nccl"]


def test_collectives_of_nccl_live_on_the_current_gpu(fake_cuda, monkeypatch):
    from tape_train.train import distributed as tdist

    fake_cuda.current = 6
    monkeypatch.setattr(tdist.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist.dist, "get_backend", lambda group=None: "nccl")
    assert tdist.collective_device() == torch.device("cuda", 6)
    monkeypatch.setattr(tdist.dist, "get_backend", lambda group=None: "gloo")
    assert tdist.collective_device() == torch.device("cpu")


def test_eval_cli_takes_the_gpu_of_its_local_rank(fake_cuda, monkeypatch):
    from tape_train.eval.cli import _init_distributed

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rank, world, device, reduce = _init_distributed("auto")
    assert device == torch.device("cuda", 3) and fake_cuda.set_device == [3] and reduce is None


def test_a_rank_saves_and_restores_only_its_own_gpus_random_stream(fake_cuda):
    """Saved with 8 GPUs visible (rank on cuda:5), resumed where each process sees one GPU:
    the state of cuda:5 must land on this process's cuda:0 (restoring all 8 failed)."""
    from tape_train.train import checkpoint as ckpt

    fake_cuda.current = 5
    fake_cuda.rng = {i: torch.tensor([100 + i], dtype=torch.uint8) for i in range(8)}
    saved = ckpt.capture_rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([105], dtype=torch.uint8))
    fake_cuda.visible, fake_cuda.current, fake_cuda.rng = 1, 0, {}
    ckpt.restore_rng_state(saved)
    assert fake_cuda.rng == {0: torch.tensor([105], dtype=torch.uint8)}
    # A checkpoint of the old format (one state per visible GPU) resumes too.
    fake_cuda.visible, fake_cuda.current, fake_cuda.rng = 8, 5, {}
    ckpt.restore_rng_state({**saved, "cuda": [torch.tensor([i], dtype=torch.uint8)
                                              for i in range(8)]})
    assert fake_cuda.rng == {5: torch.tensor([5], dtype=torch.uint8)}


def test_attention_backend_on_a_gpu(fake_cuda, monkeypatch):
    from tape_train.model import attention

    cuda = torch.device("cuda", 4)
    tape = TransformerLM(small_config("tape")).pe
    rope = TransformerLM(small_config("rope")).pe
    t5 = TransformerLM(small_config("t5")).pe
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    monkeypatch.setattr(attention, "_triton_ok", lambda device: device.type == "cuda")
    bf16, fp32 = torch.bfloat16, torch.float32
    assert attention.resolve_backend("auto", tape, cuda, bf16, False) == "triton"
    assert attention.resolve_backend("auto", tape, cuda, bf16, True) == "sdpa"   # decoding
    # D = 128 on sm_90: SDPA in key-width parts measured faster than the fused kernel; a
    # deterministic run keeps the fused kernel (atomic-free dq), sm_80 (unmeasured) too.
    wide = TransformerLM(small_config("tape", hidden_size=256, num_heads=2)).pe
    assert wide.cfg.head_dim == 128 and tape.cfg.head_dim != 128
    assert attention.resolve_backend("auto", wide, cuda, bf16, False) == "sdpa"
    assert attention.resolve_backend("triton", wide, cuda, bf16, False) == "triton"
    torch.use_deterministic_algorithms(True)
    try:
        assert attention.resolve_backend("auto", wide, cuda, bf16, False) == "triton"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert attention.resolve_backend("auto", wide, cuda, bf16, False) == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert attention.resolve_backend("auto", wide, cuda, bf16, False) == "sdpa"
    assert attention.resolve_backend("auto", tape, cuda, bf16, False, plain_value=True) == "flash"
    assert attention.resolve_backend("auto", rope, cuda, bf16, False) == "flash"
    assert attention.resolve_backend("auto", rope, cuda, fp32, False) == "sdpa"
    assert attention.resolve_backend("auto", t5, cuda, bf16, False, has_bias=True) == "sdpa"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    assert attention.resolve_backend("auto", rope, cuda, bf16, False) == "sdpa"
    with pytest.raises(RuntimeError, match="needs flash-attn installed"):
        attention.resolve_backend("flash", rope, cuda, bf16, False)


def test_the_fused_kernel_needs_sm80(fake_cuda, monkeypatch):
    from tape_train.kernels import triton_available

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index=None: asked.append(index) or (8, 0))
    assert triton_available(torch.device("cuda", 3)) and asked == [3]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    assert not triton_available("cuda:3")
    assert not triton_available("cpu")


def test_peak_and_precision_of_this_ranks_gpu(fake_cuda, monkeypatch):
    from tape_train.precision import resolve_dtype
    from tape_train.train.peak import device_peak_tflops

    names = []
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: names.append(device) or "NVIDIA H100 PCIe")
    assert device_peak_tflops(torch.device("cuda", 7), torch.bfloat16, None)[0] == 756.0
    assert names == [torch.device("cuda", 7)]
    assert device_peak_tflops(torch.device("cuda", 7), torch.float32, None)[0] == 51.2  # no TF32
    choice = resolve_dtype("auto", "cuda")
    assert choice.dtype == "bf16" and "sm90" in choice.reason
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_dtype("auto", "cuda").dtype == "fp32"


def test_the_plan_and_the_run_agree_on_tf32(fake_cuda, monkeypatch):
    """An fp32 run divides by the plain fp32 peak (TF32 stays off): the dry run's step-time
    plan must use the same peak, not the TF32 one (7x higher on an H100)."""
    from tape_train.config import load_run_config
    from tape_train.train.peak import device_peak_tflops
    from tape_train.train.preflight import planning_peak_tflops

    cfg = load_run_config(None, ["model=tiny", "train.dtype=fp32"])
    run_peak = device_peak_tflops(torch.device("cuda", 0), torch.float32, None)[0]
    assert planning_peak_tflops(cfg, "cuda", "H100")[0] == run_peak == 66.9
    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
    try:  # (a property of torch's: monkeypatch cannot set it)
        assert planning_peak_tflops(cfg, "cuda", "H100")[0] == 494.7
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_deepspeed_config_keeps_its_gpu_defaults():
    from tape_train.config import load_run_config
    from tape_train.train.engine import deepspeed_config

    for stage in (1, 3):
        cfg = load_run_config(None, ["model=tiny", f"parallel.zero_stage={stage}",
                                     "train.dtype=bf16"])
        gpu, cpu = deepspeed_config(cfg, "cuda"), deepspeed_config(cfg, "cpu")
        assert gpu["bf16"] == {"enabled": True} and gpu["zero_optimization"]["stage"] == stage
        assert "contiguous_gradients" not in gpu["zero_optimization"]
        assert "memory_efficient_linear" not in gpu["zero_optimization"]
        assert gpu != cpu  # the CPU-only settings are CPU-only


def test_gpu_report_takes_the_trainers_peak(monkeypatch):
    from gpu.common import device_facts

    props = types.SimpleNamespace(name="NVIDIA H100 PCIe", major=9, minor=0,
                                  multi_processor_count=114, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    facts = device_facts(torch.device("cuda", 0))
    assert facts["bf16_peak_tflops"] == 756.0  # the PCIe part, not the SXM's 989
