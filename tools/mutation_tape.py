"""Mutation run over the TAPE math: does the test suite catch plausible single-edit bugs?

Each mutant (tools/mutants_tape.yaml) is one textual edit of one file (model/pe/tape.py, the
decoder block's E update in model/transformer.py, the modulation and attention around it,
kernels/reference.py, and the second implementation in the Hugging Face remote code,
inference/hf_remote/modeling_tape.py). For each,
the repository's ``tape_train/`` and ``tests/`` are copied to a scratch directory, the edit is
applied there (never to the working tree), and the TAPE tests run against the copy with ``-x``.
A mutant is *killed* when a test fails, *survives* when all pass. Survivors must be shown
equivalent in docs/mutation.md.

    python tools/mutation_tape.py                  # all mutants, a Markdown table on stdout
    python tools/mutation_tape.py --only M03 M07   # a subset
    python tools/mutation_tape.py --list           # what would be run

The unmutated copy is run first: if it fails, nothing is reported (a red suite kills all).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Fast, discriminating tests first (-x stops at the first failure).
TESTS = ["tests/test_model_tape_reference.py", "tests/test_model_tape.py",
         "tests/test_tape_update.py", "tests/test_model_encodings.py",
         "tests/test_model_backends.py", "tests/test_model_cleanroom.py",
         "tests/test_hf_export.py", "tests/test_export.py"]


@dataclass(frozen=True)
class Mutant:
    key: str
    path: str
    old: str
    new: str
    what: str


MUTANTS_FILE = Path(__file__).with_name("mutants_tape.yaml")


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    """The mutant table (a YAML list of {key, file, what, old, new})."""
    import yaml

    return [Mutant(m["key"], m["file"], m["old"], m["new"], m["what"])
            for m in yaml.safe_load(path.read_text())]


def copy_tree(dest: Path) -> None:
    for name in ("tape_train", "tests", "configs"):  # configs: named model sizes
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def run_tests(copy: Path, tests: list[str], timeout: int) -> tuple[str, str, float]:
    """('killed' | 'survived' | 'timeout', first failing test or '', seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *tests, "-x", "-q",
                               "-p", "no:cacheprovider", "-m", "not slow"],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.monotonic() - start
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "survived", "", seconds
    failed = next((line.split()[1] for line in proc.stdout.splitlines()
                   if line.startswith(("FAILED", "ERROR"))), f"exit {proc.returncode}")
    return "killed", failed, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant keys (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    parser.add_argument("--tests", nargs="*", default=TESTS)
    args = parser.parse_args(argv)
    all_mutants = load_mutants()
    mutants = [m for m in all_mutants if not args.only or m.key in args.only]
    if args.only and len(mutants) != len(args.only):
        known = [m.key for m in all_mutants]
        parser.error(f"unknown mutant key(s) {sorted(set(args.only) - set(known))}")
    for m in all_mutants:  # every edit must still apply: a stale mutant would "survive" silently
        count = (ROOT / m.path).read_text().count(m.old)
        if count != 1:
            print(f"error: {m.key}: the text to mutate occurs {count} times in {m.path}; "
                  f"update {MUTANTS_FILE.name}", file=sys.stderr)
            return 2
    if args.list:
        for m in mutants:
            print(f"{m.key}  {m.path:34} {m.what}")
        return 0
    with tempfile.TemporaryDirectory(prefix="tape-mutation-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        status, failed, seconds = run_tests(copy, args.tests, args.timeout)
        if status != "survived":
            print(f"error: the unmutated tests do not pass ({status}: {failed}); fix them first",
                  file=sys.stderr)
            return 2
        print(f"unmutated: all pass in {seconds:.0f} s", file=sys.stderr)
        print("| mutant | file | edit | result | first failing test | s |")
        print("|---|---|---|---|---|---|")
        survivors = 0
        for m in mutants:
            target = copy / m.path
            original = target.read_text()
            target.write_text(original.replace(m.old, m.new, 1))
            try:
                status, failed, seconds = run_tests(copy, args.tests, args.timeout)
            finally:
                target.write_text(original)
            survivors += status != "killed"
            print(f"| {m.key} | {m.path.removeprefix('tape_train/')} | {m.what} | {status} | "
                  f"{failed.replace('|', '/')} | {seconds:.0f} |", flush=True)
        print(f"\n{len(mutants) - survivors} of {len(mutants)} mutants killed, "
              f"{survivors} survived", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
