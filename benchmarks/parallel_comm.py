"""Communication volume per training step for each parallel layout, measured vs analytic, and
the step time of SP=2 against one process at the same global batch.

    .venv/bin/python benchmarks/parallel_comm.py                      # default layouts, TAPE+RoPE
    .venv/bin/python benchmarks/parallel_comm.py --layouts sp2 tp2 --pe tape --steps 3

Every torch.distributed collective is wrapped (before DeepSpeed captures any of them) and its
payload counted per rank, tagged with the group it ran on (tp / sp / dp_sp / world). Payload
convention, per rank and call: all-reduce = tensor bytes; all-to-all = send-buffer bytes;
all-gather = gathered (output) bytes; reduce-scatter = input bytes. Wire traffic is (g−1)/g of
that for all-to-all / all-gather / reduce-scatter and 2(g−1)/g for a ring all-reduce.

Analytic counts (per rank, per optimizer step, fwd+bwd; b rows per DP rank, n = N/sp tokens
per rank, C hidden, L layers, e bytes per element, u = b·n·C·e). TAPE's last block carries no
state (its E is discarded), so its attention is RoPE-like: value width D, no Ê.
  Ulysses all-to-all (sp)     2 (fwd+bwd) · u/tp · [in + out widths in units of D]
                              TAPE: (L−1)·(5+3) + 1·(3+1);  RoPE: L·(3+1)
  AutoTP all-reduce (tp)      L · 7 · u     (fwd: o, down; bwd: ∂x of q, k, v, gate, up)
  TAPE state all-gather (tp)  4·(L−1) · u   (fwd: Ê of the L−1 state-carrying blocks, both
                              tables in one call; bwd: ∂E⁰, ∂E¹ of blocks 1…L−1 — layer
                              0's tables carry no gradient)
ZeRO-3's own parameter all-gathers / gradient reduce-scatters over the dp×sp group are listed
as measured (they depend on bucketing, prefetch and persistence thresholds, not on this package).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {  # name: (world, sp, tp)
    "single": (1, 1, 1), "sp2": (2, 2, 1), "tp2": (2, 1, 2), "dp2_sp2": (4, 2, 1),
    "tp2_sp2": (4, 2, 2),
}
MODEL = dict(vocab_size=256, hidden_size=256, num_layers=2, num_heads=8, intermediate_size=512,
             tape_position_size=16, max_seq_len=4096, attn_backend="sdpa")
_OPS = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor",
        "reduce_scatter_tensor", "broadcast")


class CommCounter:
    """Wraps torch.distributed collectives and sums payload bytes per (op, group tag)."""

    def __init__(self) -> None:
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)
        self.tags: dict = {}        # id(group) -> tag
        self.rank_tags: dict = {}   # group ranks -> tag (DeepSpeed builds its own groups)
        self.active = False

    def install(self) -> None:
        import torch.distributed as dist

        for op in _OPS:
            original = getattr(dist, op)
            setattr(dist, op, self._wrap(op, original))

    def _wrap(self, op, original):
        def counted(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                if group is None and op in ("all_reduce", "broadcast") and len(args) > 2:
                    group = args[2]
                self._count(op, args, kwargs, group)
            return original(*args, **kwargs)

        return counted

    def _tag(self, group) -> str:
        if group is None:
            return "world"
        if id(group) not in self.tags:
            import torch.distributed as dist

            ranks = tuple(dist.get_process_group_ranks(group))
            default = "self" if len(ranks) == 1 else f"ranks{list(ranks)}"
            self.tags[id(group)] = (default if len(ranks) == 1
                                    else self.rank_tags.get(ranks, default))
        return self.tags[id(group)]

    def _count(self, op, args, kwargs, group) -> None:
        first = args[0] if args else next(iter(kwargs.values()))
        if op in ("all_gather",):
            payload = sum(t.numel() * t.element_size() for t in first)  # output list
        elif op == "all_to_all_single":
            src = args[1] if len(args) > 1 else kwargs["input"]
            payload = src.numel() * src.element_size()
        elif op == "reduce_scatter_tensor":
            src = args[1] if len(args) > 1 else kwargs["input"]
            payload = src.numel() * src.element_size()
        else:  # all_reduce, broadcast: the tensor; all_gather_into_tensor: the output
            payload = first.numel() * first.element_size()
        tag = self._tag(group)
        self.bytes[(op, tag)] += payload
        self.calls[(op, tag)] += 1


def analytic(pe: str, world: int, sp: int, tp: int, rows: int, seq: int) -> dict:
    """Bytes per rank and step, keyed like the measurement: (op, group tag)."""
    e, c, layers = 4, MODEL["hidden_size"], MODEL["num_layers"]
    dp = world // (sp * tp)
    u = (rows // dp) * (seq // sp) * c * e
    out = {}
    if sp > 1:
        widths = (layers - 1) * (5 + 3) + (3 + 1) if pe == "tape" else layers * (3 + 1)
        out[("all_to_all_single", "sp")] = 2 * widths * u // tp
    if tp > 1:
        out[("all_reduce", "tp")] = layers * 7 * u
        if pe == "tape":
            out[("all_gather", "tp")] = 4 * (layers - 1) * u
    return out


def _worker(rank, world, sp, tp, pe, rows, seq, steps, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    counter = CommCounter()
    counter.install()  # before DeepSpeed captures function references
    import deepspeed

    from tape_train.model import ModelConfig, TransformerLM
    from tape_train.parallel import (RankGrid, deepspeed_config_updates, parallelize,
                                     verify_engine)
    from tape_train.train.engine import count_target_tokens, forward_backward

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    grid = RankGrid.from_sizes(world, sp=sp, tp=tp)
    grid.build()
    for tag in ("tp", "sp", "dp", "dp_sp"):  # our own groups, by identity
        if getattr(grid.groups, tag) is not None:
            counter.tags[id(getattr(grid.groups, tag))] = tag
    # DeepSpeed's own groups (AutoTP's TP group, its data-parallel group), by their ranks
    counter.rank_tags[tuple(grid.my_group_ranks("dp_sp"))] = "dp_sp"
    counter.rank_tags[tuple(grid.my_group_ranks("tp"))] = "tp"
    torch.manual_seed(0)
    model = parallelize(TransformerLM(ModelConfig(**MODEL, pe=pe)), grid)
    config = {"train_micro_batch_size_per_gpu": rows // grid.dp, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3}, **deepspeed_config_updates(grid)}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    verify_engine(engine, grid)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (rows, seq), generator=g)
    rows_here = slice(grid.dp_rank * (rows // grid.dp), (grid.dp_rank + 1) * (rows // grid.dp))
    batch = {"input_ids": ids[rows_here], "labels": torch.roll(ids, -1, 1)[rows_here]}
    global_tokens = count_target_tokens([{"labels": ids}])  # every label valid: rows × seq
    times = []
    for step in range(steps + 1):  # step 0 warms up (and runs AutoTP's one-off data check)
        counter.active = step > 0
        t0 = time.perf_counter()
        forward_backward(engine, [batch], grid=grid, global_tokens=global_tokens)
        if step > 0:
            times.append(time.perf_counter() - t0)
    counter.active = False
    result = {"bytes": {k: v / steps for k, v in counter.bytes.items()},
              "calls": {k: v / steps for k, v in counter.calls.items()},
              "step_s": sorted(times)[len(times) // 2]}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_layout(name, pe, rows, seq, steps, out_dir) -> dict:
    world, sp, tp = LAYOUTS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, sp, tp, pe, rows, seq, steps, port, out_dir),
                       nprocs=world, join=True, start_method="spawn")
    return torch.load(Path(out_dir) / "rank0.pt", weights_only=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--pe", nargs="+", default=["tape", "rope"])
    parser.add_argument("--rows", type=int, default=2, help="global batch rows (sequences)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length N")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after 1 warm-up)")
    args = parser.parse_args()
    import tempfile

    print(f"model {MODEL} | global batch {args.rows}×{args.seq} | fp32 ZeRO-3 | "
          f"{os.cpu_count()} CPU cores", flush=True)
    times = {}
    for pe in args.pe:
        print(f"\n== pe={pe}: bytes per rank per step (MB), rank 0 ==", flush=True)
        print(f"{'layout':10s} {'op':24s} {'group':6s} {'calls':>6s} {'measured':>10s} "
              f"{'analytic':>10s}", flush=True)
        for name in args.layouts:
            with tempfile.TemporaryDirectory() as tmp:
                res = run_layout(name, pe, args.rows, args.seq, args.steps, tmp)
            times[(pe, name)] = res["step_s"]
            expect = analytic(pe, *LAYOUTS[name], args.rows, args.seq)
            keys = sorted(set(res["bytes"]) | set(expect))
            for key in keys:
                measured = res["bytes"].get(key, 0) / 1e6
                want = expect.get(key)
                want_s = "—" if want is None else f"{want / 1e6:10.3f}"
                print(f"{name:10s} {key[0]:24s} {key[1]:6s} {res['calls'].get(key, 0):6.0f} "
                      f"{measured:10.3f} {want_s:>10s}", flush=True)
            if not keys:
                print(f"{name:10s} (no collectives)", flush=True)
    print("\n== step time (median of measured steps, s) ==")
    for pe in args.pe:
        row = "  ".join(f"{n}={times[(pe, n)]:.3f}" for n in args.layouts if (pe, n) in times)
        print(f"pe={pe}: {row}")
        if (pe, "single") in times and (pe, "sp2") in times:
            print(f"pe={pe}: SP=2 / 1 process step-time ratio = "
                  f"{times[(pe, 'sp2')] / times[(pe, 'single')]:.2f}")


if __name__ == "__main__":
    main()
