"""TAPE's state update as one autograd node (``tape_train/model/pe/tape_update.py``) against
autograd through the plain form, side by side in one process.

Three measurements, each for ``plain`` (autograd through ``after_attention`` + ``after_mlp``,
what the model ran before) and ``node`` (the model as it is):

1. the update alone, forward+backward: time (best of interleaved rounds), operators dispatched
   (all, and those that are not views), bytes kept for the backward beyond E, Ê and y;
2. whole TAPE models, forward+backward of a training step on this machine (best of
   interleaved rounds) and the losses of both (they must agree);
3. the activation memory of 350m / 1b at N = 2048 in bf16, counted on PyTorch's meta device by
   the preflight's trace (``tape_train.train.memory.trace_activations``), no GPU needed.

    python benchmarks/tape_update.py                     # defaults below; about 2 minutes
    python benchmarks/tape_update.py --json out.json

The host-bound update shape (b=1, N=64, D=4: 350m's 16 heads and P=64 at negligible
arithmetic) stands for what each operator costs the host; on a GPU that is what a TAPE step
waits on at moderate micro-batches (docs/gpu/nvidia-h100-80gb-hbm3/README.md). Numbers are
printed (and written with --json), never asserted; docs/model.md records them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tape_train.files import write_atomic  # noqa: E402
from tape_train.host_memory import keep_freed_memory  # noqa: E402
from tape_train.model import TransformerLM, load_model_config  # noqa: E402
from tape_train.model.pe.tape import TapeStateUpdate  # noqa: E402
from tape_train.train.memory import saved_for_backward, trace_activations  # noqa: E402

VARIANTS = ("plain", "node")
_VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
          "unsqueeze", "squeeze", "alias", "as_strided", "detach", "split", "unbind"}


@contextlib.contextmanager
def variant(name: str):
    """Inside: ``TapeStateUpdate`` runs the plain form (``plain``) or the model's (``node``)."""
    saved = TapeStateUpdate.forward
    if name == "plain":
        TapeStateUpdate.forward = TapeStateUpdate.plain_update
    try:
        yield
    finally:
        TapeStateUpdate.forward = saved


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def update_case(b, n, m, d, p, dtype, device="cpu"):
    """A state update with random non-zero weights and its inputs (E, Ê, y), on ``device``."""
    cfg = load_model_config("tiny", pe="tape", num_heads=m, hidden_size=m * d,
                            tape_position_size=p)
    torch.manual_seed(0)
    upd = TapeStateUpdate(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for w in upd.parameters():
            w.normal_(std=0.1)
    kw = dict(dtype=dtype, device=device, requires_grad=True)
    state = tuple(torch.randn(b, m, n, d, **kw) for _ in range(2))
    e_hat = tuple(torch.randn(b, m, n, d, **kw) for _ in range(2))
    y = torch.randn(b, n, m * d, **kw)
    return upd, state, e_hat, y


def measure_update(b, n, m, d, p, dtype, rounds: int, calls: int) -> dict:
    upd, state, e_hat, y = update_case(b, n, m, d, p, dtype)
    grads = [torch.randn(b, m, n, d, dtype=dtype) for _ in range(2)]

    def step():
        torch.autograd.backward(upd(state, e_hat, y), grads)

    row = {"b": b, "N": n, "M": m, "D": d, "P": p, "dtype": str(dtype).removeprefix("torch.")}
    times = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        with variant(v):
            step()                                                  # warm-up
            counter = _CountOps()
            with counter:
                step()
            row[f"{v}_ops"] = sum(counter.ops.values())
            row[f"{v}_compute_ops"] = sum(c for op, c in counter.ops.items() if op not in _VIEWS)
            alive = (*state, *e_hat, y, *upd.parameters())
            row[f"{v}_kept_bytes"] = saved_for_backward(lambda: upd(state, e_hat, y), alive)[1]
    for _ in range(rounds):
        for v in VARIANTS:
            with variant(v):
                start = time.perf_counter()
                for _ in range(calls):
                    step()
                times[v].append((time.perf_counter() - start) / calls)
    for v in VARIANTS:
        row[f"{v}_us"] = min(times[v]) * 1e6
    row["e_bytes"] = state[0].numel() * state[0].element_size()
    return row


def measure_model(size: str, seq_len: int, micro_batch: int, dtype, rounds: int) -> dict:
    torch.manual_seed(0)
    cfg = load_model_config(size, pe="tape", max_seq_len=max(seq_len, 128))
    model = TransformerLM(cfg).to(dtype)
    with torch.no_grad():                 # W_up, W_pa are zero at init: make the update work
        for layer in model.layers:
            if layer.pos_update is not None:
                for w in layer.pos_update.parameters():
                    w.normal_(std=cfg.init_std)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    row = {"size": size, "seq_len": seq_len, "micro_batch": micro_batch,
           "dtype": str(dtype).removeprefix("torch.")}
    times = {v: [] for v in VARIANTS}

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item()

    for v in VARIANTS:
        with variant(v):
            row[f"{v}_loss"] = step()                               # warm-up
    for _ in range(rounds):
        for v in VARIANTS:
            with variant(v):
                start = time.perf_counter()
                step()
                times[v].append(time.perf_counter() - start)
    for v in VARIANTS:
        row[f"{v}_s"] = min(times[v])
    return row


def measure_trace(size: str, micro_batch: int, seq_len: int) -> dict:
    cfg = dataclasses.replace(load_model_config(size, pe="tape"), max_seq_len=seq_len)
    row = {"size": size, "micro_batch": micro_batch, "seq_len": seq_len}
    for v in VARIANTS:
        with variant(v):
            row[f"{v}_gib"] = trace_activations(cfg, micro_batch, seq_len,
                                                torch.bfloat16).saved / 2**30
    rope = dataclasses.replace(cfg, pe="rope")
    row["rope_gib"] = trace_activations(rope, micro_batch, seq_len, torch.bfloat16).saved / 2**30
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "125m"],
                    help="whole-model steps on this machine (default: tiny 125m)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace-sizes", nargs="+", default=["350m", "1b"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    # As the trainer does on CPU (train.keep_freed_memory): freed buffers are reused rather
    # than returned to the OS and faulted in again on every call.
    kept = keep_freed_memory()
    out = {"keep_freed_memory": kept, "args": vars(args) | {"json": str(args.json)}, "torch": torch.__version__,
           "threads": torch.get_num_threads()}

    print("1. the update alone, forward+backward (both tables; kept = bytes kept for the "
          "backward beyond E, Ê, y; E = one table's bytes)", flush=True)
    print(f"{'b':>2} {'N':>5} {'M':>3} {'D':>3} {'P':>3} {'plain us':>9} {'node us':>8} "
          f"{'ratio':>6} {'ops plain/node':>15} {'non-view':>10} {'kept plain/node (E)':>20}")
    out["update"] = []
    for b, n, m, d, p in ((1, 64, 16, 4, 64), (1, 1024, 16, 64, 64), (2, 1024, 12, 64, 48)):
        r = measure_update(b, n, m, d, p, dtype, args.rounds, 200 if n <= 64 else 5)
        out["update"].append(r)
        print(f"{b:2} {n:5} {m:3} {d:3} {p:3} {r['plain_us']:9.0f} {r['node_us']:8.0f} "
              f"{r['node_us'] / r['plain_us']:5.2f}x {r['plain_ops']:7}/{r['node_ops']:<7} "
              f"{r['plain_compute_ops']:4}/{r['node_compute_ops']:<5} "
              f"{r['plain_kept_bytes'] / r['e_bytes']:9.2f}/{r['node_kept_bytes'] / r['e_bytes']:.2f}",
              flush=True)

    print(f"\n2. whole TAPE models, one training step (forward+backward), "
          f"N={args.seq_len}, micro-batch {args.micro_batch}, {args.dtype}", flush=True)
    out["model"] = []
    for size in args.sizes:
        r = measure_model(size, args.seq_len, args.micro_batch, dtype, args.rounds)
        out["model"].append(r)
        print(f"{size:6} plain {r['plain_s']:.3f} s  node {r['node_s']:.3f} s  "
              f"{r['node_s'] / r['plain_s']:.2f}x  loss {r['plain_loss']:.6f} / "
              f"{r['node_loss']:.6f}", flush=True)

    print("\n3. activations kept for the backward (meta-device trace), bf16, N=2048", flush=True)
    out["trace"] = []
    for size in args.trace_sizes:
        for mb in (8, 16):
            r = measure_trace(size, mb, 2048)
            out["trace"].append(r)
            print(f"{size:5} micro-batch {mb:2}: TAPE plain {r['plain_gib']:6.2f} GiB, node "
                  f"{r['node_gib']:6.2f} GiB; RoPE {r['rope_gib']:6.2f} GiB "
                  f"(TAPE/RoPE {r['plain_gib'] / r['rope_gib']:.2f} -> "
                  f"{r['node_gib'] / r['rope_gib']:.2f})", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
