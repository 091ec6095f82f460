"""``tape-export``: consolidate a checkpoint of any layout into a self-contained directory."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("tape_train.export")
DTYPES = ("auto", "bf16", "fp16", "fp32")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tape-export",
        description="Export a training checkpoint (any dp/tp/sp layout, ZeRO stage) as "
                    "safetensors + config + tokenizer, loadable without DeepSpeed.")
    parser.add_argument("checkpoint", help="run dir (latest complete checkpoint) or tag dir")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights' dtype in the export (default: auto, the precision the run "
                             "trained in: its resolved train.dtype)")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face LlamaForCausalLM directory (pe=rope only)")
    parser.add_argument("--tokenizer", help="tokenizer .model to bundle (default: the run's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from tape_train.model.pretrained import save_hf_llama, save_pretrained
    from tape_train.train.checkpoint import CheckpointError, load_model_from_checkpoint

    try:
        cfg, state, meta = load_model_from_checkpoint(args.checkpoint)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"tape-export: {exc}", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer or (meta.get("config") or {}).get("data", {}).get("tokenizer")
    if tokenizer and not Path(tokenizer).is_file():
        log.warning("tokenizer %s not found; exporting without it", tokenizer)
        tokenizer = None
    provenance = {"source": str(Path(args.checkpoint).resolve()), "step": meta.get("step"),
                  "tokens_seen": meta.get("tokens_seen"), "code_version": meta.get("code_version")}
    dtype_name = args.dtype
    if dtype_name == "auto":  # a checkpoint of an `auto` run records the resolved value
        trained = ((meta.get("config") or {}).get("train") or {}).get("dtype")
        dtype_name = trained if trained in ("bf16", "fp32") else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    save = save_hf_llama if args.hf else save_pretrained
    try:
        out = save(state, cfg, args.out, dtype=dtype, tokenizer=tokenizer,
                   provenance=provenance)
    except ValueError as exc:
        print(f"tape-export: {exc}", file=sys.stderr)
        return 2
    n_params = sum(v.numel() for v in state.values())
    log.info("exported %s (step %s, %.2fM parameters, %s) to %s", cfg.pe, meta.get("step"),
             n_params / 1e6, dtype_name, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
