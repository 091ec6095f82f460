"""Correctness on the device: fused kernel vs the fp64 reference, the model's ``triton``
backend vs ``eager``, KV-cache decoding vs the full forward, bf16 trainer steps through
DeepSpeed (ZeRO-1 and ZeRO-3) against fp32, and what of those steps waits for the device
(``host_sync_check``).

Every check returns a dict with its measured errors, its tolerance and ``ok``. Errors are
relative: ‖x − ref‖ / ‖ref‖ (``common.rel_err``). Tolerances:
- fp32 kernel inputs run IEEE fp32 dots (TF32 off): ``FP32_TOL``;
- 16-bit inputs: within ``LOW_FACTOR`` × the error of plain torch at the same dtype (the
  dtype's own budget) + ``LOW_FLOOR``;
- trainer: bf16 per-step loss within ``TRAIN_BF16_TOL`` of fp32's (relative), ZeRO-3 within
  ``TRAIN_ZERO_TOL`` of ZeRO-1 in the same dtype.
"""

from __future__ import annotations

import itertools
import sys
import time
import traceback
from pathlib import Path

import torch

from gpu.common import Budget, OutOfTime, rel_err

FP32_TOL = 1e-4
LOW_FACTOR, LOW_FLOOR = 3.0, 2e-3
TRAIN_BF16_TOL = 2e-2
TRAIN_ZERO_TOL = 2e-3
TRAINER_GRACE_S = 120.0  # see trainer_checks
OUTPUTS = ("O", "E0_hat", "E1_hat")
GRADS = ("dq", "dk", "dv", "dE0", "dE1")


def make_inputs(b: int, m: int, n: int, d: int, device, seed: int):
    """fp64 (q, k, v, E⁰, E¹) and three output gradients of shape (b, m, n, d).

    E is a generic state (rotations with gains, not RoPE tables), so every path matters."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float64)

    q, k, v = randn(b, m, n, d), randn(b, m, n, d), randn(b, m, n, d)
    angle = torch.rand(b, m, n, d // 2, generator=g, device=device, dtype=torch.float64) * 6.3
    gain = 0.5 + torch.rand(b, m, n, d, generator=g, device=device, dtype=torch.float64)
    e0 = torch.cat((angle.cos(), angle.cos()), -1) * gain
    e1 = torch.cat((angle.sin(), angle.sin()), -1) * gain.flip(-1)
    return [q, k, v, e0, e1], [randn(b, m, n, d) for _ in range(3)]


def _run(fn, inputs, grads, dtype):
    leaves = [x.to(dtype).detach().requires_grad_() for x in inputs]
    outs = fn(*leaves)
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])
    return [o.detach() for o in outs], [x.grad for x in leaves]


def preferred_configs(device, d: int, dtype=torch.bfloat16):
    """The first (preferred) table entry of each kernel for this GPU and the inputs' element size
    (fp32 has its own table); None on CPU (the interpreter's tiles). Pinned so that the checks
    compile 4 kernels per (D, dtype) instead of autotuning every candidate: the other candidates
    are checked by the sweep."""
    if device.type != "cuda":
        return None
    from tape_train.kernels.tape_attention_configs import (TapeKernelConfigs, arch_for_capability,
                                                           autotune_configs)

    arch = arch_for_capability(*torch.cuda.get_device_capability(device))
    size = torch.empty((), dtype=dtype).element_size()
    return TapeKernelConfigs(*(autotune_configs(arch, d, k, size)[0]
                               for k in ("fwd", "bwd_dkv", "bwd_dq")))


def kernel_case(device, dtype, d: int, n: int, deterministic: bool, b: int, m: int) -> dict:
    """One fused-kernel check: forward and the five input gradients, causal."""
    from tape_train.kernels import tape_attention_reference, tape_attention_triton

    inputs, grads = make_inputs(b, m, n, d, device, seed=1000 * n + d)
    configs = preferred_configs(device, d, dtype)

    def kernel(*xs):
        return tape_attention_triton(*xs, causal=True, deterministic=deterministic, configs=configs)

    def reference(*xs):
        return tape_attention_reference(*xs, causal=True)

    ref_out, ref_grad = _run(reference, inputs, grads, torch.float64)
    out, grad = _run(kernel, inputs, grads, dtype)
    errors = {k: rel_err(a, r) for k, a, r in zip(OUTPUTS + GRADS, out + grad, ref_out + ref_grad)}
    case = {"dtype": str(dtype).removeprefix("torch."), "D": d, "N": n, "batch": b, "heads": m,
            "dq": "deterministic" if deterministic else "atomic",
            "configs": None if configs is None else {k: getattr(configs, k).label()
                                                     for k in ("fwd", "bwd_dkv", "bwd_dq")},
            "errors": errors}
    if dtype == torch.float32:
        case["tolerance"] = {k: FP32_TOL for k in errors}
    else:
        low_out, low_grad = _run(reference, inputs, grads, dtype)
        budget = {k: rel_err(a, r) for k, a, r in zip(OUTPUTS + GRADS, low_out + low_grad,
                                                       ref_out + ref_grad)}
        case["torch_same_dtype_errors"] = budget
        case["tolerance"] = {k: LOW_FACTOR * budget[k] + LOW_FLOOR for k in errors}
    case["ok"] = all(errors[k] <= case["tolerance"][k] for k in errors)
    return case


def kernel_control(device, d: int, n: int) -> dict:
    """Negative control: the same comparison against a NON-causal reference must fail."""
    from tape_train.kernels import tape_attention_reference, tape_attention_triton

    inputs, grads = make_inputs(1, 2, n, d, device, seed=7)
    out, _ = _run(lambda *xs: tape_attention_triton(*xs, causal=True), inputs, grads, torch.float32)
    wrong, _ = _run(lambda *xs: tape_attention_reference(*xs, causal=False), inputs, grads,
                    torch.float64)
    err = rel_err(out[0], wrong[0])
    return {"what": "causal kernel vs non-causal reference (must differ)", "error": err,
            "ok": err > 100 * FP32_TOL}


def guarded(fn, *args, **known) -> dict:
    """``fn(*args)``, or — when it raises — ``known`` with ``ok: False`` and ``crash``: the
    exception in one line (its traceback goes to the log). One check that crashes on a device
    (a kernel that does not compile, a launch error) then fails alone, and the checks after it
    still run: a lease is too short to run the report twice."""
    try:
        return fn(*args)
    except OutOfTime:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded as this check's failure
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        return {**known, "ok": False, "crash": f"{type(exc).__name__}: {str(exc)[:300]}"}


def kernel_checks(device, shapes: dict, budget: Budget, sink: list, flush) -> None:
    """All (dtype, D, N, dq mode) cases of ``shapes``; appends each result as it comes."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks use IEEE dots
    sink.append({"control": guarded(kernel_control, device, shapes["head_dims"][0],
                                    shapes["lengths"][0])})
    flush()
    for dtype_name, d, n, det in itertools.product(shapes["dtypes"], shapes["head_dims"],
                                                   shapes["lengths"], (False, True)):
        budget.check(f"kernel case {dtype_name} D={d} N={n}")
        sink.append(guarded(kernel_case, device, getattr(torch, dtype_name), d, n, det,
                            shapes["batch"], shapes["heads"],
                            dtype=dtype_name, D=d, N=n,
                            dq="deterministic" if det else "atomic"))
        flush()


def _small_model(backend: str, dtype, model_kw: dict, device):
    from tape_train.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**model_kw, pe="tape", attn_backend=backend))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # TAPE's zero-initialised state projections get values: all paths live
        for layer in model.layers:
            if layer.pos_update is not None:
                for p in (layer.pos_update.w_pa, layer.pos_update.w_up, layer.pos_update.w_dn):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(device=device, dtype=dtype)


def model_backend_check(device, model_kw: dict, seq: int, batch: int) -> dict:
    """Logits, loss and every parameter gradient of the ``triton`` backend vs ``eager``, fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randint(0, model_kw["vocab_size"], (batch, seq),
                      generator=torch.Generator().manual_seed(2)).to(device)
    got = {}
    for backend in ("eager", "triton"):
        model = _small_model(backend, torch.float32, model_kw, device)
        out = model(x, labels=x, return_logits=True)
        out.loss.backward()
        got[backend] = (out.logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    grad_errs = {n: rel_err(got["triton"][1][n], g) for n, g in got["eager"][1].items()
                 if g is not None}
    worst = max(grad_errs, key=grad_errs.get)
    res = {"seq": seq, "batch": batch, "logits_err": rel_err(got["triton"][0], got["eager"][0]),
           "worst_grad": worst, "worst_grad_err": grad_errs[worst], "tolerance": 10 * FP32_TOL}
    res["ok"] = res["logits_err"] <= res["tolerance"] and res["worst_grad_err"] <= res["tolerance"]
    return res


@torch.no_grad()
def kv_cache_check(device, model_kw: dict, prompt: int, new: int) -> dict:
    """Prefill ``prompt`` tokens then decode ``new`` one at a time; logits vs one full forward."""
    from tape_train.model import KVCache

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _small_model("auto", torch.float32, model_kw, device).eval()
    x = torch.randint(0, model_kw["vocab_size"], (2, prompt + new),
                      generator=torch.Generator().manual_seed(3)).to(device)
    full = model(x).logits
    cache = KVCache(model.cfg.num_layers)
    steps = [model(x[:, :prompt], cache=cache).logits]
    for i in range(prompt, prompt + new):
        steps.append(model(x[:, i:i + 1], cache=cache).logits)
    err = rel_err(torch.cat(steps, 1), full)
    return {"prompt": prompt, "new_tokens": new, "logits_err": err, "tolerance": 10 * FP32_TOL,
            "ok": err <= 10 * FP32_TOL}


DETERMINISTIC_RUNS = ("zero3_bf16_deterministic", "zero3_bf16_deterministic_again")
OFFLOAD_RUN = "zero3_fp32_offload"
OFFLOAD_KEY = "fp32: zero3 offloaded vs on the device"
COMPILE_RUN = "zero3_fp32_compiled"
COMPILE_KEY = "fp32: zero3 compiled (train.compile) vs eager"
DETERMINISTIC_KEY = "bf16 deterministic: run vs the same run again"
SYNC_RUNS = ("zero1_bf16", "zero3_bf16")  # host syncs counted after their loss steps

# name: (ZeRO stage, dtype, extra overrides), in start order. Last: compiling takes the
# longest, so it is what a short budget skips.
TRAINER_RUNS = {
    **{f"zero{zero}_{dtype}": (zero, dtype, [])
       for zero, dtype in itertools.product((1, 3), ("fp32", "bf16"))},
    **{name: (3, "bf16", ["train.deterministic=true"]) for name in DETERMINISTIC_RUNS},
    OFFLOAD_RUN: (3, "fp32", ["parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"]),
    COMPILE_RUN: (3, "fp32", ["train.compile=true"]),
}
# (comparison, run, reference run, tolerance): the per-step losses of run against those of
# reference, relative.
COMPARISONS = (
    *((f"zero{zero}: bf16 vs fp32", f"zero{zero}_bf16", f"zero{zero}_fp32", TRAIN_BF16_TOL)
      for zero in (1, 3)),
    ("fp32: zero3 vs zero1", "zero3_fp32", "zero1_fp32", TRAIN_ZERO_TOL),
    ("bf16: zero3 vs zero1", "zero3_bf16", "zero1_bf16", TRAIN_BF16_TOL),
    # ZeRO-Offload: the same AdamW update on the host (CPU Adam rounds differently)
    (OFFLOAD_KEY, OFFLOAD_RUN, "zero3_fp32", TRAIN_ZERO_TOL),
    # train.compile: the same model to rounding, ZeRO-3's hooks around the graphs
    (COMPILE_KEY, COMPILE_RUN, "zero3_fp32", TRAIN_ZERO_TOL),
    # train.deterministic: the same run twice gives the same losses, bit for bit
    (DETERMINISTIC_KEY, *DETERMINISTIC_RUNS, 0.0),
)


def trainer_run_names(names: list[str] | None, compile_run: bool = True) -> list[str]:
    """The trainer runs to start, in ``TRAINER_RUNS`` order: ``names`` (``None``: all, less
    the compiled one unless ``compile_run``). Raises ValueError naming an unknown run."""
    if names is None:
        return [n for n in TRAINER_RUNS if compile_run or n != COMPILE_RUN]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"expected a list of run names like [\"zero1_fp32\"], got {names!r}")
    unknown = [n for n in names if n not in TRAINER_RUNS]
    if unknown:
        raise ValueError(f"unknown trainer run(s) {', '.join(map(repr, unknown))}; "
                         f"one of {', '.join(TRAINER_RUNS)}")
    return [n for n in TRAINER_RUNS if n in names]


def start_trainers(recipe: Path, work: Path, common_overrides: list[str],
                   names: list[str]) -> dict:
    """Spawn the trainer processes ``names`` of ``TRAINER_RUNS`` (``trainer_run_names``) —
    ZeRO-1/3 × fp32/bf16, ZeRO-3 bf16 twice with ``train.deterministic``, ZeRO-3 fp32 with the
    optimizer and parameters offloaded to the host (pinned memory, DeepSpeed's CPU Adam),
    ZeRO-3 fp32 with ``train.compile`` — which set up in the background while the kernel
    checks run. Finish with ``trainer_checks``."""
    from trainer_process import Child

    from gpu.end_to_end import TrainerProbe

    work.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in names:
        zero, dtype, extra = TRAINER_RUNS[name]
        overrides = [*common_overrides, f"parallel.zero_stage={zero}", f"train.dtype={dtype}",
                     f"train.run_dir={work / name}", *extra]
        runs[name] = Child(name, work / f"{name}.log", TrainerProbe, recipe, overrides)
    return runs


def host_sync_check(runs: dict) -> dict:
    """No line of tape_train may wait for the device once per micro-batch (each wait drains
    the GPU's queue before the next micro-batch can be queued); DeepSpeed's own such sites are
    listed, not judged. ``runs``: ``TrainerProbe.host_syncs`` results by run name."""
    ours = {name: {site: n for site, n in r["per_micro_batch"].items()
                   if site.startswith("tape_train/")} for name, r in runs.items()}
    judged = all(r["micro_batches"] >= 2 for r in runs.values())
    return {"check": "host_syncs", "runs": runs, "tape_train_per_micro_batch": ours,
            "ok": not any(ours.values()) if judged else None}


def trainer_checks(runs: dict, steps: int, budget: Budget, sink: list, flush) -> None:
    """bf16 and fp32 runs of the real trainer under ZeRO-1 and ZeRO-3, each in its own process
    (one-rank NCCL group on a GPU, gloo on CPU); per-step losses compared. Closes ``runs``."""
    from trainer_process import BenchmarkError

    losses, failures, skipped, syncs = {}, {}, [], {}

    def wait() -> float:
        # The runs set up in the background from the section's start: they get a grace past
        # the section's share (never past the report's deadline), so that a share spent on
        # compiling kernels does not throw away runs that are ready.
        return min(budget.left() + TRAINER_GRACE_S, budget.deadline - time.monotonic())

    try:
        for name, child in runs.items():
            if wait() <= 0:
                skipped.append(name)
                continue
            try:  # a run stuck (or compiling for minutes) fails alone, with its stacks
                child.result(timeout=wait())
                losses[name] = child.call("losses", steps, timeout=max(wait(), 30.0))
                if name in SYNC_RUNS:
                    syncs[name] = child.call("host_syncs", steps, timeout=max(wait(), 30.0))
            except BenchmarkError as exc:
                failures[name] = str(exc)[-3000:]
    finally:
        for child in runs.values():
            child.close(timeout=20.0)
    if syncs:
        sink.append(host_sync_check(syncs))
    res = {"check": "trainer", "steps": steps, "losses": losses, "failures": failures,
           "skipped_for_time": skipped,
           "bf16_tolerance": TRAIN_BF16_TOL, "zero_tolerance": TRAIN_ZERO_TOL, "comparisons": {}}
    expected = [c for c in COMPARISONS if c[1] in runs and c[2] in runs]
    limits = {key: limit for key, _, _, limit in expected}
    for key, a, b, _ in expected:
        if losses.get(a) and losses.get(b):
            res["comparisons"][key] = max(abs(x - y) / abs(y)
                                          for x, y in zip(losses[a], losses[b]))
    finite = all(all(map(_finite, v)) for v in losses.values())
    res["ok"] = (not failures and finite
                 and all(v <= limits[k] for k, v in res["comparisons"].items()))
    if res["ok"] and len(res["comparisons"]) < len(expected):
        res["ok"] = None  # not judged: runs skipped for time
    sink.append(res)
    flush()


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
