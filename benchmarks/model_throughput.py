"""Forward+backward throughput of every positional encoding, and TAPE's memory vs RoPE's.

One run measures all encodings side by side (interleaved repetitions, best-of), so the
TAPE/RoPE ratio is comparable even on a noisy machine. For each shape and N it prints
tokens/s per encoding, the measured TAPE/RoPE throughput ratio, and the ratio the FLOP model
predicts (RoPE FLOPs / TAPE FLOPs); the target is measured ≥ 0.95 × predicted.

Memory, TAPE vs RoPE at N=1024: the bytes of activations saved for backward in one training
step (exact, counted with ``saved_tensors_hooks`` over unique storages), and the step's peak
by accounting (those activations + weights, gradients and AdamW moments in fp32).

    python benchmarks/model_throughput.py                       # tiny + 125m, N 256 1024 2048
    python benchmarks/model_throughput.py --shapes tiny --seq-lens 256 --out docs/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tape_train.model import POSITIONAL_ENCODINGS, TransformerLM, load_model_config
from tape_train.model.config import ATTENTION_BACKENDS
from tape_train.model.flops import training_flops_per_token
from tape_train.files import write_atomic
from tape_train.host_memory import keep_freed_memory
from tape_train.train.memory import saved_for_backward


def make_model(shape: str, pe: str, dtype: torch.dtype, backend: str) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(load_model_config(shape, pe=pe, attn_backend=backend)).to(dtype)


def train_step(model: TransformerLM, ids: torch.Tensor) -> None:
    out = model(ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def throughput(shape: str, seq_len: int, tokens_per_step: int, reps: int, dtype,
               encodings: list[str], backend: str) -> dict[str, float]:
    batch = max(1, tokens_per_step // seq_len)
    models = {pe: make_model(shape, pe, dtype, backend) for pe in encodings}
    ids = torch.randint(0, models[encodings[0]].cfg.vocab_size, (batch, seq_len))
    for model in models.values():  # warm-up
        train_step(model, ids)
    best = {pe: float("inf") for pe in encodings}
    for _ in range(reps):  # interleaved, so drifts in machine load hit every encoding alike
        for pe, model in models.items():
            start = time.perf_counter()
            train_step(model, ids)
            best[pe] = min(best[pe], time.perf_counter() - start)
    return {pe: batch * seq_len / t for pe, t in best.items()}


def saved_activation_bytes(shape: str, pe: str, seq_len: int, batch: int, dtype,
                           backend: str) -> int:
    model = make_model(shape, pe, dtype, backend)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, seq_len))
    out, saved = saved_for_backward(lambda: model(ids, labels=ids), exclude=model.parameters())
    out.loss.backward()
    return saved


def step_memory_bytes(shape: str, pe: str, saved: int) -> int:
    """Peak memory of an fp32 AdamW training step, by accounting: weights, gradients and the
    two Adam moments (4 × parameter bytes) plus the activations saved for backward (the
    largest live set, reached at the start of backward)."""
    from tape_train.model.flops import count_parameters

    return 4 * 4 * count_parameters(load_model_config(shape, pe=pe))["total"] + saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "125m"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024, 2048])
    parser.add_argument("--encodings", nargs="+", default=list(POSITIONAL_ENCODINGS))
    parser.add_argument("--tokens-per-step", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--memory-seq-len", type=int, default=1024)
    parser.add_argument("--backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="model.attn_backend for every encoding (default: auto, as training)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc malloc untuned (the trainer tunes it on CPU)")
    parser.add_argument("--out", default="docs/model_benchmark.json")
    args = parser.parse_args()
    tuned = False if args.default_malloc else keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"attn_backend={args.backend}, malloc {'tuned' if tuned else 'default'}")
    results = {"config": vars(args), "throughput": [], "memory": []}
    for shape in args.shapes:
        for n in args.seq_lens:
            tps = throughput(shape, n, args.tokens_per_step, args.reps, dtype, args.encodings,
                             args.backend)
            row = {"shape": shape, "seq_len": n, "tokens_per_s": tps}
            if "tape" in tps and "rope" in tps:
                measured = tps["tape"] / tps["rope"]
                batch = max(1, args.tokens_per_step // n)  # what throughput() ran
                predicted = (training_flops_per_token(load_model_config(shape, pe="rope"), n,
                                                      micro_batch=batch)
                             / training_flops_per_token(load_model_config(shape, pe="tape"), n,
                                                        micro_batch=batch))
                row.update(measured_ratio=measured, predicted_ratio=predicted,
                           ratio_of_ratios=measured / predicted)
            results["throughput"].append(row)
            cells = "  ".join(f"{pe} {v:8.0f}" for pe, v in tps.items())
            extra = (f"  | TAPE/RoPE measured {row['measured_ratio']:.3f} predicted "
                     f"{row['predicted_ratio']:.3f} -> {row['ratio_of_ratios']:.3f}"
                     if "measured_ratio" in row else "")
            print(f"{shape:>5} N={n:<5} tok/s  {cells}{extra}", flush=True)
        batch = max(1, args.tokens_per_step // args.memory_seq_len)
        mem = {}
        for pe in ("rope", "tape"):
            saved = saved_activation_bytes(shape, pe, args.memory_seq_len, batch, dtype,
                                           args.backend)
            mem[pe] = {"saved_activations": saved,
                       "step_peak": step_memory_bytes(shape, pe, saved)}
        row = {"shape": shape, "seq_len": args.memory_seq_len, "batch": batch, **mem,
               "saved_ratio": mem["tape"]["saved_activations"] / mem["rope"]["saved_activations"],
               "step_ratio": mem["tape"]["step_peak"] / mem["rope"]["step_peak"]}
        results["memory"].append(row)
        mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
        print(f"{shape:>5} N={args.memory_seq_len} b={batch} memory TAPE/RoPE: saved activations "
              f"{row['saved_ratio']:.3f} ({mib(mem['tape']['saved_activations'])} vs "
              f"{mib(mem['rope']['saved_activations'])}); training step "
              f"{row['step_ratio']:.3f} ({mib(mem['tape']['step_peak'])} vs "
              f"{mib(mem['rope']['step_peak'])})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
