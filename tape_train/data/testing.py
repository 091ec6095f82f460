"""Real text available offline on any machine with Python, and tiny corpora built from it.

Used by the tests and the throughput benchmark: documents are paragraphs of the Python
standard library's own source files (plus ``/usr/share/common-licenses`` on Debian), so
tokenizer and pipeline are exercised on genuine prose and code, without network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tape_train.data.tokenizer import Tokenizer, TokenizerTrainSpec, train_tokenizer

_STDLIB = Path(os.__file__).resolve().parent
_STDLIB_MODULES = ("argparse.py", "dataclasses.py", "difflib.py", "functools.py",
                   "inspect.py", "json/decoder.py", "logging/__init__.py", "pathlib.py",
                   "random.py", "statistics.py", "textwrap.py", "typing.py", "zipfile.py")


def _module_files(stdlib: Path, name: str) -> list[Path]:
    """The file of module ``name`` (``pathlib.py``), or where a newer Python made it a
    package (``pathlib/``, ``zipfile/`` in 3.13), the package's ``.py`` files in sorted order;
    ``[]`` where neither is."""
    if (stdlib / name).is_file():
        return [stdlib / name]
    package = stdlib / name[:-len(".py")]
    if package.is_dir():
        return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    return []


def real_text_files(stdlib: Path = _STDLIB) -> list[Path]:
    files = [path for name in _STDLIB_MODULES for path in _module_files(stdlib, name)]
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        files += sorted(p for p in licenses.iterdir() if p.is_file() and not p.is_symlink())
    return files


def real_text_documents(max_documents: int | None = None) -> list[str]:
    """Paragraph-sized documents (split on blank lines, joined up to ~2 KB) of real text."""
    docs: list[str] = []
    for path in real_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        current = ""
        for paragraph in text.split("\n\n"):
            if not paragraph.strip():
                continue
            current = f"{current}\n\n{paragraph}" if current else paragraph
            if len(current) > 2000:
                docs.append(current)
                current = ""
        if current:
            docs.append(current)
    return docs[:max_documents] if max_documents else docs


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for text in texts:
            fh.write(json.dumps({field: text}) + "\n")
    return path


def train_small_tokenizer(out_dir: Path, vocab_size: int = 800, model_type: str = "bpe",
                          max_bytes: int | None = None) -> Tokenizer:
    """A small byte-fallback tokenizer trained on ``real_text_documents()`` (about 1 s)."""
    spec = TokenizerTrainSpec(vocab_size=vocab_size, model_type=model_type, num_threads=1,
                              max_bytes=max_bytes)
    return train_tokenizer(real_text_documents(), Path(out_dir) / f"small-{model_type}", spec)
