"""``tape-export``: consolidate a checkpoint of any layout into a self-contained directory.

Without ``--hf`` the directory is tape-train's own (``tape_train.model.from_pretrained``);
with ``--hf`` it loads in ``transformers`` (``tape_train.inference.hf_export``). Both carry the
sentencepiece model and the Hugging Face tokenizer files when the run's tokenizer is known.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tape_train.hints import example_on_missing
from tape_train.progress import setup_cli_logging

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
                        help="write a Hugging Face directory: LlamaForCausalLM for pe=rope, "
                             "remote code (trust_remote_code=True) for every other encoding")
    parser.add_argument("--tokenizer", help="tokenizer .model to bundle (default: the run's); "
                                            "one that is not the tokenizer the run trained "
                                            "with (its sha256, recorded in the checkpoint) is "
                                            "refused")
    parser.add_argument("--allow-other-tokenizer", action="store_true",
                        help="bundle a tokenizer other than the one the run trained with")
    example_on_missing(parser, "tape-export runs/demo --out exports/demo")
    args = parser.parse_args(argv)
    setup_cli_logging()

    import torch

    from tape_train.data import TokenizerError, load_model_tokenizer, load_tokenizer
    from tape_train.files import human_bytes
    from tape_train.inference.hf_export import save_hf, write_tokenizer_files
    from tape_train.inference.hf_tokenizer import unsupported
    from tape_train.checkpoint_layout import read_marker, resolve_checkpoint, with_run_paths
    from tape_train.loading import CheckpointError, load_model_from_checkpoint
    from tape_train.model.pretrained import check_export_target, save_pretrained

    try:  # what can be checked before the (possibly long) consolidation
        check_export_target(args.out)
        given = load_tokenizer(args.tokenizer) if args.tokenizer else None
        if given is not None:
            problem = unsupported(args.tokenizer) if args.hf else None
            if problem:
                raise TokenizerError(f"{problem}; --hf needs them (a plain export, without "
                                     f"--hf, bundles the tokenizer.model alone)")
        tag_dir = resolve_checkpoint(args.checkpoint)  # verified: its checksums read back
        marker = with_run_paths(read_marker(tag_dir), tag_dir)
        own = ((marker.get("config") or {}).get("data") or {}).get("tokenizer")
        # Before the (possibly long) consolidation: the tokenizer to bundle is the run's.
        if given is not None:
            _check_trained_tokenizer(tag_dir, marker, given, args.allow_other_tokenizer)
        elif own and Path(own).is_file():  # the run's own path: retrained since?
            try:
                own_tokenizer = load_tokenizer(own)
            except TokenizerError as exc:
                raise TokenizerError(f"{exc} (bundle another with --tokenizer)") from None
            _check_trained_tokenizer(tag_dir, marker, own_tokenizer, args.allow_other_tokenizer)
        cfg, state, meta = load_model_from_checkpoint(tag_dir, verify=False)
    except (CheckpointError, OSError, ValueError) as exc:  # a bad --tokenizer included
        named = isinstance(exc, TokenizerError) and args.tokenizer
        print(f"tape-export: error: {'--tokenizer: ' if named else ''}{exc}",
              file=sys.stderr)
        return 1
    tokenizer = args.tokenizer or (meta.get("config") or {}).get("data", {}).get("tokenizer")
    if tokenizer and not args.tokenizer and not Path(tokenizer).is_file():
        # The run's own tokenizer may live elsewhere by now; one asked for by name may not.
        log.warning("tokenizer %s not found; exporting without it (bundle one with "
                    "--tokenizer)", tokenizer)
        tokenizer = None
    if tokenizer:
        try:
            load_model_tokenizer(tokenizer, cfg.vocab_size)
        except ValueError as exc:
            print(f"tape-export: error: --tokenizer: {exc}" if args.tokenizer else
                  f"tape-export: error: {exc} (bundle another with --tokenizer)", file=sys.stderr)
            return 1
    problem = unsupported(tokenizer) if tokenizer else None
    if problem and args.hf:  # the run's own tokenizer (a --tokenizer was checked above)
        print(f"tape-export: error: {problem}; --hf needs them (export without --hf, or "
              f"bundle another with --tokenizer)", file=sys.stderr)
        return 1
    if problem:
        log.warning("%s: the export carries tokenizer.model without the Hugging Face "
                    "tokenizer files", problem)
    provenance = {"source": str(Path(args.checkpoint).resolve()), "step": meta.get("step"),
                  "tokens_seen": meta.get("tokens_seen"), "code_version": meta.get("code_version")}
    dtype_name = args.dtype
    if dtype_name == "auto":  # a checkpoint of an `auto` run records the resolved value
        trained = ((meta.get("config") or {}).get("train") or {}).get("dtype")
        dtype_name = trained if trained in ("bf16", "fp32") else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    n_params = sum(v.numel() for v in state.values())
    log.info("writing %s (%s, %.2fM parameters in %s, %s)", args.out,
             "Hugging Face" if args.hf else "save_pretrained", n_params / 1e6, dtype_name,
             human_bytes(n_params * dtype.itemsize))
    try:
        if args.hf:
            out = save_hf(state, cfg, args.out, dtype=dtype, tokenizer=tokenizer,
                          provenance=provenance)
        else:
            out = save_pretrained(state, cfg, args.out, dtype=dtype, tokenizer=tokenizer,
                                  provenance=provenance,
                                  extra=lambda d: write_tokenizer_files(
                                      d, None if problem else tokenizer, cfg))
    except ValueError as exc:
        print(f"tape-export: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # disk full, permissions: name the path (the old export is kept)
        from tape_train.files import describe_os_error

        print(f"tape-export: error: "
              f"{describe_os_error(exc, args.out, needed=n_params * dtype.itemsize)}",
              file=sys.stderr)
        return 1
    log.info("exported %s (step %s, %.2fM parameters, %s) to %s", cfg.pe, meta.get("step"),
             n_params / 1e6, dtype_name, out)
    return 0


def _check_trained_tokenizer(tag_dir: Path, meta: dict, tokenizer, allow: bool) -> None:
    """A tokenizer other than the run's (``loading.other_tokenizer``) is refused, or with
    ``allow`` bundled after a warning."""
    from tape_train.loading import other_tokenizer

    why = other_tokenizer(tag_dir, meta, tokenizer)
    if why is None:
        return
    if not allow:
        raise ValueError(f"{why}; bundle the run's tokenizer with --tokenizer, or pass "
                         f"--allow-other-tokenizer to bundle this one anyway")
    log.warning("%s; --allow-other-tokenizer: bundling it anyway", why)


if __name__ == "__main__":
    sys.exit(main())
