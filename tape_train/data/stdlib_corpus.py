"""The demo corpus from the running interpreter's own standard library: English prose that
needs nothing but the Python that runs tape-train (no apt, no network).

Read from ``sysconfig.get_paths()["stdlib"]`` in a sorted walk, every file parsed with
``ast`` (never imported):

======================  =============================================  =================
source                  what                                           one document per
======================  =============================================  =================
``stdlib-docstrings``   module, class and function docstrings and the  module (``.py``)
                        comment blocks between them, in source order
``pydoc-topics``        ``pydoc_data/topics.py``: the language          topic
                        reference as ``help()`` shows it
``stdlib-prose``        ``LICENSE.txt`` (the history of Python and its  file
                        licences), ``email/architecture.rst``
======================  =============================================  =================

Docstrings lose their doctest sessions (a ``>>>`` line up to the next blank line), and a
docstring or comment block that is code, not prose (``is_prose``), is left out. Directories
that distributions ship as separate packages (the test suite, IDLE, tkinter, turtle,
lib2to3, distutils, ensurepip) and third-party ``site-packages`` are skipped, so one Python
version gives the same documents with or without those packages installed. Nothing depends
on dict order or file times: the same stdlib gives the same documents, byte for byte.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import platform
import re
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from tape_train.data.config import DataError

log = logging.getLogger("tape_train.data")

# Not read: third-party code, test suites, bytecode and build files, and what Debian, Fedora
# or Alpine split into packages of their own (reading those where installed would make one
# Python version's corpus differ between machines); encodings/ is generated codec tables.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                          "__pycache__", "lib-dynload", "idlelib", "tkinter", "turtledemo",
                          "lib2to3", "distutils", "ensurepip", "encodings", "__phello__"})
# turtle.py goes with tkinter on Fedora; a distribution's sitecustomize.py and the build's
# _sysconfigdata_*.py are not CPython's text; this.py is the Zen of Python in rot13.
SKIPPED_FILES = frozenset({"turtle.py", "sitecustomize.py", "this.py"})
PROSE_FILES = ("LICENSE.txt", "email/architecture.rst")
TOPICS_FILE = "pydoc_data/topics.py"

_PLAIN_WORD = re.compile(r"""^[("'`]*[A-Za-z]+(?:'[a-z]+)?[)"'`.,;:!?]*$""")
_TITLED = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> Path:
    """The standard library of the interpreter running this (in a venv: the base one's)."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_identity() -> dict:
    """What names the interpreter whose stdlib this is (recorded in the manifest)."""
    return {"implementation": platform.python_implementation(),
            "version": platform.python_version()}


def module_files(root: Path) -> list[str]:
    """The ``.py`` files read, relative to ``root`` with ``/``: a walk in sorted order (each
    directory's files by name, then its subdirectories by name), whatever order the file
    system lists them in."""
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("config-"))
        relative = Path(directory).relative_to(root)
        for name in sorted(files):
            if (name.endswith(".py") and name not in SKIPPED_FILES
                    and not name.startswith("_sysconfigdata")):
                found.append((relative / name).as_posix())
    return found


def module_name(relative: str) -> str:
    """``email/mime/text.py`` -> ``email.mime.text``; ``json/__init__.py`` -> ``json``."""
    parts = relative[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_prose(text: str) -> bool:
    """Whether ``text`` reads as English prose, not code: at least three plain words (letters
    only, maybe in quotes or brackets, maybe followed by punctuation), plain words at least
    half of its whitespace-separated pieces, and at most half its lines Python statements.
    ``x = f(a, b)``, a signature, a grammar rule, a table of numbers or commented-out code is
    not; a docstring of prose with some examples or a table in it is."""
    pieces = text.split()
    plain = sum(bool(_PLAIN_WORD.match(piece)) for piece in pieces)
    if plain < 3 or plain * 2 < len(pieces):
        return False
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return sum(map(_is_code_line, lines)) * 2 <= len(lines)


def _is_code_line(line: str) -> bool:
    """A line that compiles as a Python statement and is not a plain phrase (a few words
    with no operator or bracket, such as ``See above``, is prose that also happens to fail
    or pass compilation)."""
    if not re.search(r"[()\[\]{}=:.]|^(import|from|return|raise|del|pass|break|continue)\b",
                     line):
        return False
    try:
        with warnings.catch_warnings():  # "'float' object is not callable" and the like
            warnings.simplefilter("ignore")
            compile(line, "<line>", "exec", ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError):
        return line.endswith(":") and bool(re.match(r"(if|for|while|def|class|elif|else|try"
                                                     r"|except|with)\b", line))
    return True


def strip_doctests(text: str) -> str:
    """``text`` without its doctest sessions: each ``>>>`` line, the ``...`` lines and the
    expected output after it, up to the next blank line. A reST lead-in left with nothing to
    introduce (``Decoding JSON::`` just before a session) ends with a full stop instead."""
    kept: list[str] = []
    in_session = False
    for line in text.splitlines():
        if line.lstrip().startswith(">>>"):
            if not in_session:
                lead_in = next((i for i in range(len(kept) - 1, -1, -1) if kept[i].strip()),
                               None)
                if lead_in is not None and kept[lead_in].rstrip().endswith("::"):
                    kept[lead_in] = kept[lead_in].rstrip()[:-2] + "."
            in_session = True
        elif not line.strip():
            in_session = False
        if not in_session:
            kept.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def _statements(body: list[ast.stmt], prefix: str) -> Iterator[tuple[ast.stmt, str]]:
    """Every statement of ``body``, nested ones included (not expressions: walking those
    would take most of the time), with the qualified name of the class or function holding
    it."""
    for node in body:
        yield node, prefix
        inner = f"{prefix}.{node.name}" if isinstance(node, _TITLED) else prefix
        for field in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(node, field, []), inner)
        for clause in (*getattr(node, "handlers", []), *getattr(node, "cases", [])):
            yield from _statements(clause.body, inner)


def _is_compound(node: ast.stmt) -> bool:
    """Whether ``node`` holds statements of its own (if, for, while, try, with, def, class,
    and ``match``, whose statements are in its ``cases``, not in a ``body``)."""
    return hasattr(node, "body") or hasattr(node, "cases")


def _comment_blocks(source: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``(first line, text)`` of each run of whole-line comments between statements, ``#``
    marks removed. Lines inside a simple statement are not comments between statements: a
    ``#`` line there is inside a string, or remarks on one item of a bracketed literal."""
    inside: set[int] = set()
    for node, _ in _statements(tree.body, ""):
        if not _is_compound(node) and node.end_lineno > node.lineno:
            inside.update(range(node.lineno + 1, node.end_lineno + 1))
    block: list[str] = []
    start = 0
    for number, line in enumerate(source.split("\n") + [""], start=1):
        stripped = line.strip()
        if stripped.startswith("#") and number not in inside and not stripped.startswith("#!"):
            if not block:
                start = number
            block.append(stripped.lstrip("#").strip())
        elif block:
            yield start, "\n".join(block).strip()
            block = []


def _docstrings(tree: ast.Module, name: str) -> Iterator[tuple[int, str, str]]:
    """``(line, title, docstring)`` of the module and of every class and function, nested
    ones included, titled by their qualified names."""
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        yield 0, name, doc
    for node, prefix in _statements(tree.body, name):
        if isinstance(node, _TITLED) and (doc := ast.get_docstring(node, clean=True)):
            yield node.lineno, f"{prefix}.{node.name}", doc


def module_document(source: bytes, relative: str) -> str:
    """The document of one module: its docstrings (each after a line with its qualified
    name) and prose comment blocks in source order; ``""`` when it has neither."""
    text = source.decode("utf-8")
    try:
        with warnings.catch_warnings():  # a newer Python's SyntaxWarnings on old escapes
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=relative)
    except SyntaxError as exc:
        log.warning("prepare: %s does not parse (%s); skipping it", relative, exc.msg)
        return ""
    name = module_name(relative)
    sections = [(line, f"{title}\n\n{body}") for line, title, doc in _docstrings(tree, name)
                if is_prose(body := strip_doctests(doc))]
    sections += [(line, body) for line, body in _comment_blocks(text, tree) if is_prose(body)]
    sections.sort(key=lambda section: section[0])  # stable: a docstring before its comments
    return "\n\n".join(body for _, body in sections)


def topic_documents(source: bytes) -> list[tuple[str, str]]:
    """``[(topic, text)]`` of ``pydoc_data/topics.py``'s ``topics`` dict, sorted by topic."""
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "topics"):
            topics = ast.literal_eval(node.value)
            return [(key, topics[key].strip()) for key in sorted(topics)]
    return []


def stdlib_units(root: Path) -> list[tuple[str, str]]:
    """What is read, in order: ``[(source name, path relative to root)]``."""
    units = [("stdlib-docstrings", path) for path in module_files(root)]
    if (root / TOPICS_FILE).is_file():
        units.append(("pydoc-topics", TOPICS_FILE))
    units += [("stdlib-prose", path) for path in PROSE_FILES if (root / path).is_file()]
    return units


def stdlib_fingerprint(root: Path) -> dict:
    """``python_identity()`` with how many files are read and the sha256 over their paths
    and bytes: two machines whose fingerprints match write the same corpus."""
    digest = hashlib.sha256()
    units = stdlib_units(root)
    for _, path in units:
        data = (root / path).read_bytes()
        digest.update(f"{path}\0{len(data)}\0".encode())
        digest.update(data)
    return {**python_identity(), "files": len(units), "sha256": digest.hexdigest()}


def _unit_documents(root: Path, source: str, path: str) -> Iterator[tuple[str, str]]:
    data = (root / path).read_bytes()
    if source == "stdlib-docstrings":
        text = module_document(data, path)
        if text:
            yield path, text
    elif source == "pydoc-topics":
        for topic, text in topic_documents(data):
            yield f"topics:{topic}", text
    else:
        yield path, data.decode("utf-8").strip()


def iter_stdlib_documents(root: Path, position: list | None = None
                          ) -> Iterator[tuple[dict, list]]:
    """The documents as ``({"text", "source", "id"}, [unit index, documents of it so far])``;
    from ``position`` on (one it yielded before), the units before it not read."""
    units = stdlib_units(root)
    if not units:
        raise DataError(f"prepare --demo: the standard library at {root} has no .py files "
                        f"(sysconfig's stdlib path); use --demo-source debian or --input")
    first, skip = position or (0, 0)
    counts: dict[str, int] = {}
    for index in range(first, len(units)):
        source, path = units[index]
        n = 0
        for doc_id, text in _unit_documents(root, source, path):
            n += 1
            counts[source] = counts.get(source, 0) + 1
            if index > first or n > skip:
                yield {"text": text, "source": source, "id": doc_id}, [index, n]
    for source, n in sorted(counts.items()):
        log.info("prepare: %s: %d documents", source, n)

