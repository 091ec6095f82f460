"""``train.compile``: each decoder block through ``torch.compile`` (TorchInductor, here its C++
backend on CPU) computes what the eager block computes — loss and every gradient to fp32
rounding — keeps the parameter names, breaks its graph only at the attention core, and trains
through DeepSpeed ZeRO-3 (whose hooks gather parameters) with activation checkpointing
around the compiled code, with the eager run's losses.

Compiling costs tens of seconds per graph on a busy 2-core machine, so each test compiles
one small model once."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from distributed import run_distributed_test

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None,
                               reason="TorchInductor's CPU backend needs g++")

TINY = dict(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=256,
            tape_position_size=8)


def _loss_and_grads(model, ids, n):
    model.zero_grad(set_to_none=True)
    out = model(ids[:, :n], labels=ids[:, 1:n + 1])
    out.loss.backward()
    return out.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@needs_cxx
@pytest.mark.integration
def test_compiled_blocks_match_eager_and_break_only_at_the_attention_core():
    from torch._dynamo.utils import counters

    from tape_train.model import load_model_config
    from tape_train.model.transformer import TransformerLM
    from tape_train.train.engine import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = TransformerLM(load_model_config("tiny", pe="tape", **TINY))
    # Non-zero TAPE gates (zero at init) so that the state updates reach the loss.
    with torch.no_grad():
        for layer in eager.layers:
            if layer.pos_update is not None:
                layer.pos_update.w_pa.normal_(std=0.2)
                layer.pos_update.w_up.normal_(std=0.2)
    ids = torch.randint(0, 256, (2, 49))
    loss0, grads0 = _loss_and_grads(eager, ids, 48)
    assert counters["stats"]["unique_graphs"] == 0        # negative control: eager compiles nothing

    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 2
    loss1, grads1 = _loss_and_grads(compiled, ids, 48)
    assert counters["stats"]["unique_graphs"] > 0
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert torch.allclose(loss1, loss0, rtol=1e-6, atol=0)
    for name, g0 in grads0.items():
        err = (grads1[name] - g0).abs().max() / g0.abs().max().clamp(min=1e-12)
        assert err < 1e-4, (name, float(err))
    assert grads0["layers.0.pos_update.w_pa"].abs().max() > 0  # the state path is exercised
    # The only breaks: the attention core, kept eager on purpose (a break elsewhere would
    # silently split the fusion, as `_Modulate`'s out= slices did before).
    breaks = list(counters["graph_break"])
    assert breaks and all("compiler.disable" in b and "AttentionCore" in b for b in breaks), breaks

    # Evaluation without gradients at another length: compiled anew, same values.
    eager.eval()
    compiled.eval()
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        want, got = eager(ids[:, :16]).logits, compiled(ids[:, :16]).logits
    assert counters["stats"]["unique_graphs"] > graphs               # compiled, not eager
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


OVERRIDES = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256", "model.tape_position_size=8",
             "model.pe=tape", "train.seq_len=32", "train.micro_batch_size=2", "train.lr=3e-3",
             "train.warmup_steps=0", "train.dtype=fp32", "train.device=cpu",
             "train.synthetic_data=true", "train.max_steps=6", "checkpoint.interval=100",
             "parallel.zero_stage=3", "logging.peak_tflops=1.0", "logging.tensorboard=false",
             "eval.interval=0"]


def _eager_then_compiled(run_dir: str) -> dict:
    from torch._dynamo.utils import counters

    from tape_train.config import load_run_config
    from tape_train.train.loop import Trainer

    out = {}
    for name, extra in (("eager", []),
                        ("compiled", ["train.compile=true",
                                      "train.activation_checkpointing=true"])):
        trainer = Trainer(load_run_config(None, OVERRIDES + extra
                                          + [f"train.run_dir={run_dir}/{name}"]))
        trainer.setup()
        out[name] = [trainer.train_step()["loss"] for _ in range(3)]
        out[name + "_graphs"] = counters["stats"]["unique_graphs"]
        trainer.close()
    return out


@needs_cxx
@pytest.mark.distributed
@pytest.mark.integration
def test_compiled_training_with_zero3_and_checkpointing_matches_eager(tmp_path):
    out = run_distributed_test(_eager_then_compiled, world_size=1, args=(str(tmp_path),),
                               timeout=600)[0]
    assert out["eager_graphs"] == 0 and out["compiled_graphs"] > 0
    assert len(set(out["eager"])) > 1                          # the updates happen
    assert out["compiled"] == pytest.approx(out["eager"], rel=1e-5, abs=0)


def test_preflight_names_a_missing_cpu_compiler(monkeypatch, tmp_path):
    from tape_train.config import load_run_config
    from tape_train.train.preflight import run_preflight

    cfg = load_run_config(None, [*OVERRIDES, "train.compile=true", f"train.run_dir={tmp_path}"])
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    problems = run_preflight(cfg, world_size=1, plan=False).problems
    assert any("train.compile" in p and "CXX=no-such-compiler-xyz" in p for p in problems), \
        problems
    monkeypatch.setenv("CXX", "sh")            # any executable on PATH: the check passes
    assert not any("train.compile" in p
                   for p in run_preflight(cfg, world_size=1, plan=False).problems)
    off = load_run_config(None, [*OVERRIDES, f"train.run_dir={tmp_path}"])
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")      # compile off: not checked
    assert not any("train.compile" in p
                   for p in run_preflight(off, world_size=1, plan=False).problems)
