"""The model's memory-lean RMSNorm, SwiGLU and chunked loss against the plain formulas, side by
side in one process: forward+backward time and the bytes kept for the backward.

``plain`` swaps in what the model did before (autograd through the RMSNorm and SwiGLU
formulas; ``F.cross_entropy`` on the whole fp32 logits); ``lean`` is the model as it is.
Repetitions are interleaved (plain, lean, plain, ...) and the best of each is kept, so machine
load hits both alike. Saved bytes are counted exactly with ``saved_tensors_hooks`` over unique
storages (parameters excluded).

    python benchmarks/lean_activations.py                        # tiny and 125m, N=1024, fp32
    python benchmarks/lean_activations.py --sizes 125m --dtype bfloat16 --micro-batch 2

Numbers are printed (and written with --json), never asserted; docs/model.md records them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tape_train.files import write_atomic  # noqa: E402
from tape_train.model import TransformerLM, load_model_config  # noqa: E402
from tape_train.model.layers import RMSNorm, SwiGLU  # noqa: E402
from tape_train.model.lm_head import IGNORE_INDEX  # noqa: E402
from tape_train.train.memory import saved_for_backward  # noqa: E402


def _plain_rms_norm(self, x):
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * xf.to(x.dtype)


def _plain_swiglu(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@contextlib.contextmanager
def plain_layers():
    """RMSNorm and SwiGLU as plain autograd formulas while inside."""
    saved = RMSNorm.forward, SwiGLU.forward
    RMSNorm.forward, SwiGLU.forward = _plain_rms_norm, _plain_swiglu
    try:
        yield
    finally:
        RMSNorm.forward, SwiGLU.forward = saved


def loss_of(model, ids, variant: str) -> torch.Tensor:
    """Token-mean loss of ``ids`` (labels = ids) the way ``variant`` computes it."""
    if variant == "lean":
        return model(ids, labels=ids).loss
    with plain_layers():
        logits = model(ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten(),
                               ignore_index=IGNORE_INDEX)


def saved_bytes(model, ids, variant: str) -> int:
    return saved_for_backward(lambda: loss_of(model, ids, variant),
                              exclude=model.parameters())[1]


def step_s(model, ids, variant: str) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_of(model, ids, variant).backward()
    return time.perf_counter() - start


def measure(size: str, pe: str, seq_len: int, micro_batch: int, dtype, reps: int) -> dict:
    torch.manual_seed(0)
    cfg = load_model_config(size, pe=pe, max_seq_len=max(seq_len, 128))
    model = TransformerLM(cfg).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    variants = ("plain", "lean")
    with torch.no_grad():
        losses = {v: float(loss_of(model, ids, v)) for v in variants}
    times = {v: [] for v in variants}
    for v in variants:                                   # warm-up
        step_s(model, ids, v)
    for _ in range(reps):
        for v in variants:
            times[v].append(step_s(model, ids, v))
    row = {"size": size, "pe": pe, "seq_len": seq_len, "micro_batch": micro_batch,
           "dtype": str(dtype).removeprefix("torch."), "loss": losses}
    for v in variants:
        row[f"{v}_s"] = min(times[v])
        row[f"{v}_saved_mib"] = saved_bytes(model, ids, v) / 2**20
    row["time_ratio"] = row["lean_s"] / row["plain_s"]
    row["saved_ratio"] = row["lean_saved_mib"] / row["plain_saved_mib"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "125m"])
    p.add_argument("--encodings", nargs="+", default=["tape", "rope"])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"{'size':6} {'pe':5} {'plain s':>8} {'lean s':>8} {'time':>6} "
          f"{'plain MiB':>10} {'lean MiB':>9} {'saved':>6}  loss plain / lean", flush=True)
    rows = []
    for size in args.sizes:
        for pe in args.encodings:
            r = measure(size, pe, args.seq_len, args.micro_batch, dtype, args.reps)
            rows.append(r)
            print(f"{size:6} {pe:5} {r['plain_s']:8.3f} {r['lean_s']:8.3f} "
                  f"{r['time_ratio']:5.2f}x {r['plain_saved_mib']:10.1f} "
                  f"{r['lean_saved_mib']:9.1f} {r['saved_ratio']:5.2f}x  "
                  f"{r['loss']['plain']:.6f} / {r['loss']['lean']:.6f}", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps({"args": vars(args) | {"json": str(args.json)},
                                            "torch": torch.__version__, "rows": rows},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
