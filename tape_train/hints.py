"""Error-message helpers shared by every config module and command: did-you-mean suggestions,
named YAML configs (``configs/<kind>/<name>.yaml`` or a path), the type check of a config
dataclass's fields, and what to type when a command misses a required argument."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml


# The largest seed: NumPy's generators take no negative seed, torch's none past 64 bits, and
# the per-rank and per-sample streams derive their seeds from it by multiplying (train.seed,
# tape-generate --seed, tape-data prepare --seed, tape-tokenizer train --seed).
MAX_SEED = 2**32 - 1


def seed_error(name: str, value: int) -> str | None:
    """Why ``value`` cannot be the seed ``name`` (outside ``[0, MAX_SEED]``), else ``None``."""
    if 0 <= value <= MAX_SEED:
        return None
    return f"{name} must be in [0, {MAX_SEED}] (2**32 - 1), got {value}"


def utf8_error(flag: str, value: str | None) -> str | None:
    """Why the command-line text ``value`` of ``flag`` is not UTF-8 (bytes of another encoding
    reach Python as lone surrogates), naming the first bad character; else ``None``."""
    try:
        (value or "").encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        what = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        return f"{flag} is not valid UTF-8 text ({what} at character {exc.start}); pass UTF-8"
    return None


def empty_out_error(value: str, name_it: str) -> str | None:
    """An empty ``--out`` (an unset shell variable) would write into the current directory:
    the message says so and what to name (``name_it``); ``None`` when it is not empty."""
    if value.strip():
        return None
    return f"--out {value!r} is empty (an unset shell variable?): {name_it}"


def did_you_mean(value: object, choices: Iterable, prefix: str = "", cutoff: float = 0.6) -> str:
    """``" (did you mean '<prefix><closest>'?)"``, or ``""`` when nothing is close."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], 1, cutoff)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def choice_error(key: str, value: object, choices: Iterable[str]) -> str:
    """``"<key>=<value> is not one of a, b (did you mean 'a'?)"``."""
    choices = list(choices)
    return f"{key}={value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}"


def unknown_keys(unknown: Iterable, known: Iterable, prefix: str = "") -> str:
    """``"'<prefix>x' (did you mean '<prefix>y'?), '<prefix>z'"`` for the unknown keys."""
    known = sorted(str(k) for k in known)
    return ", ".join(f"'{prefix}{key}'{did_you_mean(key, known, prefix)}" for key in unknown)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the
    last silently: a second ``train:`` section would drop the first without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: its keys are merged in, and may be overridden here
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {first})",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, error: type[Exception]) -> tuple[str, object]:
    """``(text, data)`` of a YAML file; an unreadable or non-UTF-8 file, invalid YAML or a
    key given twice raise ``error`` naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not a UTF-8 text file (byte {exc.start}: "
                    f"{exc.object[exc.start:exc.start + 1]!r})") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return text, yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        line, problem = yaml_problem(exc, text)
        raise error(f"{path}{f':{line}' if line else ''}: not valid YAML: {problem}") from None


def yaml_problem(exc: yaml.YAMLError, text: str = "") -> tuple[int | None, str]:
    """``(line, message)`` of PyYAML's error in one line: the 1-based line it points at (or
    ``None``), and what it found there, the column, what it was parsing and where that began,
    with a hint for the usual causes (a tab indent, a key indented unlike its neighbours, an
    unquoted ``: `` in a value, an unclosed quote). PyYAML's own message is several lines
    with a caret under a copy of the line. ``text``: the YAML, to place a reader error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None)
    if not isinstance(exc, yaml.MarkedYAMLError) or mark is None or not problem:
        if isinstance(exc, yaml.reader.ReaderError):  # a control character, say
            if isinstance(exc.character, bytes):
                what = f"undecodable byte {exc.character!r}"
            else:
                what = f"unacceptable character #x{exc.character:04x}"
            if not text:
                return None, f"{what}: {exc.reason} (character {exc.position + 1})"
            column = exc.position - text.rfind("\n", 0, exc.position)
            return (text.count("\n", 0, exc.position) + 1,
                    f"{what}: {exc.reason} (column {column})")
        return None, " ".join(str(exc).replace('"<unicode string>"', "the text").split())
    if isinstance(exc, yaml.constructor.ConstructorError) and not getattr(exc, "context", None):
        return mark.line + 1, problem  # ours: "key 'x' given twice (first on line 2)"
    where = f"column {mark.column + 1}"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and (start.line, start.column) != (mark.line,
                                                                        mark.column):
        line_of = "" if start.line == mark.line else f"line {start.line + 1}, "
        where += f", {context} from {line_of}column {start.column + 1}"
    return mark.line + 1, f"{problem} ({where}){_yaml_hint(problem, context or '')}"


def _yaml_hint(problem: str, context: str) -> str:
    if "\\t" in problem or re.search(r"\btab\b", problem):
        return "; YAML indents with spaces, not tabs"
    if problem.startswith("expected <block end>"):
        return "; indent this line like the keys beside it, or under the key it belongs to"
    if problem.startswith("mapping values are not allowed"):
        return "; quote a value that holds ': ', or start a nested mapping on its own line"
    if "quoted scalar" in context and "escape" in problem:  # `"C:\data"`: the quote is closed
        return ("; a backslash inside double quotes starts an escape: double it, or use "
                "single quotes")
    if "quoted scalar" in context:
        return "; close the quote"
    if ("end of stream" in problem or "stream end" in problem) and "flow" in context:
        return "; close the bracket or brace"
    return ""


def example_on_missing(parser: argparse.ArgumentParser, example: str
                       ) -> argparse.ArgumentParser:
    """Make ``parser``'s "the following arguments are required" error end with a command that
    works (``example``) and a pointer to ``--help``: the first error a new user meets."""
    plain = parser.error

    def error(message: str):
        if message.startswith("the following arguments are required"):
            message += f"\n  e.g. {example}\n  ({parser.prog} --help lists every option)"
        plain(message)

    parser.error = error
    return parser


def read_named_yaml(name_or_path: str, directory: Path, kind: str,
                    error: type[Exception], missing: type[Exception] | None = None
                    ) -> tuple[Path, dict]:
    """``(path, mapping)`` of ``<directory>/<name>.yaml`` for a name without a suffix, else of
    the path. A name that no such file has but an existing file has (a YAML file saved without
    ``.yaml``) is that file: the named config comes first, as it always did.

    Raises ``missing`` (default ``error``) naming the path and the available names (the
    closest first) when the file does not exist, ``error`` naming the file for invalid YAML
    or a non-mapping.
    """
    if not str(name_or_path).strip():
        raise (missing or error)(f"{kind} config {name_or_path!r} is empty (an unset shell "
                                 f"variable?): give a named {kind} config or a YAML path")
    given = path = Path(name_or_path)
    if not path.suffix:
        path = directory / f"{name_or_path}.yaml"
        if not path.is_file() and given.is_file():
            path = given
    if not path.is_file():
        names = sorted(p.stem for p in directory.glob("*.yaml"))
        looked = f"{path}" + ("" if path == given else f" and the file {given}")
        what = ("is a directory, not a YAML file" if given.is_dir() else
                "is not a regular file (a device or a pipe?)" if given.exists() else "not found")
        raise (missing or error)(f"{kind} config {name_or_path!r} {what}"
                                 f"{did_you_mean(given.stem, names)}: looked for {looked}; "
                                 f"named {kind} configs: {', '.join(names)}")
    corpus = "".join(s for s in path.suffixes if s.lower() in _CORPUS_SUFFIXES)
    if corpus:
        raise error(f"{kind} config {name_or_path!r}: a {corpus} file is a corpus, not a {kind} "
                    f"config (YAML)" + (f"; name it in a data config's sources (`sources: "
                                        f"[{{path: {name_or_path}}}]`, e.g. configs/data/demo."
                                        f"yaml), or pass a prepared data directory"
                                        if kind == "data" else ""))
    data = read_yaml(path, error)[1] or {}
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    return path, data


# What a corpus file given where a YAML config belongs ends with (its read failed with "not
# valid YAML" on the first record's quote or brace, or parsed a line of text as a string).
_CORPUS_SUFFIXES = (".jsonl", ".txt", ".text", ".parquet", ".arrow", ".csv", ".tsv",
                    ".gz", ".zst", ".bz2", ".xz")


def check_field_types(obj: Any, section: str, error: type[Exception] = ValueError) -> None:
    """Check (and gently coerce) every field of dataclass ``obj`` against its annotation;
    ``error`` names ``<section>.<field>``, what it expects and what it got.

    Coercions: int → float for float fields; numeric strings such as ``"3e-4"`` → float (YAML
    1.1 reads ``3e-4`` as a string). Everything else must match exactly, bools are not ints.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, coerced = _conform(value, hints[f.name])
        if not ok:
            raise error(f"{section}.{f.name}: expected {_type_name(hints[f.name])}, got "
                        f"{value!r}" + _choice_hint(value, hints[f.name]))
        setattr(obj, f.name, coerced)


def finite_float(value: Any) -> float | None:
    """``value`` as a config float: a finite int, float or numeric string (``"3e-4"``: YAML
    1.1 reads ``3e-4`` as a string); ``None`` for anything else (bools, NaN, inf, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _conform(value: Any, hint: Any) -> tuple[bool, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        for arg in args:
            ok, coerced = _conform(value, arg)
            if ok:
                return True, coerced
        return False, value
    if origin is Literal:
        return value in args, value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        out = []
        for item in value:
            ok, coerced = _conform(item, args[0] if args else Any)
            if not ok:
                return False, value
            out.append(coerced)
        return True, out
    if hint is Any:
        return True, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:  # no config float means anything when infinite or NaN
        number = finite_float(value)
        return number is not None, (value if number is None else number)
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if hint is type(None):
        return "null"
    if hint is float:
        return "a finite number"
    return getattr(hint, "__name__", str(hint))


def _choice_hint(value: Any, hint: Any) -> str:
    choices = [a for a in typing.get_args(hint) if isinstance(a, str)]
    if typing.get_origin(hint) is Literal and isinstance(value, str):
        return did_you_mean(value, choices)
    return ""
