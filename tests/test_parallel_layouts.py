"""Multi-process equivalence of every parallel layout with one process (gloo, CPU, fp32,
DeepSpeed ZeRO-3): loss and full gradients, a 20-step training run, checkpoint resume,
sequence-parallel evaluation, and negative controls.

One spawn per world size (2: SP2 then TP2; 4: DP2×SP2 then TP2×SP2); each rank runs every
check for TAPE and RoPE and returns numbers that the parent asserts on. Reference = plain
PyTorch on the same global batch (plus extras: ZeRO-1 / reduce_scatter off, T5 under TP,
activation checkpointing).
"""

from __future__ import annotations

import pytest
import torch

from parallel_utils import (SEQ_LEN, compare_grads, engine_step_loss, global_batch,
                            make_engine, reference_grads, reference_optimizer, run_distributed,
                            tiny_model)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GRAD_RTOL = 1e-5
TRAIN_STEPS = 20
CKPT_AT = 10


def _reference_run(pe: str, dp: int, steps: int):
    model = tiny_model(pe)
    opt = reference_optimizer(model)
    losses = []
    for step in range(steps):
        loss, _ = reference_grads(model, global_batch(step, dp))
        opt.step()
        losses.append(loss)
    return losses, model


def _eval_check(engine, grid, ref) -> tuple[float, float]:
    """Token-weighted loss of 2·SEQ_LEN-long sequences, sharded over SP, vs one process
    (``ref``: the single-process model trained identically)."""
    from tape_train.parallel import sequence_parallel_loss

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 2 * SEQ_LEN), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    engine.eval()
    loss_sum, n = sequence_parallel_loss(engine, ids, labels, grid)
    engine.train()
    ref.eval()
    with torch.no_grad():
        out = ref(ids, labels=labels)
    return (loss_sum / n).item(), (out.loss_sum / out.num_tokens).item()


def _layout_worker(rank, world, out_dir, layouts, pes):
    """Runs each layout in turn in this process group, with its extra checks right after it
    (layouts without TP first: DeepSpeed keeps its AutoTP groups process-global once made)."""
    out = {}
    for name in layouts:
        out[name] = _one_layout(world, out_dir / name, *LAYOUTS[name][1:], pes)
        out[name]["zero_variants"] = [_zero_variant(world, *LAYOUTS[name][1:3], zero)
                                      for layout, zero in ZERO_VARIANTS if layout == name]
        for layout, pe, variant in GRAD_ONLY:
            if layout == name:
                extra = _one_layout(world, out_dir / f"{name}_{pe}_{variant}",
                                    *LAYOUTS[name][1:3], False, False, False, (pe,), variant)
                out[name]["times"] += extra.pop("times")
                out[name][_grad_only_key(pe, variant)] = extra[pe]
    return out


def _zero_variant(world, sp, tp, zero) -> tuple[float, float]:
    """DeepSpeed's grad norm after one step with another ZeRO setting vs one process: the
    loss scale dp·sp must hold for every stage (a wrong divisor shows as a factor 2)."""
    from tape_train.parallel import RankGrid

    grid = RankGrid.from_sizes(world, sp=sp, tp=tp)
    grid.build()
    batch = global_batch(0, grid.dp)
    _, ref_grads = reference_grads(tiny_model("tape"), batch)
    engine = make_engine(tiny_model("tape"), grid, zero=zero)
    engine_step_loss(engine, batch, grid)
    return (float(engine.get_global_grad_norm()),
            torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item())


def _grad_only_key(pe: str, variant: str) -> str:
    return f"{pe}+{variant}" if variant else pe


def _fused_kernel_stand_in():
    """Route TAPE through backend ``triton`` on CPU, with the fp64-checked reference standing
    in for the CUDA kernel: checks that the fused path (raw q, k and [v|E⁰|E¹] handed to
    ``attn.core``) is exchanged by Ulysses like every other backend."""
    import tape_train.kernels as kernels
    from tape_train.kernels.reference import tape_attention_reference
    from tape_train.model import attention as attention_mod

    kernels.tape_attention_triton = lambda q, k, v, e0, e1: tape_attention_reference(
        q, k, v, e0, e1)
    attention_mod._triton_ok = lambda device: True


def _checkpointed(model):
    """Recompute every decoder block in backward, as the trainer's activation checkpointing
    does (non-reentrant); the parallel hooks and collectives then run twice."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.layers:
        layer.forward = (lambda *a, _f=layer.forward, **k:
                         checkpoint(_f, *a, use_reentrant=False, **k))
    return model


def _one_layout(world, out_dir, sp, tp, train, checkpoint, negative, pes, variant=""):
    import time

    from tape_train.parallel import RankGrid

    grid = RankGrid.from_sizes(world, sp=sp, tp=tp)
    grid.build()
    results = {"times": []}
    for pe in pes:
        res = results[pe] = {}
        ref = tiny_model(pe)
        batch = global_batch(0, grid.dp)
        res["ref_loss"], ref_grads = reference_grads(ref, batch)
        t0 = time.perf_counter()
        if variant == "fused_kernel":
            _fused_kernel_stand_in()
        model = tiny_model(pe, **({"attn_backend": "triton"} if variant == "fused_kernel" else {}))
        if variant == "act_ckpt":
            model = _checkpointed(model)
        engine = make_engine(model, grid)
        results["times"].append(("init", time.perf_counter() - t0))
        res["loss"] = engine_step_loss(engine, batch, grid, before_step=lambda: res.update(
            grad_err=compare_grads(engine, ref_grads, grid)))
        if train:
            losses = [res["loss"]]
            # DeepSpeed's global norm (what gradient_clipping uses) must count TP-sharded
            # parameters once per shard and replicated ones once.
            res["grad_norm"] = float(engine.get_global_grad_norm())
            res["ref_grad_norm"] = torch.sqrt(sum((g.double() ** 2).sum()
                                                  for g in ref_grads.values())).item()
            for step in range(1, TRAIN_STEPS):
                if checkpoint and step == CKPT_AT:
                    engine.save_checkpoint(str(out_dir / f"ckpt_{pe}"), tag="step10",
                                           client_state={"step": step})
                losses.append(engine_step_loss(engine, global_batch(step, grid.dp), grid))
            res["losses"] = losses
            results["times"].append(("train", time.perf_counter() - t0))
            res["ref_losses"], ref_model = _reference_run(pe, grid.dp, TRAIN_STEPS)
            res["eval"] = _eval_check(engine, grid, ref_model)
        if checkpoint:
            resumed = make_engine(tiny_model(pe, seed=123), grid)  # different init: load wins
            _, client = resumed.load_checkpoint(str(out_dir / f"ckpt_{pe}"), tag="step10")
            res["resumed_losses"] = []
            for step in range(client["step"], TRAIN_STEPS):
                res["resumed_losses"].append(
                    engine_step_loss(resumed, global_batch(step, grid.dp), grid))
        if negative and pe == "tape":
            # Negative control: a plain head slice of the replicated state (no all-gather of
            # its gradient) must visibly break the gradients.
            import tape_train.parallel.tensor as tensor_mod

            original = tensor_mod.scatter_heads
            tensor_mod.scatter_heads = lambda x, g, sync_grad=True: original(x, g, False)
            try:
                broken = make_engine(tiny_model(pe), grid)
                engine_step_loss(broken, batch, grid, before_step=lambda: res.update(
                    negative_grad_err=compare_grads(broken, ref_grads, grid)))
            finally:
                tensor_mod.scatter_heads = original
    return results


def _check(results, pes, train, checkpoint, negative, layout):
    for rank, per_rank in enumerate(results):
        for pe in pes:
            res = per_rank[pe]
            where = f"{layout} rank {rank} pe={pe}"
            assert res["loss"] == pytest.approx(res["ref_loss"], rel=GRAD_RTOL), where
            worst = max(res["grad_err"], key=res["grad_err"].get)
            assert res["grad_err"][worst] < GRAD_RTOL, \
                f"{where}: {worst} {res['grad_err'][worst]:.2e}"
            if train:
                torch.testing.assert_close(torch.tensor(res["losses"]),
                                           torch.tensor(res["ref_losses"]), rtol=1e-5, atol=0,
                                           msg=f"{where}: training losses")
                assert res["grad_norm"] == pytest.approx(res["ref_grad_norm"], rel=1e-5), where
                # the run must actually learn something, or equality would be vacuous
                assert res["losses"][-1] < res["losses"][0] - 0.05, where
                sharded, full = res["eval"]
                assert sharded == pytest.approx(full, rel=1e-5), f"{where}: eval"
            if checkpoint:
                assert res["resumed_losses"] == res["losses"][CKPT_AT:], f"{where}: resume"
            if negative and pe == "tape":
                err = res["negative_grad_err"]
                assert max(err.values()) > 1e-2, f"{where}: negative control did not break"
                assert err["layers.0.pos_update.w_pa"] > 1e-2, where


LAYOUTS = {
    # name: (world, sp, tp, train, checkpoint, negative)
    "sp2": (2, 2, 1, True, True, False),
    "tp2": (2, 1, 2, True, False, True),
    "dp2_sp2": (4, 2, 1, False, False, False),
    "tp2_sp2": (4, 2, 2, True, True, True),
}
# Other ZeRO settings (grad-norm check, TAPE), run before any TP engine in the process.
ZERO_VARIANTS = (("sp2", {"stage": 1}), ("sp2", {"stage": 3, "reduce_scatter": False}))
# Gradient check only: a learned dense bias (T5) cut to the local heads under TP.
# and TAPE with activation checkpointing at TP2×SP2 (collectives recomputed in backward).
# And TAPE through the fused-kernel backend at SP2 (the reference stands in for the kernel).
GRAD_ONLY = (("tp2", "t5", ""), ("tp2_sp2", "tape", "act_ckpt"), ("sp2", "tape", "fused_kernel"))
# One spawn per world size (process start-up and DeepSpeed's first initialise dominate).
SPAWNS = {"world2_sp2_then_tp2": ("sp2", "tp2"),
          "world4_dp2sp2_then_tp2sp2": ("dp2_sp2", "tp2_sp2")}


@pytest.mark.parametrize("spawn", list(SPAWNS))
def test_layouts_match_single_process(spawn, tmp_path):
    layouts = SPAWNS[spawn]
    world = LAYOUTS[layouts[0]][0]
    pes = ("tape", "rope")
    results = run_distributed(_layout_worker, world, tmp_path, layouts, pes)
    for name in layouts:
        _, _, _, train, checkpoint, negative = LAYOUTS[name]
        print(name, "rank-0 timings (s):", results[0][name]["times"],
              {pe: results[0][name][pe].get("eval") for pe in pes})
        _check([r[name] for r in results], pes, train, checkpoint, negative, name)
    for name in layouts:
        zeros = [z for layout, z in ZERO_VARIANTS if layout == name]
        for rank, r in enumerate(results):
            for (norm, ref_norm), zero in zip(r[name]["zero_variants"], zeros, strict=True):
                assert norm == pytest.approx(ref_norm, rel=1e-5), f"{name} {zero} rank {rank}"
    for name, pe, variant in GRAD_ONLY:
        if name in layouts:
            _check([r[name] for r in results], (_grad_only_key(pe, variant),), False, False,
                   False, name)
