"""Attention-core speed, causal, side by side in one process at a fixed token count per batch:

- ``tape_fused``: ``tape_attention_triton`` (modulation in registers, one softmax, fused backward);
- ``tape_unfused``: the best plain-torch TAPE path, the faster of ``tape_sdpa3d`` (modulate, one
  SDPA call with the 3D-wide value [v|E⁰|E¹]) and ``tape_3calls`` (modulate, three SDPA calls);
- ``rope_flash`` / ``rope_cudnn``: RoPE (same torch modulation with cos/sin tables) then SDPA
  pinned to the flash or the cuDNN backend.

Achieved TFLOP/s use the FLOP model of spec §4 in units U = b·H·N²·D (one causal N×N×D
product): RoPE 2U forward + 5U backward, fused TAPE 4U + 9U (unfused counted the same: the
work is the same attention). Before those rows, ``state_update_speed`` times TAPE's state
update of one block as the model's autograd node and as the plain form. ``sweep`` times every candidate launch config of each fused
kernel alone and checks each against the fp64 reference at a small shape.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from gpu.common import Budget, rel_err, time_ms

FLOP_UNITS = {"rope_flash": (2, 5), "rope_cudnn": (2, 5), "tape_fused": (4, 9),
              "tape_sdpa3d": (4, 9), "tape_3calls": (4, 9)}


def _sdpa_backend(name: str | None):
    """Pin SDPA to one backend; ``fused``: any but the math one (whose N² memory and time
    at long N would only burn the time budget before an OOM)."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    return sdpa_kernel({"flash": [SDPBackend.FLASH_ATTENTION],
                        "cudnn": [SDPBackend.CUDNN_ATTENTION], "fused": fused}[name])


def methods(deterministic: bool, device) -> dict:
    """The methods, each ``(q, k, v, E⁰, E¹) -> tuple of outputs``. On CPU (smoke) the unfused
    paths may use any SDPA backend (only the math one runs a 3D-wide value there)."""
    from tape_train.kernels import tape_attention_triton
    from tape_train.kernels.reference import modulate

    fused = "fused" if device.type == "cuda" else None

    def rope(backend):
        def run(q, k, v, e0, e1):
            with _sdpa_backend(backend):
                return (F.scaled_dot_product_attention(modulate(q, e0, e1), modulate(k, e0, e1), v,
                                                       is_causal=True),)
        return run

    def tape_fused(q, k, v, e0, e1):
        return tape_attention_triton(q, k, v, e0, e1, deterministic=deterministic)

    def tape_3calls(q, k, v, e0, e1):
        qt, kt = modulate(q, e0, e1), modulate(k, e0, e1)
        with _sdpa_backend(fused):
            return tuple(F.scaled_dot_product_attention(qt, kt, x, is_causal=True)
                         for x in (v, e0, e1))

    def tape_sdpa3d(q, k, v, e0, e1):
        qt, kt = modulate(q, e0, e1), modulate(k, e0, e1)
        with _sdpa_backend(fused):
            out = F.scaled_dot_product_attention(qt, kt, torch.cat((v, e0, e1), -1), is_causal=True)
        return out.split(q.shape[-1], -1)

    return {"rope_flash": rope("flash"), "rope_cudnn": rope("cudnn"), "tape_fused": tape_fused,
            "tape_sdpa3d": tape_sdpa3d, "tape_3calls": tape_3calls}


def make_inputs(b: int, h: int, n: int, d: int, device, dtype):
    """Random q, k, v and layer-0 TAPE state (RoPE cos/sin tables, materialised per head)."""
    gen = torch.Generator(device=device).manual_seed(n + d)
    shape = (b, h, n, d)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(3))
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angle = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq
    angle = torch.cat((angle, angle), -1)
    e0 = angle.cos().to(dtype).expand(shape).contiguous()
    e1 = angle.sin().to(dtype).expand(shape).contiguous()
    return q, k, v, e0, e1


def bench_shape(device, fns: dict, b: int, h: int, n: int, d: int, dtype, warmup: int,
                reps: int) -> dict:
    """fwd and fwd+bwd milliseconds and TFLOP/s of every method at one shape."""
    inputs = make_inputs(b, h, n, d, device, dtype)
    unit = b * h * n * n * d
    out = {"N": n, "D": d, "heads": h, "batch": b, "unit_flops": unit, "methods": {}}
    for name, fn in fns.items():
        leaves = [x.detach().requires_grad_() for x in inputs]
        try:
            with torch.no_grad():
                fwd = time_ms(lambda: fn(*leaves), device, warmup, reps)
            outs = fn(*leaves)
            grads = [torch.randn_like(o) for o in outs]
            del outs

            def fwd_bwd():
                torch.autograd.backward(fn(*leaves), grads)

            fb = time_ms(fwd_bwd, device, warmup, reps)
            uf, ub = FLOP_UNITS[name]
            out["methods"][name] = {"fwd_ms": fwd, "fwd_bwd_ms": fb,
                                    "fwd_tflops": uf * unit / (fwd * 1e-3) / 1e12,
                                    "fwd_bwd_tflops": (uf + ub) * unit / (fb * 1e-3) / 1e12}
        except Exception as exc:  # noqa: BLE001 - an unavailable backend is a result, not a crash
            out["methods"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del leaves
    unfused = [dict(out["methods"][k], path=k) for k in ("tape_sdpa3d", "tape_3calls")
               if "fwd_bwd_ms" in out["methods"].get(k, {})]
    if unfused:
        out["methods"]["tape_unfused"] = min(unfused, key=lambda r: r["fwd_bwd_ms"])
    return out


def state_update_speed(device, shape, tokens: int, dtype, warmup: int, reps: int) -> dict:
    """TAPE's state update of one block (both tables), forward+backward, as the model's
    autograd node and as the plain form it replaced (benchmarks/tape_update.py), side by side:
    device ms (CUDA events: includes the device waiting for the host), the host's ms to issue
    one call, and the bytes kept for the backward beyond E, Ê and y. ``shape`` (M, D, P, N)."""
    import time

    from tape_train.train.memory import saved_for_backward
    from tape_update import VARIANTS, update_case, variant

    m, d, p, n = shape
    b = max(1, tokens // n)
    upd, state, e_hat, y = update_case(b, n, m, d, p, dtype, device)
    grads = [torch.randn_like(e_hat[0]) for _ in range(2)]

    def step():
        torch.autograd.backward(upd(state, e_hat, y), grads)

    row = {"kind": "state_update", "M": m, "D": d, "P": p, "N": n, "batch": b,
           "e_mib": e_hat[0].numel() * e_hat[0].element_size() / 2**20, "variants": {}}
    for name in VARIANTS:
        with variant(name):
            ms = time_ms(step, device, warmup, reps)
            start = time.perf_counter()
            step()                                   # issue only: the host's share of a call
            host = (time.perf_counter() - start) * 1e3
            alive = (*state, *e_hat, y, *upd.parameters())
            kept = saved_for_backward(lambda: upd(state, e_hat, y), alive)[1]
        row["variants"][name] = {"ms": ms, "host_ms": host, "kept_mib": kept / 2**20}
    return row


def kernel_speed(device, plan: dict, budget: Budget, sink: list, flush) -> None:
    """TAPE's state update once, then every (D, heads, N) of ``plan`` in order until the
    budget ends."""
    fns = methods(deterministic=False, device=device)
    dtype = getattr(torch, plan["dtype"])
    try:
        sink.append(state_update_speed(device, plan["update_shape"], plan["tokens"], dtype,
                                       plan["warmup"], plan["reps"]))
    except Exception as exc:  # noqa: BLE001 - the attention rows still run
        sink.append({"kind": "state_update", "error": f"{type(exc).__name__}: {exc}"[:300]})
    flush()
    for d, heads in plan["head_configs"]:
        for n in plan["lengths"]:
            budget.check(f"kernel speed D={d} heads={heads} N={n}")
            b = max(1, plan["tokens"] // n)
            sink.append(bench_shape(device, fns, b, heads, n, d, dtype, plan["warmup"],
                                    plan["reps"]))
            flush()


# ---------------------------------------------------------------------------------------------
# Launch-config sweep (the autotune tables' source)
# ---------------------------------------------------------------------------------------------

EXTRA_SHAPES = {  # (BLOCK_M, BLOCK_N) beyond the tables, larger tiles first
    "fwd": ((128, 128), (128, 64), (64, 64), (128, 32), (64, 32)),
    "bwd_dkv": ((64, 128), (32, 128), (64, 64), (32, 64), (16, 128), (16, 64), (32, 32)),
    "bwd_dq": ((128, 64), (128, 32), (64, 64), (64, 32), (128, 16)),
}


def candidates(arch: int, d: int, kind: str, extra: bool) -> list:
    """The table's entries for (arch, D, kind), then (with ``extra``) untried larger tiles."""
    from tape_train.kernels.tape_attention_configs import KernelConfig, autotune_configs

    out = list(autotune_configs(arch, d, kind))
    if extra:
        for (bm, bn) in EXTRA_SHAPES[kind]:
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = KernelConfig(bm, bn, warps, stages)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _pinned(arch: int, d: int, kind: str, cfg):
    from tape_train.kernels.tape_attention_configs import TapeKernelConfigs, autotune_configs

    first = {k: autotune_configs(arch, d, k)[0] for k in ("fwd", "bwd_dkv", "bwd_dq")}
    first[kind] = cfg
    return TapeKernelConfigs(**first)


def _config_error(device, configs, d: int, n: int, dtype, deterministic: bool) -> tuple[float, float]:
    """(worst relative error over outputs and gradients vs fp64, its tolerance) at a small
    ragged shape; 16-bit tolerances scale with plain torch's own error at that dtype."""
    from tape_train.kernels import tape_attention_reference, tape_attention_triton

    from gpu.correctness import FP32_TOL, LOW_FACTOR, LOW_FLOOR, _run
    from gpu.correctness import make_inputs as exact_inputs

    inputs, grads = exact_inputs(1, 2, n, d, device, seed=11)

    def reference(*x):
        return tape_attention_reference(*x, causal=True)

    ref = _run(reference, inputs, grads, torch.float64)
    got = _run(lambda *x: tape_attention_triton(*x, causal=True, deterministic=deterministic,
                                                configs=configs), inputs, grads, dtype)
    errs = [rel_err(g, r) for g, r in zip(got[0] + got[1], ref[0] + ref[1])]
    if dtype == torch.float32:
        return max(errs), FP32_TOL
    low = _run(reference, inputs, grads, dtype)
    budget = max(rel_err(lo, r) for lo, r in zip(low[0] + low[1], ref[0] + ref[1]))
    return max(errs), LOW_FACTOR * budget + LOW_FLOOR


def sweep(device, plan: dict, arch: int, budget: Budget, sink: list, flush) -> None:
    """Time each candidate of each kernel alone (bf16, causal) at ``plan``'s shape per D.

    Rows: time, TFLOP/s by the FLOP model (forward 4U; backward timed as a whole: 9U with
    atomic dq for dk/dv candidates, 13U deterministic for dq candidates), and the config's
    worst error vs fp64 at a small ragged shape with its tolerance (``ok``).
    """
    from tape_train.kernels.tape_attention_launch import (tape_attention_backward,
                                                          tape_attention_forward)

    dtype = getattr(torch, plan["dtype"])
    for d, heads in plan["head_configs"]:
        n = plan["length"]
        b = max(1, plan["tokens"] // n)
        q, k, v, e0, e1 = make_inputs(b, heads, n, d, device, dtype)
        scale = 1.0 / math.sqrt(d)
        unit = b * heads * n * n * d
        do, de0, de1 = (torch.randn_like(q) for _ in range(3))
        for kind in ("fwd", "bwd_dkv", "bwd_dq"):
            for cfg in candidates(arch, d, kind, plan["extra"])[:plan.get("max_per_kernel")]:
                budget.check(f"sweep {kind} D={d} {cfg.label()}")
                configs = _pinned(arch, d, kind, cfg)
                row = {"D": d, "heads": heads, "N": n, "batch": b, "kernel": kind,
                       "config": cfg.label()}
                try:
                    saved = tape_attention_forward(q, k, v, e0, e1, True, scale, configs)
                    if kind == "fwd":
                        fn = lambda: tape_attention_forward(q, k, v, e0, e1, True, scale, configs)  # noqa: E731
                        units = 4
                    else:
                        det = kind == "bwd_dq"
                        fn = lambda: tape_attention_backward(  # noqa: E731
                            q, k, v, e0, e1, *saved, do, de0, de1, True, scale, det, configs)
                        units = 9 if not det else 13
                    ms = time_ms(fn, device, plan["warmup"], plan["reps"])
                    err, tol = _config_error(device, configs, d, plan["check_len"], dtype,
                                             kind == "bwd_dq")
                    row.update(ms=ms, tflops=units * unit / (ms * 1e-3) / 1e12, err=err,
                               tolerance=tol, ok=err <= tol)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: a result
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                sink.append(row)
                flush()


def table_lines(rows: list[dict], arch: int, keep: int = 3) -> list[str]:
    """Rows of ``tape_attention_configs.TABLE`` from the sweep: the ``keep`` fastest correct
    configs per (D, kernel), fastest first, ready to paste."""
    from tape_train.kernels.tape_attention_configs import KernelConfig

    lines = []
    for d in sorted({r["D"] for r in rows}):
        for kind in ("fwd", "bwd_dkv", "bwd_dq"):
            good = sorted((r for r in rows if r["D"] == d and r["kernel"] == kind and r.get("ok")),
                          key=lambda r: r["ms"])
            if good:
                labels = [KernelConfig.parse(r["config"]).label() for r in good[:keep]]
                lines.append(f"{arch:<4} {d:<4} {kind:<8} " + "  ".join(labels))
    return lines
