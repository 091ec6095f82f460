"""`tape-data prepare --demo` without apt: the demo corpus from the running Python's standard
library (stdlib_corpus.py), and the choice between it and Debian's packages (demo_sources.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
import textwrap

import pytest

from tape_train.data import cli as data_cli
from tape_train.data import demo_corpus, stdlib_corpus
from tape_train.data.corpus import read_complete_manifest


def _shard_texts(directory) -> dict[str, list[dict]]:
    import zstandard

    out = {}
    for shard in read_complete_manifest(directory)["shards"]:
        with open(directory / shard["path"], "rb") as f:
            raw = zstandard.ZstdDecompressor().stream_reader(f).read().decode()
        out[shard["path"]] = [json.loads(line) for line in raw.splitlines()]
    return out


def _shard_digests(directory) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.glob("*.jsonl.zst"))}


@pytest.fixture
def no_apt(tmp_path, monkeypatch):
    """A PATH that holds none of the apt tools (an empty directory)."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert all(shutil.which(tool) is None for tool in ("apt-get", "apt-cache", "dpkg-deb"))


_MODULE = textwrap.dedent('''\
    """Tools to count the sheep of a farm.

    Counting is done in the order the sheep pass the gate.

    >>> count(["dolly", "shaun"])
    2
    """

    # The gate is opened once a day; a sheep that is late waits
    # until the next morning and is counted then.
    GATE = 1
    # x = count(GATE)

    TEMPLATE = """
    # not a comment: the first line of a template
    """


    def count(sheep):
        """Return how many sheep passed the gate today."""
        return len(sheep)


    def ratio(a, b):
        """a / b"""
        return a / b


    class Flock:
        """A group of sheep that graze together and share a shepherd."""

        def __len__(self):
            """len(flock) <==> flock.__len__()"""
            return 0

        def shear(self, when):
            """Shear every sheep of the flock, in spring unless told otherwise."""
    ''')


@pytest.fixture
def tiny_stdlib(tmp_path, monkeypatch):
    """A standard library of a few files, with what the walk must skip beside them."""
    root = tmp_path / "lib" / "python3.x"
    files = {
        "farm.py": _MODULE,
        "pasture/__init__.py": '"""Pastures where the flocks of the farm graze in summer."""\n',
        "pasture/grass.py": '"""Grass grows back faster after a rain than after a dry week."""\n',
        "pydoc_data/topics.py": "topics = {'while': 'The while statement is used for "
                                "repeated execution as long as an expression is true.', "
                                "'assert': 'Assert statements are a convenient way to insert "
                                "debugging assertions into a program.'}\n",
        "LICENSE.txt": "A history of the software, and the terms of its licence.\n",
        # Skipped: tests, third-party code, a distribution's split-out packages, bytecode.
        "test/test_farm.py": '"""Tests of the farm module, which the corpus leaves out."""\n',
        "site-packages/thirdparty.py": '"""Third-party code that differs per machine."""\n',
        "idlelib/editor.py": '"""An editor some distributions ship as a package."""\n',
        "__pycache__/farm.cpython-311.pyc": "not python",
        "broken.py": '"""A module that does not parse for some reason."""\ndef (:\n',
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(stdlib_corpus, "stdlib_root", lambda: root)
    return root


def test_is_prose_keeps_prose_and_drops_code():
    prose = ["Return how many sheep passed the gate today.",
             "Shear every sheep.\n\nExample::\n\n    flock.shear(when='spring')\n",
             "Same as a + b, for numbers and for sequences alike."]
    code = ["od.__iter__() <==> iter(od)", "a / b", "x = f(a, b)",
            "CFWS = (1*([FWS] comment) [FWS]) / FWS",
            "print('lookup without encoding succeeded')",
            "if value is None:\n    value = default_value()\nreturn value",
            "0x0000 0x0001 0x0002 0x0003", "Hash."]
    assert [text for text in prose if not stdlib_corpus.is_prose(text)] == []
    assert [text for text in code if stdlib_corpus.is_prose(text)] == []


def test_doctest_sessions_are_removed_and_their_lead_in_ends_the_sentence():
    doc = ("Count sheep.\n\nCounting in a loop::\n\n    >>> count(['a'])\n    1\n"
           "    >>> ...\n\nMore prose after the example.\n\nA literal block::\n\n"
           "    kept = True\n")
    assert stdlib_corpus.strip_doctests(doc) == (
        "Count sheep.\n\nCounting in a loop.\n\nMore prose after the example.\n\n"
        "A literal block::\n\n    kept = True")


def test_a_module_document_keeps_prose_in_source_order_and_drops_code():
    text = stdlib_corpus.module_document(_MODULE.encode(), "farm.py")
    kept = ["farm\n\nTools to count the sheep of a farm.",
            "The gate is opened once a day; a sheep that is late waits\nuntil the next "
            "morning and is counted then.",
            "farm.count\n\nReturn how many sheep passed the gate today.",
            "farm.Flock\n\nA group of sheep",
            "farm.Flock.shear\n\nShear every sheep"]
    positions = [text.find(part) for part in kept]
    assert -1 not in positions and positions == sorted(positions), text
    for dropped in (">>>", "dolly", "x = count", "a / b", "farm.ratio", "<==>",
                    "farm.Flock.__len__", "not a comment"):
        assert dropped not in text, dropped


def test_the_walk_is_sorted_and_skips_tests_third_party_and_split_out_packages(tiny_stdlib,
                                                                               monkeypatch):
    expected = ["broken.py", "farm.py", "pasture/__init__.py", "pasture/grass.py",
                "pydoc_data/topics.py"]
    assert stdlib_corpus.module_files(tiny_stdlib) == expected
    import os

    walk = os.walk

    def reversed_walk(top):  # a file system that lists directories in another order
        for directory, dirs, files in walk(top):
            dirs.reverse()
            yield directory, dirs, files[::-1]

    monkeypatch.setattr(stdlib_corpus.os, "walk", reversed_walk)
    assert stdlib_corpus.module_files(tiny_stdlib) == expected
    assert stdlib_corpus.module_name("pasture/__init__.py") == "pasture"
    assert stdlib_corpus.module_name("pasture/grass.py") == "pasture.grass"


def test_stdlib_documents_resume_at_a_unit_and_document(tiny_stdlib, caplog):
    with caplog.at_level(logging.WARNING, logger="tape_train.data"):
        everything = list(stdlib_corpus.iter_stdlib_documents(tiny_stdlib))
    assert "broken.py does not parse" in caplog.text
    ids = [doc["id"] for doc, _ in everything]
    assert ids == ["farm.py", "pasture/__init__.py", "pasture/grass.py", "topics:assert",
                   "topics:while", "LICENSE.txt"]
    assert {doc["source"] for doc, _ in everything} == {"stdlib-docstrings", "pydoc-topics",
                                                        "stdlib-prose"}
    for k in range(len(everything)):
        rest = list(stdlib_corpus.iter_stdlib_documents(tiny_stdlib, everything[k][1]))
        assert rest == everything[k + 1:]


def test_prepare_demo_without_apt_builds_the_stdlib_corpus(tmp_path, no_apt, caplog, capsys):
    """The real standard library of this interpreter: a complete corpus with enough text for
    the demo recipe and a held-out split, one warning saying why, byte-identical twice."""
    outs = [tmp_path / "demo-a", tmp_path / "demo-b"]
    with caplog.at_level(logging.WARNING, logger="tape_train.data"):
        assert data_cli.main(["prepare", "--demo", "--out", str(outs[0])]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "apt-get not found on PATH" in warnings[0]
    assert "perplexities are not comparable with the Debian corpus's" in warnings[0]
    manifest = read_complete_manifest(outs[0])
    assert manifest["demo_source"] == "python"
    assert manifest["config"]["demo_source"] == "python"
    assert manifest["python"]["version"] == platform.python_version()
    assert manifest["config"]["eval_fraction"] == 0.05
    train, held_out = manifest["splits"]["train"], manifest["splits"]["eval"]
    # The demo recipe reads 300 x 8 x 129 = 310 k tokens: ~1.3 MB at this tokenizer's
    # ~4 bytes per token, so ~2.6 MB of training text is read once, without repeating.
    assert train["documents"] > 300 and train["text_bytes"] > 2e6
    assert held_out["documents"] >= 10 and held_out["text_bytes"] > 50e3
    assert set(manifest["sources"]) >= {"stdlib-docstrings", "pydoc-topics"}
    documents = [doc for docs in _shard_texts(outs[0]).values() for doc in docs]
    by_id = {doc["id"]: doc["text"] for doc in documents}
    assert "JSON (JavaScript Object Notation)" in by_id["json/__init__.py"]
    assert "topics:assert" in by_id
    assert not any(doc["id"].startswith(("test/", "site-packages/", "idlelib/"))
                   for doc in documents)
    assert not any(">>> " in doc["text"] for doc in documents
                   if doc["source"] == "stdlib-docstrings")

    assert data_cli.main(["prepare", "--demo", "--demo-source", "python", "--out",
                          str(outs[1])]) == 0
    assert _shard_digests(outs[0]) == _shard_digests(outs[1])
    assert len(_shard_digests(outs[0])) == 17


def test_demo_source_debian_without_apt_is_the_clear_error(tmp_path, no_apt, capsys):
    out = tmp_path / "demo"
    assert data_cli.main(["prepare", "--demo", "--demo-source", "debian", "--out",
                          str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tape-data: error: prepare --demo needs apt-get (a Debian/Ubuntu "
                          "machine); use --demo-source python"), err
    assert read_complete_manifest(out) is None and not list(out.glob("*.jsonl.zst"))
    (tmp_path / "texts").mkdir()
    assert data_cli.main(["prepare", "--demo-source", "python", "--input",
                          str(tmp_path / "texts"), "--out", str(out)]) == 1
    assert "--demo-source goes with --demo" in capsys.readouterr().err


def _offline_apt(cmd, cwd=None):
    """apt present, but with no package lists and no archive to fetch them from."""
    import subprocess

    if cmd[0] == "apt-cache":
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return subprocess.CompletedProcess(cmd, 100, "", "E: Could not resolve 'deb.debian.org'")


def test_auto_uses_debian_where_apt_works_and_the_stdlib_where_the_archive_is_out_of_reach(
        tmp_path, tiny_stdlib, monkeypatch, caplog):
    monkeypatch.setattr(demo_corpus, "require_apt", lambda: None)
    monkeypatch.setattr(demo_corpus, "_run", _offline_apt)
    out = tmp_path / "offline"
    with caplog.at_level(logging.WARNING, logger="tape_train.data"):
        assert data_cli.main(["prepare", "--demo", "--out", str(out), "--cache-dir",
                              str(tmp_path / "cache")]) == 0
    fallback = [r.getMessage() for r in caplog.records if "standard library instead" in
                r.getMessage()]
    assert len(fallback) == 1
    assert ("(none of the demo packages could be downloaded from the archive (apt-get update: "
            "E: Could not resolve 'deb.debian.org'))") in fallback[0]
    # one warning line: the failed update is in it, not a line of its own
    assert not [r for r in caplog.records if "apt-get update failed" in r.getMessage()]
    assert read_complete_manifest(out)["demo_source"] == "python"

    # apt works: Debian's packages, and no word of the standard library (the control).
    deb = tmp_path / "fortunes_1.0_all.deb"
    deb.write_bytes(b"")
    monkeypatch.setattr(demo_corpus, "fetch_demo_packages",
                        lambda cache_dir: {"fortunes": (deb, "1.0")})
    monkeypatch.setattr(demo_corpus, "iter_demo_documents", lambda debs, position=None: iter(
        [({"text": f"Fortune number {i} of the day.", "source": "fortunes",
           "id": f"fortunes:{i}"}, [0, i + 1]) for i in range(50)]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tape_train.data"):
        assert data_cli.main(["prepare", "--demo", "--out", str(tmp_path / "online")]) == 0
    manifest = read_complete_manifest(tmp_path / "online")
    assert manifest["demo_source"] == "debian" and manifest["config"] == {
        "demo": True, "num_shards": 16, "eval_fraction": 0.01, "seed": 0}
    assert manifest["packages"] == {"fortunes": "1.0"}
    assert "standard library" not in caplog.text


def test_a_prepared_demo_corpus_of_either_source_is_reused_by_auto(tmp_path, tiny_stdlib,
                                                                   monkeypatch, capsys):
    """auto reuses a complete corpus it could have written, whichever source wrote it,
    without looking for apt; an explicit other source rebuilds."""
    out = tmp_path / "demo"
    assert data_cli.main(["prepare", "--demo", "--demo-source", "python", "--out",
                          str(out)]) == 0

    def no_fetch(cache_dir):
        raise AssertionError("fetched packages for a corpus already complete")

    monkeypatch.setattr(demo_corpus, "fetch_demo_packages", no_fetch)
    capsys.readouterr()
    assert data_cli.main(["prepare", "--demo", "--out", str(out)]) == 0
    assert "already complete" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="already complete"):
        data_cli.main(["prepare", "--demo", "--demo-source", "debian", "--out", str(out)])


def test_comment_lines_are_numbered_as_ast_numbers_them():
    """str.splitlines() also breaks at a form feed (and \\x1c-\\x1e, \\x85, \\u2028), which
    ast does not: every comment after one was given a later line than its statement's."""
    import ast

    from tape_train.data.stdlib_corpus import _comment_blocks

    source = "x = 1\n# a remark\x0c with a form feed\ny = [\n    1,\n]\n# the last one\n"
    assert [line for line, _ in _comment_blocks(source, ast.parse(source))] == [2, 6]


def test_comments_inside_a_match_statement_are_kept():
    """A match statement holds statements (in its cases) as if/for/while/try/with do: the
    comments between them are prose, not lines inside a one-line statement. (Its statements
    are in ``cases``, not ``body``: it was taken for a simple statement spanning lines.)"""
    import ast

    from tape_train.data.stdlib_corpus import _comment_blocks

    source = textwrap.dedent("""\
        def handle(command):
            match command:
                case "stop":
                    # Stopping waits for the current step to end before it
                    # writes the last checkpoint.
                    return 0
                case [first, *rest]:
                    # A list of words is a command followed by its arguments.
                    return first
                case _:
                    pass
            x = [
                # inside a literal, not between statements
                1,
            ]
        """)
    blocks = list(_comment_blocks(source, ast.parse(source)))
    assert blocks == [
        (4, "Stopping waits for the current step to end before it\n"
            "writes the last checkpoint."),
        (8, "A list of words is a command followed by its arguments.")]
    text = stdlib_corpus.module_document(source.encode(), "commands.py")
    assert "Stopping waits" in text and "A list of words" in text
    assert "inside a literal" not in text
