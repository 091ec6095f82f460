"""Numerics of the fused Triton TAPE attention in Triton's CPU interpreter (spec §4, T8, T9).

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so the kernels run in ONE
subprocess (this file executed as a script) that evaluates every case and prints JSON; the
pytest process and the other tests of the session never see the variable. Each case compares
O, Ê⁰, Ê¹ and the gradients of q, k, v, E⁰, E¹ with the fp64 reference
``tape_train.kernels.reference.tape_attention_reference``. Tiles are the small
``INTERPRETER_CONFIGS`` (32×16 / 16×32), so N = 40 spans several blocks with a masked tail;
the ``tiles_*`` cases pin, one by one, every tile shape the GPU autotuner may launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tape_train.kernels.tape_attention_configs import HEAD_DIMS, KERNELS, tables_by_element_size

REPO = Path(__file__).resolve().parents[1]

# name -> (N, D, causal, deterministic, dtype, layout[, pinned tile labels fwd, bwd_dkv, bwd_dq])
CASES = {
    "causal_n40_d32_atomic_fp32": (40, 32, True, False, "float32", "contiguous"),
    "causal_n40_d64_deterministic_fp32": (40, 64, True, True, "float32", "contiguous"),
    "causal_n16_d32_one_block_fp32": (16, 32, True, False, "float32", "contiguous"),
    "full_n33_d32_atomic_fp32": (33, 32, False, False, "float32", "contiguous"),
    "full_n40_d64_deterministic_fp32": (40, 64, False, True, "float32", "contiguous"),
    "causal_n40_d32_strided_fp32": (40, 32, True, False, "float32", "strided"),
    "causal_n40_d32_strided_deterministic_fp32": (40, 32, True, True, "float32", "strided"),
    "causal_n40_d32_bf16": (40, 32, True, False, "bfloat16", "contiguous"),
    "causal_n40_d32_fp16_fp32e": (40, 32, True, True, "float16", "fp32_e"),
}


def _tile_cases() -> dict:
    """Every (BLOCK_M, BLOCK_N) of the GPU tables (all archs, both element sizes) in fp32.

    The tiling (causal diagonal, unmasked middle, masked tail) depends on the block shapes, and
    the tables hold ratios the interpreter's own tiles never show (square, 1:4, 8:1). Per head
    dim the i-th distinct shape of each kernel run together (warps and stages do not change the
    interpreter's arithmetic), at N = 1.5 of the largest tile + 7 (its second block a masked
    tail): causal with the deterministic dq kernel, and bidirectional with atomic dq.
    """
    cases = {}
    for d in HEAD_DIMS:
        shapes = {kernel: sorted({(c.block_m, c.block_n)
                                  for table in tables_by_element_size().values()
                                  for per_dim in table.values() for c in per_dim[d][kernel]})
                  for kernel in KERNELS}
        for i in range(max(len(s) for s in shapes.values())):
            tiles = tuple(shapes[kernel][i % len(shapes[kernel])] for kernel in KERNELS)
            n = max(max(t) for t in tiles) * 3 // 2 + 7
            labels = tuple(f"{m}x{k}w4s1" for m, k in tiles)
            for causal, deterministic in ((True, True), (False, False)):
                name = f"tiles_d{d}_{'_'.join(labels)}_{'causal' if causal else 'full'}"
                cases[name] = (n, d, causal, deterministic, "float32", "contiguous", labels)
    return cases


CASES.update(_tile_cases())
OUTPUTS = ("O", "E0_hat", "E1_hat")
GRADS = ("q", "k", "v", "e0", "e1")


def _make_inputs(torch, n: int, d: int, seed: int):
    """fp64 q, k, v, E⁰, E¹ of shape (1, 2, n, d); E is a generic (non-rotation) state."""
    g = torch.Generator().manual_seed(seed)
    b, m = 1, 2
    q, k, v = (torch.randn(b, m, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    angle = torch.rand(b, m, n, d // 2, generator=g, dtype=torch.float64) * 6.3
    gain = 0.5 + torch.rand(b, m, n, d, generator=g, dtype=torch.float64)
    e0 = torch.cat((angle.cos(), angle.cos()), -1) * gain
    e1 = torch.cat((angle.sin(), angle.sin()), -1) * gain.flip(-1)
    grads = [torch.randn(b, m, n, d, generator=g, dtype=torch.float64) for _ in range(3)]
    return [q, k, v, e0, e1], grads


def _as_layout(torch, x, layout: str, dtype):
    """Kernel input with the requested memory layout (values unchanged)."""
    x = x.to(dtype)
    if layout == "strided":
        # (b, N, M, D) storage viewed as (b, M, N, D), as a head split of a projection gives,
        # padded along N so the sequence stride is not the head-dim product either.
        b, m, n, d = x.shape
        store = torch.zeros(b, n + 3, m, d, dtype=dtype)
        store[:, :n] = x.transpose(1, 2)
        return store[:, :n].transpose(1, 2)
    return x.contiguous()


def _run_case(name: str) -> dict:
    import torch

    from tape_train.kernels import (KernelConfig, TapeKernelConfigs, tape_attention_reference,
                                    tape_attention_triton)

    n, d, causal, deterministic, dtype_name, layout, *tiles = CASES[name]
    configs = TapeKernelConfigs(*map(KernelConfig.parse, tiles[0])) if tiles else None
    dtype = getattr(torch, dtype_name)
    e_dtype = torch.float32 if layout == "fp32_e" else dtype
    data, grads64 = _make_inputs(torch, n, d, seed=n * 1000 + d)

    def reference(inputs, dt, detach_attention_for_e=False):
        leaves = [x.to(dt).detach().requires_grad_() for x in inputs]
        if detach_attention_for_e:
            # T9 negative control: Ê computed with A detached, i.e. dropping the q/k gradient
            # through Ê = A·E (the released kernel's bug); the E value path is kept.
            o, _, _ = tape_attention_reference(*leaves, causal=causal)
            a = _attention_weights(torch, leaves, causal)
            outs = (o, a.detach() @ leaves[3], a.detach() @ leaves[4])
        else:
            outs = tape_attention_reference(*leaves, causal=causal)
        torch.autograd.backward(outs, [g.to(dt) for g in grads64])
        return [o.detach() for o in outs], [x.grad for x in leaves]

    ref_out, ref_grad = reference(data, torch.float64)
    leaves = [_as_layout(torch, x, layout, e_dtype if i >= 3 else dtype).requires_grad_()
              for i, x in enumerate(data)]
    outs = tape_attention_triton(*leaves, causal=causal, deterministic=deterministic,
                                 configs=configs)
    grad_outs = [_as_layout(torch, g, layout, o.dtype) for g, o in zip(grads64, outs)]
    torch.autograd.backward(outs, grad_outs)

    def err(a, b):
        return (a.double() - b.double()).abs().max().item()

    result = {
        "input_contiguous": [x.is_contiguous() for x in leaves],
        "grad_out_contiguous": [g.is_contiguous() for g in grad_outs],
        "out_err": {k: err(a, r) for k, a, r in zip(OUTPUTS, outs, ref_out)},
        "grad_err": {k: err(x.grad, r) for k, x, r in zip(GRADS, leaves, ref_grad)},
        "out_scale": {k: r.abs().max().item() for k, r in zip(OUTPUTS, ref_out)},
        "grad_scale": {k: r.abs().max().item() for k, r in zip(GRADS, ref_grad)},
    }
    if dtype != torch.float32:
        # The same computation in plain torch at the input precision: the error budget of the dtype.
        low_out, low_grad = reference(data, dtype)
        result["low_out_err"] = {k: err(a, r) for k, a, r in zip(OUTPUTS, low_out, ref_out)}
        result["low_grad_err"] = {k: err(a, r) for k, a, r in zip(GRADS, low_grad, ref_grad)}
    if name == "causal_n40_d32_atomic_fp32":
        _, dropped_grad = reference(data, torch.float64, detach_attention_for_e=True)
        result["dropped_vs_full"] = {k: err(a, r) for k, a, r in zip(GRADS, dropped_grad, ref_grad)}
        result["kernel_vs_dropped"] = {k: err(x.grad, a) for k, x, a in zip(GRADS, leaves, dropped_grad)}
    return result


def _attention_weights(torch, leaves, causal):
    from tape_train.kernels.reference import modulate

    q, k, _, e0, e1 = leaves
    logits = modulate(q, e0, e1) @ modulate(k, e0, e1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = logits.shape[-1]
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(logits, -1)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker"],
        capture_output=True, text=True, env=env, timeout=600, cwd=REPO,
    )
    if proc.returncode != 0:
        pytest.fail(f"interpreter worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.triton


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_fp64_reference(interpreter_results, case):
    res = interpreter_results[case]
    dtype_name, layout = CASES[case][4], CASES[case][5]
    if layout == "strided":
        assert not any(res["input_contiguous"]) and not any(res["grad_out_contiguous"])
    if dtype_name == "float32":
        for k, e in res["out_err"].items():
            assert e <= 2e-5 * max(1.0, res["out_scale"][k]), (k, e)
        for k, e in res["grad_err"].items():
            assert e <= 5e-5 * max(1.0, res["grad_scale"][k]), (k, e)
    else:
        # Low precision: within a small multiple of plain torch's own error at that dtype.
        for k, e in res["out_err"].items():
            assert e <= 3 * res["low_out_err"][k] + 1e-3, (k, e, res["low_out_err"][k])
        for k, e in res["grad_err"].items():
            assert e <= 3 * res["low_grad_err"][k] + 1e-2 * res["grad_scale"][k], (k, e, res["low_grad_err"][k])


def test_q_and_k_gradients_through_e_hat_are_kept(interpreter_results):
    """Spec T9: dropping the q/k gradient through Ê = A·E changes dq, dk (and dE via q̃/k̃);
    the kernel matches the full gradient, not the dropped one."""
    res = interpreter_results["causal_n40_d32_atomic_fp32"]
    for k in ("q", "k"):
        gap = res["dropped_vs_full"][k]
        assert gap > 0.05 * res["grad_scale"][k], (k, gap)  # the control: the path matters
        assert res["kernel_vs_dropped"][k] > 100 * res["grad_err"][k], k
    assert res["dropped_vs_full"]["v"] == 0.0  # the value path is untouched by the control


def _patch_interpreter_bf16_dot() -> None:
    """Work around Triton 3.9's interpreter multiplying bf16 dot operands as their raw uint16 bits.

    The interpreter stores bf16 as uint16 and its ``create_dot`` hands those integers to
    ``np.matmul``; GPUs are unaffected. Widening the bits to fp32 (exact) before the product
    restores the real semantics (bf16 operands, fp32 accumulation). Only this subprocess is patched.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _worker() -> None:
    import torch

    _patch_interpreter_bf16_dot()
    torch.manual_seed(0)
    print(json.dumps({name: _run_case(name) for name in CASES}))


if __name__ == "__main__":
    if "--worker" not in sys.argv:
        raise SystemExit("run through pytest; `--worker` is the interpreter subprocess")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the worker needs TRITON_INTERPRET=1 set before Triton is imported")
    _worker()
