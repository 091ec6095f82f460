"""What the documentation tells a reader to type exists: every ``from tape_train... import``
in a Python block of README.md, tokenizer/README.md and docs/*.md names a real module and
real names; every flag the docs, the Makefile and launch/demo.sh pass to a console script is
one its --help lists, and every flag given to a script run by path or module (benchmarks/,
tools/, ``python -m tape_train...``, launch/local.sh) one its parser defines; every dotted
config key the docs name (``train.lr``, ``data.sources[0].weight``) is a key of its section;
relative links point at files that exist."""

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
            # not a quoted one: `would reject the arguments ['--confg', ...]` quotes a mistake
            bad += [f"{script} {flag}" for flag in re.findall(r"(?<![\w'-])--[a-z][a-z0-9-]*", rest)
                    if flag not in known | {"--help", "--version"}]
    return bad


@pytest.fixture(scope="module")
def flags():
    return known_flags()


def test_every_documented_flag_exists(flags):
    sources = DOCS + [ROOT / "Makefile", ROOT / "launch" / "demo.sh"]
    bad = {str(p.relative_to(ROOT)): unknown_flags(one_line_commands(p.read_text()), flags)
           for p in sources}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_flag_check_sees_an_unknown_flag(flags):
    text = ("```bash\ntape-eval --checkpoint runs/x \\\n    --bogus-flag 3\n"
            "tape-data info --num-shards 4   # prepare's flag, not info's\n```")
    assert unknown_flags(text, flags) == ["tape-eval --bogus-flag", "tape-data --num-shards"]
    # an inline command that prose wraps is one command
    assert unknown_flags(one_line_commands("run `tape-eval --checkpoint r\n--bogus 1` first"),
                         flags) == ["tape-eval --bogus"]


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


# Config keys the docs name (`train.lr`, `data.sources[0].weight`, `model.pe=rope`) exist.
KEY = re.compile(r"(?<![\w./$-])(model|data|eval|train|optim|checkpoint|parallel|logging|profile)"
                 r"\.([a-z_]\w*)(\[[^\]]*\])?(?:\.([a-z_]\w*))?(?![\w(*-])")
# `eval.json`, `train.sbatch`, `model.safetensors`: files, not keys
NOT_KEYS = {"json", "jsonl", "md", "py", "png", "sbatch", "safetensors", "yaml", "txt", "pt"}
# misspelt on purpose (the docs show the errors they get), or DeepSpeed's own config key
NOT_OURS = {"train.lrr", "eval.lenghts", "checkpoint.load_universal"}


def names_code(section: str, key: str) -> bool:
    """``checkpoint.load_training_state``, ``parallel.tensor``: a name in the module or package
    of that name (tape_train.parallel, tape_train/train/checkpoint.py), not a config key."""
    import importlib.util

    for module in (f"tape_train.{section}", f"tape_train.train.{section}"):
        if importlib.util.find_spec(module) is None:
            continue
        found = importlib.import_module(module)
        if hasattr(found, key) or (hasattr(found, "__path__") and
                                   importlib.util.find_spec(f"{module}.{key}") is not None):
            return True
    return False


def config_keys() -> dict[str, set[str]]:
    import dataclasses

    from tape_train.config import _OWN_SECTIONS, _external_section_classes
    from tape_train.data.config import SourceConfig
    from tape_train.model.config import ModelConfig

    classes = {**_OWN_SECTIONS, **_external_section_classes(), "model": ModelConfig}
    keys = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in classes.items()}
    keys["model"].add("base")
    keys["source"] = {f.name for f in dataclasses.fields(SourceConfig)} - {"key"}
    return keys


def unknown_config_keys(text: str, keys) -> list[str]:
    """Dotted config keys in the code spans and blocks of ``text`` that no section has. A name
    followed by ``(``, ``*`` or a second dot-name without an index is code or a pattern
    (``model.eval()``, ``train.engine.forward_backward``, ``train.synthetic_*``), not a key."""
    code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`([^`\n]+)`",
                                                              re.sub(r"```.*?```", "", text,
                                                                     flags=re.S))
    bad = []
    for span in code:
        for m in KEY.finditer(span):
            section, key, index, sub = m.groups()
            name = m.group(0)
            if key in NOT_KEYS or name in NOT_OURS or (sub and index is None):
                continue
            if key not in keys[section] and not names_code(section, key):
                bad.append(name)
            elif sub and key in ("sources", "eval_sources") and sub not in keys["source"]:
                bad.append(name)
    return bad


def test_every_documented_config_key_exists():
    keys = config_keys()
    bad = {str(p.relative_to(ROOT)): unknown_config_keys(p.read_text(), keys) for p in DOCS}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_config_key_check_sees_a_removed_key():
    text = ("Set `train.max_step=10` or\n```bash\ntape-train --config demo data.sources[0].wieght=2"
            " optim.lr=1\n```\nnot `eval.json`, `model.eval()`, `train.engine.forward_backward`, "
            "`train.lrr`, `data.sources[1].weight`, `parallel.dp/sp/tp`, `train.synthetic_*`, "
            "`parallel.tensor`, `checkpoint.load_training_state`.")
    assert unknown_config_keys(text, config_keys()) == [
        "data.sources[0].wieght", "optim.lr", "train.max_step"]


# Scripts the docs run by path or module: `python benchmarks/run.py --quick`,
# `python -m tape_train.kernels.aot --markdown`, `torchrun ... -m tape_train.eval.cli --out x`,
# `bash launch/local.sh 4 --config ...` (tape-train's flags).
SCRIPT = re.compile(r"(?<![\w./-])((?:benchmarks|tools)/[\w/]+\.py|launch/local\.sh"
                    r"|-m\s+tape_train(?:\.\w+)+)\b([^`|#\n]*)")


def script_flags(script: str, flags) -> set[str] | None:
    """The flags ``script`` takes: a console script's --help for the trainer and tape-eval
    modules and local.sh, else every ``"--flag"`` literal in the script's source (what its
    argparse parser is built from); None when there is no such script."""
    script = re.sub(r"^-m\s+", "", script)
    by_module = {module: name for name, (module, _) in CLIS.items()}
    if script == "launch/local.sh":
        return flags["tape-train", None]
    if script in by_module:
        return set().union(*(v for k, v in flags.items() if k[0] == by_module[script]))
    path = ROOT / (script if script.endswith(".py") else script.replace(".", "/") + ".py")
    if not path.is_file():
        return None
    return set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", path.read_text()))


def one_line_commands(text: str) -> str:
    """``text`` with continuation lines joined and every inline code span on one line (prose
    wraps ```benchmarks/run.py\n--parts checkpoint``` where it likes)."""
    parts = text.replace("\\\n", " ").split("```")
    for i in range(0, len(parts), 2):  # outside the fenced blocks
        parts[i] = re.sub(r"`[^`]+`", lambda m: m.group(0).replace("\n", " "), parts[i])
    return "```".join(parts)


def unknown_script_flags(text: str, flags) -> list[str]:
    bad = []
    for line in one_line_commands(text).splitlines():
        for m in SCRIPT.finditer(line):
            script, rest = m.groups()
            known = script_flags(script, flags)
            if known is None:
                bad.append(f"{script}: no such script")
                continue
            bad += [f"{script} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
                    if flag not in known | {"--help"}]
    return bad


def test_every_documented_script_flag_exists(flags):
    sources = DOCS + [ROOT / "Makefile"]
    assert len(SCRIPT.findall("\n".join(p.read_text() for p in sources))) > 30  # it sees them
    bad = {str(p.relative_to(ROOT)): unknown_script_flags(p.read_text(), flags) for p in sources}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_script_flag_check_sees_an_unknown_flag(flags):
    text = ("```bash\npython benchmarks/run.py --quick --no-such-part\n"
            "python -m tape_train.kernels.aot --markdown --arch-list 90\n"
            "torchrun --nproc_per_node 2 -m tape_train.eval.cli --checkpoint r --bogus 1\n"
            "bash launch/local.sh 2 --config x.yaml --dry-run --nodes-count 2\n"
            "python benchmarks/gone.py --x\n```\nsee `python benchmarks/run.py\n--check-model x`")
    assert unknown_script_flags(text, flags) == [
        "benchmarks/run.py --no-such-part", "-m tape_train.kernels.aot --arch-list",
        "-m tape_train.eval.cli --bogus", "launch/local.sh --nodes-count",
        "benchmarks/gone.py: no such script", "benchmarks/run.py --check-model"]
