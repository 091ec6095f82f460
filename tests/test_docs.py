"""What the documentation tells a reader to type exists: every ``from tape_train... import``
in a Python block of README.md, tokenizer/README.md and docs/*.md names a real module and
real names; every flag the docs, the Makefile and launch/demo.sh pass to a console script is
one its --help lists; relative links point at files that exist."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "tokenizer" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# console script -> (module whose main() it runs, its subcommands)
CLIS = {
    "tape-model": ("tape_train.model.cli", ["info"]),
    "tape-tokenizer": ("tape_train.data.tokenizer_cli", ["train", "info"]),
    "tape-data": ("tape_train.data.cli", ["prepare", "info"]),
    "tape-train": ("tape_train.train.cli", []),
    "tape-eval": ("tape_train.eval.cli", []),
    "tape-submit": ("tape_train.cluster.submit", []),
    "tape-export": ("tape_train.inference.export", []),
    "tape-generate": ("tape_train.inference.generate", []),
}
IMPORT = re.compile(r"^from (tape_train[\w.]*) import (\([^)]*\)|[^\n#]*)", re.M)


def documented_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) of every ``from tape_train... import`` in the ```python blocks."""
    found = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        for module, names in IMPORT.findall(block):
            for name in names.strip("()").replace("\n", " ").split(","):
                if name.strip():
                    found.append((module, name.split(" as ")[0].strip()))
    return found


def unresolved(pairs: list[tuple[str, str]]) -> list[str]:
    missing = []
    for module, name in pairs:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    return missing


def test_every_documented_import_resolves():
    pairs = [p for doc in DOCS for p in documented_imports(doc.read_text())]
    assert len(pairs) > 20  # the docs do show the API
    assert ("tape_train.loading", "find_latest_complete") in pairs
    assert unresolved(pairs) == []


def test_the_import_check_sees_a_missing_name():
    text = ("```python\nfrom tape_train.loading import (load_model,\n    no_such_loader)\n"
            "from tape_train.nowhere import x\n```\n")
    assert unresolved(documented_imports(text)) == [
        "tape_train.loading.no_such_loader",
        "tape_train.nowhere: No module named 'tape_train.nowhere'"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(doc):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
    missing = [t for t in targets if not t.startswith(("http://", "https://"))
               and not (doc.parent / t).exists()]
    assert missing == []


def help_text(script: str, sub: str | None) -> str:
    module, _ = CLIS[script]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(module).main(([sub] if sub else []) + ["--help"])
    return out.getvalue()


def known_flags() -> dict[tuple[str, str | None], set[str]]:
    flags = {}
    for script, (_, subs) in CLIS.items():
        for sub in subs or [None]:
            flags[script, sub] = set(re.findall(r"--[a-z][a-z0-9-]*", help_text(script, sub)))
    return flags


def unknown_flags(text: str, flags) -> list[str]:
    """`script [sub] ... --flag` in a doc whose flag the script's --help does not list."""
    bad = []
    script_re = "|".join(map(re.escape, CLIS))
    for line in text.replace("\\\n", " ").splitlines():
        for m in re.finditer(rf"(?:^|[`\s$(\"/])({script_re})\b([^`|#\n]*)", line):
            script, rest = m.groups()
            subs = CLIS[script][1]
            words = rest.split()
            sub = words[0] if words and words[0] in subs else ("info" if script == "tape-model"
                                                               else None)
            known = flags.get((script, sub)) or set().union(
                *(v for k, v in flags.items() if k[0] == script))
            bad += [f"{script} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
                    if flag not in known | {"--help", "--version"}]
    return bad


@pytest.fixture(scope="module")
def flags():
    return known_flags()


def test_every_documented_flag_exists(flags):
    sources = DOCS + [ROOT / "Makefile", ROOT / "launch" / "demo.sh"]
    bad = {str(p.relative_to(ROOT)): unknown_flags(p.read_text(), flags) for p in sources}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_flag_check_sees_an_unknown_flag(flags):
    text = ("```bash\ntape-eval --checkpoint runs/x \\\n    --bogus-flag 3\n"
            "tape-data info --num-shards 4   # prepare's flag, not info's\n```")
    assert unknown_flags(text, flags) == ["tape-eval --bogus-flag", "tape-data --num-shards"]


def undocumented_config_keys(training_md: str) -> list[str]:
    """Keys of the trainer's own config sections missing from their dataclass docstring
    (``name:`` under Attributes) or from their row of the sections table in
    docs/training.md."""
    import dataclasses

    from tape_train.config import _OWN_SECTIONS

    rows = dict(re.findall(r"^\| `(\w+)` \| `[\w.]+` \|(.*)$", training_md, re.M))
    missing = []
    for section, cls in _OWN_SECTIONS.items():
        for f in dataclasses.fields(cls):
            if not re.search(rf"^\s+{f.name}:", cls.__doc__ or "", re.M):
                missing.append(f"{section}.{f.name} (docstring)")
            if f"`{f.name}`" not in rows.get(section, ""):
                missing.append(f"{section}.{f.name} (docs/training.md)")
    return missing


def test_every_config_key_is_documented():
    text = (ROOT / "docs" / "training.md").read_text()
    assert undocumented_config_keys(text) == []
    # Negative control: the check sees a key taken out of the table.
    assert undocumented_config_keys(text.replace("`keep_freed_memory`", "")) == [
        "train.keep_freed_memory (docs/training.md)"]
