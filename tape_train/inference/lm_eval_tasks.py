"""Local lm-evaluation-harness tasks over a run's held-out documents.

    python -m tape_train.inference.lm_eval_tasks --data demo --out lm_eval_tasks \\
        [--max-documents 200] [--context-chars 400] [--continuation-chars 200]
    lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True,dtype=float32,\\
        max_length=1024 --include_path lm_eval_tasks --tasks tape_heldout,tape_continuation_mc

Writes ``heldout.jsonl`` ({"text"} per held-out document, the ones tape-eval scores, in the
same order), ``continuation_mc.jsonl`` ({"context", "choices", "label"}: a document's start,
its own continuation and three from other documents) and the shipped task YAMLs
(``configs/lm_eval/``) pointing at them by absolute path.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import yaml

from tape_train.resources import resource_dir

TASKS = {"tape_heldout.yaml": "heldout.jsonl",
         "tape_continuation_mc.yaml": "continuation_mc.jsonl"}


def held_out_texts(data: str, max_documents: int | None) -> list[str]:
    """Texts of the held-out documents of a data config (a name such as ``demo`` or a YAML
    path), in tape-eval's order."""
    from tape_train.data.config import load_data_config
    from tape_train.data.formats import SkipLog
    from tape_train.data.sources import iter_held_out_texts

    cfg = load_data_config(data)
    texts = []
    for text in iter_held_out_texts(cfg.sources, cfg.eval_sources, cfg.eval_fraction,
                                    cfg.skip_bad_records, SkipLog()):
        if max_documents is not None and len(texts) >= max_documents:
            break
        texts.append(text)
    return texts


def continuation_items(texts: list[str], context_chars: int, continuation_chars: int,
                       choices: int = 4, seed: int = 0) -> list[dict]:
    """Multiple-choice items: each long-enough document's first ``context_chars`` characters
    (cut at a space) and ``choices`` continuations, the true one at a random index."""
    rng = random.Random(seed)
    splits = []
    for text in texts:
        cut = text.rfind(" ", 0, context_chars)
        if cut <= 0 or len(text) < cut + continuation_chars:
            continue
        splits.append((text[:cut], text[cut:cut + continuation_chars]))
    if len(splits) < choices:
        raise ValueError(f"only {len(splits)} documents are longer than "
                         f"{context_chars + continuation_chars} characters; need {choices}")
    items = []
    for i, (context, truth) in enumerate(splits):
        others = rng.sample([j for j in range(len(splits)) if j != i], choices - 1)
        options = [splits[j][1] for j in others]
        label = rng.randrange(choices)
        options.insert(label, truth)
        items.append({"context": context, "choices": options, "label": label})
    return items


def write_tasks(out_dir: str | Path, texts: list[str], context_chars: int = 400,
                continuation_chars: int = 200) -> Path:
    """Write both datasets and task YAMLs into ``out_dir`` (an lm-eval ``--include_path``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "heldout.jsonl", [{"text": t} for t in texts])
    _write_jsonl(out / "continuation_mc.jsonl",
                 continuation_items(texts, context_chars, continuation_chars))
    for name, data_file in TASKS.items():
        task = yaml.safe_load((resource_dir("configs/lm_eval") / name).read_text())
        task["dataset_kwargs"]["data_files"]["test"] = str((out / data_file).resolve())
        (out / name).write_text(yaml.safe_dump(task, sort_keys=False))
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tape_train.inference.lm_eval_tasks",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True,
                   help="data config: a shipped name (demo) or a YAML path; its held-out "
                        "documents are the ones tape-eval scores")
    p.add_argument("--out", required=True, help="directory to pass to lm_eval --include_path")
    p.add_argument("--max-documents", type=int, default=None,
                   help="held-out documents to use at most (default: all)")
    p.add_argument("--context-chars", type=int, default=400,
                   help="multiple choice: characters of a document given as context "
                        "(default: %(default)s)")
    p.add_argument("--continuation-chars", type=int, default=200,
                   help="multiple choice: characters of each continuation (default: %(default)s)")
    args = p.parse_args(argv)
    from tape_train.data.config import DataError

    try:
        texts = held_out_texts(args.data, args.max_documents)
        out = write_tasks(args.out, texts, args.context_chars, args.continuation_chars)
    except (DataError, ValueError, FileNotFoundError) as exc:
        print(f"lm_eval_tasks: {exc}", file=sys.stderr)
        return 1
    print(f"lm_eval_tasks: {len(texts)} held-out documents -> {out} "
          f"(tasks: {', '.join(n.removesuffix('.yaml') for n in TASKS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
