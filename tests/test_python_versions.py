"""The code runs on every Python that pyproject.toml's requires-python admits: no module of
the package, the tests, the benchmarks or the tools uses syntax newer than the minimum, a name
of the standard library added after it, or a module removed from a newer Python — unless the
use is guarded (inside ``try: ... except ImportError/AttributeError``, under an ``if`` on
``sys.version_info``, or under ``if TYPE_CHECKING``).

The tables are what the project is likely to reach for, not the whole changelog: a name that
bites on a Python the project supports belongs in them (with the version it appeared in or
was removed in)."""

from __future__ import annotations

import ast
import re
import sys
import warnings
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
CHECKED_DIRS = ("tape_train", "tests", "benchmarks", "tools")

# Standard library names by the Python version that added them (modules, and attributes of
# modules as their dotted names); builtins separately.
ADDED = {
    (3, 11): {
        "tomllib", "wsgiref.types",
        "datetime.UTC", "enum.StrEnum", "enum.ReprEnum", "enum.EnumCheck", "enum.FlagBoundary",
        "enum.verify", "enum.member", "enum.nonmember", "enum.global_enum", "enum.property",
        "hashlib.file_digest", "typing.Self", "typing.LiteralString", "typing.Never",
        "typing.assert_never", "typing.assert_type", "typing.reveal_type",
        "typing.dataclass_transform", "typing.Required", "typing.NotRequired", "typing.Unpack",
        "typing.TypeVarTuple", "typing.get_overloads", "typing.clear_overloads",
        "asyncio.TaskGroup", "asyncio.timeout", "asyncio.timeout_at", "asyncio.Runner",
        "asyncio.Barrier", "contextlib.chdir", "operator.call", "math.exp2", "math.cbrt",
        "logging.getLevelNamesMapping", "inspect.getmembers_static", "re.NOFLAG",
        "sys.exception", "locale.getencoding",
    },
    (3, 12): {
        "itertools.batched", "typing.override", "typing.TypeAliasType", "math.sumprod",
        "os.path.splitroot", "os.path.isjunction", "collections.abc.Buffer",
        "types.get_original_bases", "inspect.markcoroutinefunction", "sys.monitoring",
        "calendar.Month", "calendar.Day", "sys.activate_stack_trampoline",
    },
    (3, 13): {
        "warnings.deprecated", "typing.ReadOnly", "typing.TypeIs", "typing.NoDefault",
        "typing.get_protocol_members", "typing.is_protocol", "copy.replace",
        "base64.z85encode", "base64.z85decode", "math.fma", "os.process_cpu_count",
        "glob.translate", "os.path.isreserved", "pathlib.UnsupportedOperation", "dbm.sqlite3",
    },
    (3, 14): {
        "annotationlib", "compression", "string.templatelib", "concurrent.interpreters",
    },
}
ADDED_BUILTINS = {
    (3, 11): {"ExceptionGroup", "BaseExceptionGroup"},
    (3, 13): {"PythonFinalizationError"},
}
# Modules (and module attributes) by the Python version that removed them.
REMOVED = {
    (3, 12): {"distutils", "imp", "asynchat", "asyncore", "smtpd", "pkgutil.ImpImporter",
              "pkgutil.ImpLoader", "configparser.SafeConfigParser", "ssl.wrap_socket",
              "ssl.match_hostname", "gzip.GzipFile.filename"},
    (3, 13): {"aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap",
              "msilib", "nis", "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau",
              "telnetlib", "uu", "xdrlib", "lib2to3", "typing.io", "typing.re",
              "locale.resetlocale", "unittest.makeSuite", "unittest.findTestCases",
              "unittest.getTestCaseNames"},
}
GUARDING_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "NameError",
                       "Exception", "BaseException"}


def minimum_python() -> tuple[int, int]:
    """The lowest 3.x that pyproject.toml's requires-python admits."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.MULTILINE)
    assert match, "pyproject.toml has no requires-python"
    spec = SpecifierSet(match.group(1))
    return next((3, minor) for minor in range(0, 40) if spec.contains(f"3.{minor}"))


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return any(_dotted(sub) in names for sub in ast.walk(node) if isinstance(sub, ast.expr))


class _Checker(ast.NodeVisitor):
    """The uses of ``names`` (dotted name -> what to say) outside a guard, by line."""

    def __init__(self, names: dict[str, str], builtins: dict[str, str]):
        self.names = names
        self.builtins = builtins
        self.guarded = 0
        self.aliases: dict[str, str] = {}  # a bound name -> the module (or name) it is
        self.found: list[tuple[int, str]] = []

    def _use(self, node: ast.AST, dotted: str) -> bool:
        # The longest known prefix: `os.path.splitroot` before `os.path`, `typing.io.IO`
        # reaches `typing.io`.
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if name in self.names:
                if not self.guarded:
                    self.found.append((node.lineno, f"{name}: {self.names[name]}"))
                return True
        return False

    def _guarded(self, nodes: list[ast.stmt]) -> None:
        self.guarded += 1
        for node in nodes:
            self.visit(node)
        self.guarded -= 1

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._use(node, alias.name)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                head = alias.name.split(".")[0]
                self.aliases[head] = head

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        module_named = self._use(node, node.module)
        for alias in node.names:
            if not module_named:
                self._use(node, f"{node.module}.{alias.name}")
            self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted is not None:
            head, _, rest = dotted.partition(".")
            if head in self.aliases:  # only names bound by an import: not a local `datetime`
                self._use(node, f"{self.aliases[head]}.{rest}")
            return  # the chain is one use, not one per prefix
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.builtins and node.id not in self.aliases and not self.guarded:
            self.found.append((node.lineno, f"{node.id}: {self.builtins[node.id]}"))

    def visit_Try(self, node: ast.Try) -> None:
        catches = set()
        for handler in node.handlers:
            kinds = handler.type
            kinds = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
            catches |= {"Exception" if k is None else _dotted(k) for k in kinds}
        if catches & GUARDING_EXCEPTIONS:
            self._guarded(node.body)
        else:
            for stmt in node.body:
                self.visit(stmt)
        for stmt in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(stmt)

    visit_TryStar = visit_Try

    def visit_If(self, node: ast.If) -> None:
        if _mentions(node.test, {"sys.version_info", "TYPE_CHECKING", "typing.TYPE_CHECKING"}):
            self.visit(node.test)
            self._guarded(node.body)
            self._guarded(node.orelse)
        else:
            self.generic_visit(node)


def _names_beyond(minimum: tuple[int, int]) -> tuple[dict[str, str], dict[str, str]]:
    names, builtins = {}, {}
    for version, added in ADDED.items():
        if version > minimum:
            names.update(dict.fromkeys(added, f"added in Python {version[0]}.{version[1]}"))
    for version, added in ADDED_BUILTINS.items():
        if version > minimum:
            builtins.update(dict.fromkeys(added, f"added in Python {version[0]}.{version[1]}"))
    for version, removed in REMOVED.items():
        # requires-python has no upper bound: every Python from the removal on lacks it.
        names.update(dict.fromkeys(removed, f"removed in Python {version[0]}.{version[1]}"))
    return names, builtins


def _syntax_beyond(tree: ast.Module, source: str, minimum: tuple[int, int]
                   ) -> list[tuple[int, str]]:
    """Syntax nodes newer than ``minimum`` (what this interpreter parses and the oldest
    admitted one may not)."""
    found = []

    def newer(node: ast.AST, version: tuple[int, int], what: str) -> None:
        if version > minimum:
            found.append((node.lineno, f"{what}: Python {version[0]}.{version[1]} syntax"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Match):
            newer(node, (3, 10), "match statement")
        elif type(node).__name__ == "TryStar":
            newer(node, (3, 11), "except*")
        elif type(node).__name__ == "TypeAlias":
            newer(node, (3, 12), "type statement (PEP 695)")
        elif getattr(node, "type_params", None):
            newer(node, (3, 12), "type parameters (PEP 695)")
        elif isinstance(node, ast.Subscript) and (
                isinstance(node.slice, ast.Starred) or (isinstance(node.slice, ast.Tuple) and any(
                    isinstance(e, ast.Starred) for e in node.slice.elts))):
            newer(node, (3, 11), "starred expression in a subscript")
        elif isinstance(node, ast.JoinedStr) and sys.version_info >= (3, 12):
            # PEP 701 (3.12): an f-string may reuse its own quote, or hold a backslash, inside
            # its braces. Only a 3.12+ parser accepts that, and only its positions are exact.
            # The quote is that of the part holding the braces: implicitly joined literals
            # ('a' f"{d['k']}") are one node, each part with its own quote.
            lines = source.splitlines(keepends=True)
            parts = _fstring_parts(ast.get_source_segment(source, node) or "")
            for value in node.values:
                if isinstance(value, ast.FormattedValue):
                    inner = ast.get_source_segment(source, value.value) or ""
                    quote = _quote_at(parts, _relative(lines, node, value.value))
                    if (quote and quote in inner) or "\\" in inner:
                        newer(node, (3, 12), "quote or backslash inside an f-string's braces")
    return found


def _fstring_parts(segment: str) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """``(start, end, quote)`` of every f-string literal in ``segment`` (Python 3.12+, whose
    tokenizer marks their ends), positions (row, column) within ``segment``."""
    import io
    import tokenize

    parts, open_ = [], []
    for tok in tokenize.generate_tokens(io.StringIO(segment).readline):
        if tok.type == tokenize.FSTRING_START:
            body = tok.string.lstrip("rRfFbBuU")
            open_.append((tok.start, body[:3] if body[:3] in ('"""', "'''") else body[:1]))
        elif tok.type == tokenize.FSTRING_END and open_:
            start, quote = open_.pop()
            parts.append((start, tok.end, quote))
    return parts


def _relative(lines: list[str], outer: ast.AST, node: ast.AST) -> tuple[int, int]:
    """Where ``node`` starts within ``outer``'s source, as (row, column) in characters (the
    tokenizer's; ast's columns count UTF-8 bytes)."""
    def chars(lineno: int, col: int) -> int:
        return len(lines[lineno - 1].encode()[:col].decode(errors="replace"))

    col = chars(node.lineno, node.col_offset)
    if node.lineno == outer.lineno:
        col -= chars(outer.lineno, outer.col_offset)
    return node.lineno - outer.lineno + 1, col


def _quote_at(parts, position: tuple[int, int]) -> str:
    """The quote of the innermost f-string literal that ``position`` lies inside ('' if
    none)."""
    inside = [(start, quote) for start, end, quote in parts if start < position < end]
    return max(inside)[1] if inside else ""


def problems(source: str, filename: str, minimum: tuple[int, int]) -> list[str]:
    """``"file:line: what"`` for every use in ``source`` that some admitted Python lacks."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename)
            # The parser's own check of the grammar of an older version (best effort: it
            # knows some of the newer syntax only).
            ast.parse(source, filename, feature_version=minimum)
    except SyntaxError as exc:
        return [f"{filename}:{exc.lineno}: does not parse as Python "
                f"{minimum[0]}.{minimum[1]}: {exc.msg}"]
    checker = _Checker(*_names_beyond(minimum))
    checker.visit(tree)
    found = _syntax_beyond(tree, source, minimum) + checker.found
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def checked_files() -> list[Path]:
    files = [ROOT / "setup.py"] if (ROOT / "setup.py").is_file() else []
    for directory in CHECKED_DIRS:
        files += sorted((ROOT / directory).rglob("*.py"))
    return files


def test_the_minimum_python_is_read_from_pyproject():
    assert minimum_python() >= (3, 8)
    assert sys.version_info[:2] >= minimum_python()


def test_no_module_uses_what_the_minimum_python_lacks():
    minimum = minimum_python()
    files = checked_files()
    assert len(files) > 100, files
    found = []
    for path in files:
        found += problems(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)),
                          minimum)
    assert not found, (f"requires-python admits Python {minimum[0]}.{minimum[1]}, which lacks:\n"
                       + "\n".join(found))


@pytest.mark.parametrize("source, what", [
    ("import datetime\nnow = datetime.datetime.now(datetime.UTC)\n", "datetime.UTC: added"),
    ("from datetime import UTC\n", "datetime.UTC: added"),
    ("import datetime as dt\nx = dt.UTC\n", "datetime.UTC: added"),
    ("import tomllib\n", "tomllib: added"),
    ("from enum import StrEnum\n", "enum.StrEnum: added"),
    ("import hashlib\nhashlib.file_digest(f, 'sha256')\n", "hashlib.file_digest: added"),
    ("from typing import Self\n", "typing.Self: added"),
    ("import itertools\nitertools.batched(x, 2)\n", "itertools.batched: added in Python 3.12"),
    ("import os.path\nos.path.splitroot('/a')\n", "os.path.splitroot: added"),
    ("raise ExceptionGroup('x', [])\n", "ExceptionGroup: added"),
    ("import distutils.util\n", "distutils: removed in Python 3.12"),
    ("from imp import reload\n", "imp: removed in Python 3.12"),
    ("import telnetlib\n", "telnetlib: removed in Python 3.13"),
    ("try:\n    pass\nexcept ValueError:\n    import cgi\n", "cgi: removed"),
    ("def f(x):\n    match x:\n        case 1:\n            pass\n", None),  # 3.10: allowed
    # Syntax an older parser refuses is told as not parsing; a newer one parses, then the
    # node is named (or its parser's feature_version check names it).
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", "except\\*|Exception groups|does not parse"),
    ("type Alias = int\n", "type statement|does not parse"),
    ("def first[T](xs: list[T]) -> T:\n    return xs[0]\n", "type parameters|does not parse"),
    ("x = f'{d[\"a\"]}'\n", None),  # another quote inside: any Python
    ("x = f'{d['a']}'\n", "f-string|does not parse"),
    ("x = 'a' f\"{d['k']}\"\n", None),  # the quote of the part holding the braces: any Python
    ("x = \"a\" f'{d['k']}'\n", "f-string|does not parse"),
    ("x = f\"{f'{d[\"k\"]}'}\"\n", "f-string|does not parse"),  # a nested one reuses its quote
    ("x = f'{\"\\\\n\".join(xs)}'\n", "f-string|does not parse"),
    ("a[*idx] = 1\n", "starred|does not parse"),
])
def test_a_planted_use_is_caught(source, what):
    """The negative control: what the minimum (3.10) lacks is named, with its line."""
    found = problems(source, "planted.py", (3, 10))
    if what is None:
        assert not found
    else:
        assert len(found) == 1 and re.search(what, found[0]), found
        assert found[0].startswith("planted.py:"), found


@pytest.mark.parametrize("source", [
    "try:\n    from datetime import UTC\nexcept ImportError:\n"
    "    from datetime import timezone\n    UTC = timezone.utc\n",
    "import datetime\ntry:\n    utc = datetime.UTC\nexcept AttributeError:\n"
    "    utc = datetime.timezone.utc\n",
    "import sys\nif sys.version_info >= (3, 11):\n    import tomllib\nelse:\n"
    "    import tomli as tomllib\n",
    "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n    from typing import Self\n",
    "try:\n    import imp\nexcept ModuleNotFoundError:\n    imp = None\n",
    "from datetime import datetime\nx = datetime.UTC\n",  # the class, not the module's name
    "import datetime\nx = datetime.timezone.utc\n",
])
def test_a_guarded_use_is_allowed(source):
    assert problems(source, "planted.py", (3, 10)) == []


def test_the_minimum_decides():
    assert problems("import tomllib\n", "planted.py", (3, 11)) == []
    assert problems("import imp\n", "planted.py", (3, 11))  # still in 3.11, gone in 3.12
    assert problems("import imp\n", "planted.py", (3, 12))  # and on every admitted Python
