"""``tape-generate``: sample text from an exported model or a checkpoint, streaming tokens.

One prompt (``--prompt TEXT`` or ``--prompt-file PATH``) streams its continuation to stdout;
many (``--prompts PATH.jsonl``) are decoded one after the other into a JSONL file (``--out``),
written atomically, with a progress line per completion on stderr. See
``tape_train.inference.prompts`` for the formats and the seeding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tape_train.hints import example_on_missing


class StreamPrinter:
    """Prints the decoded continuation of ``context`` (the prompt's ids) as it grows
    (sentencepiece joins pieces with spaces that only the full decode gets right, so decode
    the whole suffix after the prompt and print the delta).

    A character that byte-fallback pieces spell one byte at a time decodes as U+FFFD until
    its last byte arrives, so trailing U+FFFD is held back (printing it would leave the text
    that follows never matching what was printed); :meth:`finish` prints what is left."""

    def __init__(self, tokenizer, context: list[int], out=None) -> None:
        self.tokenizer, self.out = tokenizer, out or sys.stdout  # stdout as it is now
        self.context = context
        self.ids: list[int] = []
        self.printed = ""

    def _write(self, text: str) -> None:
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def __call__(self, new_ids) -> None:
        self.ids.append(int(new_ids[0]))
        self._write(self.tokenizer.decode_continuation(self.context, self.ids).rstrip("\ufffd"))

    def finish(self) -> None:
        """Print the held-back end (bytes no later piece completed)."""
        self._write(self.tokenizer.decode_continuation(self.context, self.ids))


def _generate_many(model, tokenizer, prompts, args, device) -> int:
    """``--prompts``: each prompt decoded alone (no padding), a JSON line per completion in
    the order of the input; a progress line per completion on stderr. A file ``--out`` is
    written beside itself and renamed into place only when every prompt is done, so a run
    stopped half-way leaves the old file (or none), never a part that looks complete."""
    import torch

    from tape_train.files import FileWriteError, atomic_path
    from tape_train.inference.prompts import output_line, sample_seed

    total = len(prompts) * args.num_samples
    done = 0

    def run(out) -> None:
        nonlocal done
        for prompt in prompts:
            prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt.text)]
            for sample in range(args.num_samples):
                start = time.monotonic()
                seed = sample_seed(args.seed, prompt.text, sample)
                ids = model.generate(
                    torch.tensor([prompt_ids], device=device), args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    eos_id=tokenizer.eos_id,
                    generator=torch.Generator(device=device).manual_seed(seed),
                    vocab_size=tokenizer.vocab_size)[0, len(prompt_ids):].tolist()
                finish = "eos" if ids and ids[-1] == tokenizer.eos_id else "length"
                ids = ids[:-1] if finish == "eos" else ids
                text = tokenizer.decode_continuation(prompt_ids[1:], ids)
                out.write(output_line(prompt.record, text, len(ids), finish,
                                      sample if args.num_samples > 1 else None))
                out.flush()
                done += 1
                what = f" sample {sample}" if args.num_samples > 1 else ""
                print(f"tape-generate: {done}/{total} {prompt.where}{what}: {len(ids)} new "
                      f"tokens, {finish}, {time.monotonic() - start:.1f} s",
                      file=sys.stderr, flush=True)

    # The sampling stream is the device's, as for one prompt.
    try:
        if args.out == "-":
            run(sys.stdout)
        else:
            with atomic_path(args.out) as tmp, open(tmp, "w", encoding="utf-8") as fh:
                run(fh)
    except KeyboardInterrupt:
        kept = "" if args.out == "-" else f"; {args.out} not written"
        print(f"tape-generate: interrupted after {done}/{total} completions{kept}",
              file=sys.stderr)
        return 130
    except FileWriteError as exc:
        print(f"tape-generate: error: {exc}", file=sys.stderr)
        return 1
    where = "standard output" if args.out == "-" else args.out
    print(f"tape-generate: wrote {total} completions of {len(prompts)} prompts to {where}",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tape-generate",
                                     description="Generate text with the KV cache.")
    parser.add_argument("model", help="export directory, run dir or checkpoint tag dir")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--prompt-file", metavar="PATH",
                        help="continue the text of this UTF-8 file (all of it, a final newline "
                             "included); - reads standard input")
    source.add_argument("--prompts", metavar="PATH.jsonl",
                        help='many prompts: one JSON object per line with a "prompt" string '
                             "(other keys are copied to the output); needs --out")
    parser.add_argument("--out", metavar="PATH.jsonl",
                        help="with --prompts: write a JSON line per completion here (the input "
                             'object plus "completion", "new_tokens", "finish"), replacing the '
                             "file only once every prompt is done; - = standard output")
    parser.add_argument("--num-samples", type=int, default=1, metavar="K",
                        help="with --prompts: K completions of each prompt, each line with its "
                             '"sample" number 0..K-1 when K > 1 (default: %(default)s)')
    parser.add_argument("--max-new-tokens", type=int, default=100,
                        help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature, 0 = greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample from the k most likely tokens, 0 = no limit (default: "
                             "no limit)")
    parser.add_argument("--top-p", type=float, default=0.95,
                        help="nucleus sampling: the smallest set of tokens with this total "
                             "probability (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampling, 0 to 2**32 - 1 (default: %(default)s)")
    parser.add_argument("--tokenizer", help="sentencepiece .model (default: the model's own; "
                                            "another than the model's own is refused)")
    parser.add_argument("--allow-other-tokenizer", action="store_true",
                        help="decode with a --tokenizer other than the model's own")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to decode: auto (the GPU at LOCAL_RANK, default 0, where "
                             "CUDA is available, else the CPU), cpu or cuda")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="compute dtype (default: auto: bf16 where the device has fast "
                             "native bf16 -- on a CPU, where bf16 matrix products are fast "
                             "here -- else fp32)")
    example_on_missing(parser, 'tape-generate exports/demo --prompt "The Python interpreter"')
    args = parser.parse_args(argv)
    if args.prompt is None and args.prompt_file is None and args.prompts is None:
        parser.error("the following arguments are required: one of --prompt, --prompt-file, "
                     "--prompts")
    if args.prompts is None:
        for flag, given in (("--out", args.out is not None),
                            ("--num-samples", args.num_samples != 1)):
            if given:
                parser.error(f"{flag} is for --prompts (one prompt streams to standard output)")
    elif args.out is None:
        parser.error("--prompts needs --out PATH.jsonl (or --out - for standard output)")

    import torch

    from tape_train.data import TokenizerError, load_model_tokenizer, load_tokenizer
    from tape_train.devices import DeviceError, launch_int, pick_device
    from tape_train.hints import seed_error, utf8_error
    from tape_train.inference import prompts as prompt_files
    from tape_train.inference.loading import load_for_inference
    from tape_train.model.generate import check_sampling
    from tape_train.precision import resolve_dtype

    try:  # the options first: nothing is loaded for a run that cannot sample
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                       name=lambda key: "--" + key.replace("_", "-"))
        problem = utf8_error("--prompt", args.prompt) or seed_error("--seed", args.seed)
        if problem:  # bytes of another encoding in argv; the seed: the range of train.seed
            raise ValueError(problem)
        if args.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
        if args.prompt_file is not None:
            args.prompt = prompt_files.read_prompt_file(args.prompt_file)
        many = None
        if args.prompts is not None:
            many = prompt_files.read_prompts(args.prompts)
            prompt_files.check_out(args.out, args.prompts)
        if args.tokenizer:
            load_tokenizer(args.tokenizer)
        device = pick_device(args.device, launch_int("LOCAL_RANK"), "--device")
    except (ValueError, DeviceError) as exc:  # a bad --tokenizer (TokenizerError) included
        print(f"tape-generate: error: {exc}", file=sys.stderr)
        return 1
    if device.type == "cpu":  # a thread per core is the slowest choice beside other work
        from tape_train.cpu_threads import adopt_torch_threads

        adopt_torch_threads(1, lambda level, text: print(f"tape-generate: {text}",
                                                         file=sys.stderr))
    precision = resolve_dtype(args.dtype, device.type)
    if precision.warning:
        print(f"tape-generate: {precision.warning}", file=sys.stderr)
    try:
        model, tok_path, meta = load_for_inference(args.model, dtype=precision.torch_dtype)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"tape-generate: error: {exc}", file=sys.stderr)
        return 1
    own_tokenizer, tok_path = tok_path, args.tokenizer or tok_path
    if tok_path is None:
        print("tape-generate: error: no tokenizer bundled with the model; pass --tokenizer",
              file=sys.stderr)
        return 1
    try:
        tokenizer = load_model_tokenizer(tok_path, model.cfg.vocab_size)
        why = _other_tokenizer(tokenizer, meta, own_tokenizer if args.tokenizer else None)
        if why and not args.allow_other_tokenizer:
            fix = ("leave --tokenizer out" if args.tokenizer and own_tokenizer
                   else "pass the run's tokenizer with --tokenizer")
            raise TokenizerError(f"{why}; {fix}, or pass --allow-other-tokenizer to decode "
                                 f"with it anyway")
        if why:
            print(f"tape-generate: warning: {why}; --allow-other-tokenizer: decoding with it "
                  f"anyway", file=sys.stderr)
    except TokenizerError as exc:
        print(f"tape-generate: error: {exc}", file=sys.stderr)
        return 1
    model.to(device)
    if many is not None:
        return _generate_many(model, tokenizer, many, args, device)
    ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(args.prompt)]], device=device)
    sys.stdout.write(args.prompt)
    # The sampling stream is the device's: the same seed samples the same text on the same
    # kind of device, not across CPU and GPU.
    printer = StreamPrinter(tokenizer, ids[0, 1:].tolist())
    model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, eos_id=tokenizer.eos_id,
                   generator=torch.Generator(device=device).manual_seed(args.seed),
                   on_token=printer, vocab_size=tokenizer.vocab_size)
    printer.finish()
    sys.stdout.write("\n")
    return 0


def _other_tokenizer(tokenizer, meta: dict, own: str | None) -> str | None:
    """Why ``tokenizer`` is not the model's own, or None: for a training checkpoint the sha256
    its run recorded (``loading.other_tokenizer``: a ``data.tokenizer`` retrained since too);
    for an export, with ``own`` (its bundled tokenizer, where --tokenizer replaces it), that
    file's. An own tokenizer that cannot be read is nothing to compare, with a warning."""
    from tape_train.data import TokenizerError, load_tokenizer
    from tape_train.loading import other_tokenizer, tokenizer_mismatch

    if meta.get("tag_dir"):
        return other_tokenizer(Path(meta["tag_dir"]), meta, tokenizer)
    if not own or not Path(own).is_file():
        return None
    try:
        expected = load_tokenizer(own).sha256
    except TokenizerError as exc:
        print(f"tape-generate: warning: the model's own tokenizer cannot be read ({exc}): "
              f"--tokenizer is not compared with it", file=sys.stderr)
        return None
    return tokenizer_mismatch(tokenizer, expected, f"the model's own, {own}")


if __name__ == "__main__":
    sys.exit(main())
