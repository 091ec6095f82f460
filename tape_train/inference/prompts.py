"""The prompts of ``tape-generate``: read and checked before the model loads. Torch-free.

``--prompt-file PATH`` (``-`` = standard input): the whole file, byte for byte decoded as
UTF-8, is one prompt. A UTF-8 byte-order mark starting a file (Windows editors write one) is
no part of its text, in either kind of file. ``--prompts PATH.jsonl``: one JSON object per
line with a ``"prompt"`` string; its other keys are copied to the output line. Every mistake is a ``PromptError``
naming the file and, where it applies, the line (``PATH:LINE: ...``).

Seeding: sample ``k`` of a prompt draws from a generator seeded with :func:`sample_seed`
``(seed, prompt text, k)``, so its completion is the same whichever other prompts the file
holds, in whatever order; the same prompt given twice gets the same completion (ask for
several with ``--num-samples``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tape_train.files import unwritable_reason
from tape_train.hints import did_you_mean, empty_out_error

STDIN = "-"
STDIN_NAME = "<stdin>"
# Keys tape-generate writes on each output line; an input line holding one is refused (its
# value would be overwritten without a word).
OUTPUT_KEYS = ("completion", "new_tokens", "finish", "sample")


class PromptError(ValueError):
    """A prompt file that cannot be used; ``str()`` is one line naming the file (and line)."""


@dataclass
class Prompt:
    record: dict  # the input object, written back with the completion
    where: str    # "PATH:LINE", for progress and errors

    @property
    def text(self) -> str:
        return self.record["prompt"]


def _source_name(path: str) -> str:
    return STDIN_NAME if path == STDIN else path


def _read_bytes(path: str, flag: str) -> bytes:
    """The file's bytes without a leading byte-order mark (it was the start of the prompt, or
    "not valid JSON" at line 1 of --prompts)."""
    return _read_raw(path, flag).removeprefix(codecs.BOM_UTF8)


def _read_raw(path: str, flag: str) -> bytes:
    if path == STDIN:
        if sys.stdin is None:
            raise PromptError(f"{flag} -: there is no standard input to read")
        if sys.stdin.isatty():
            print(f"tape-generate: reading {flag} from the terminal; end it with Ctrl-D",
                  file=sys.stderr)
        try:
            return sys.stdin.buffer.read()
        except OSError as exc:
            raise PromptError(f"{flag} -: cannot read standard input: "
                              f"{exc.strerror or exc}") from None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise PromptError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None


def _utf8(data: bytes, name: str, first_line: int = 1, what: str = "the file") -> str:
    """``data`` decoded as UTF-8; else a ``PromptError`` naming the line and the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        raise PromptError(f"{name}:{line}: not valid UTF-8 (byte offset {exc.start} of {what}: "
                          f"{data[exc.start:exc.start + 4]!r}); save it as UTF-8") from None


def read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file`` (all of it, a final newline included)."""
    data = _read_bytes(path, "--prompt-file")
    if not data:
        what = "standard input is empty (nothing was piped in)" if path == STDIN else \
            "empty (the prompt is the whole file)"
        raise PromptError(f"--prompt-file {path}: {what}")
    return _utf8(data, _source_name(path))


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    record: dict = {}
    for key, value in pairs:
        if key in record:  # json keeps the last silently
            raise _RepeatedKey(f"key {key!r} given twice")
        record[key] = value
    return record


def _prompt_record(line: str, where: str) -> dict:
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise PromptError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except _RepeatedKey as exc:
        raise PromptError(f"{where}: {exc}") from None
    if not isinstance(record, dict):
        raise PromptError(f'{where}: a JSON {_json_type(record)}, not an object with a '
                          f'"prompt" string')
    if "prompt" not in record:
        keys = ", ".join(repr(key) for key in record) or "no keys"
        raise PromptError(f'{where}: no "prompt" key (the object has {keys})'
                          f'{did_you_mean("prompt", record)}')
    text = record["prompt"]
    if not isinstance(text, str):
        raise PromptError(f'{where}: "prompt" is a JSON {_json_type(text)}, not a string')
    try:  # a JSON escape such as "\ud800" is a lone surrogate, which no tokenizer encodes
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f'{where}: "prompt" holds a lone surrogate ({text[exc.start]!r}) at '
                          f'character {exc.start}, which is not text') from None
    taken = [key for key in OUTPUT_KEYS if key in record]
    if taken:
        raise PromptError(f"{where}: key {taken[0]!r} is one tape-generate writes "
                          f"({', '.join(OUTPUT_KEYS)}); rename it in the input")
    return record


def read_prompts(path: str) -> list[Prompt]:
    """The prompts of a ``--prompts`` JSONL file, in order; blank lines are skipped."""
    data = _read_bytes(path, "--prompts")
    name = _source_name(path)
    prompts = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{name}:{number}"
        line = _utf8(raw, name, first_line=number, what="the line")
        prompts.append(Prompt(_prompt_record(line, where), where))
    if not prompts:
        raise PromptError(f'--prompts {path}: no prompts in it (one JSON object per line, '
                          f'e.g. {{"id": 1, "prompt": "The Python interpreter"}})')
    return prompts


def check_out(out: str, prompts_path: str) -> None:
    """``--out`` of ``--prompts`` can be written, and is not the input (checked before the
    model loads, not after sampling every prompt)."""
    if out == STDIN:
        return
    problem = empty_out_error(out, "name the JSONL file to write, or - for standard output")
    if problem:
        raise PromptError(problem)
    target = Path(out)
    if target.is_dir():
        raise PromptError(f"--out {out}: is a directory; name the JSONL file to write")
    if target.exists() and not target.is_file():  # renaming onto it would replace the node
        raise PromptError(f"--out {out}: is not a regular file (a device or a pipe?); name "
                          f"the JSONL file to write, or - for standard output")
    if prompts_path != STDIN and target.exists() and os.path.samefile(target, prompts_path):
        raise PromptError(f"--out {out}: is the --prompts file; write the completions to "
                          f"another file")
    reason = unwritable_reason(target.parent)
    if reason is not None:
        raise PromptError(f"--out {out}: {reason}")


def sample_seed(seed: int, prompt: str, sample: int) -> int:
    """The seed of sample ``sample`` of ``prompt`` under ``--seed seed``: a 63-bit hash of
    the three, stable across processes and machines (not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{seed}\0{sample}\0{prompt}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def output_line(record: dict, completion: str, new_tokens: int, finish: str,
                sample: int | None) -> str:
    """One line of ``--out``: the input object with the completion's keys added."""
    result = {**record, "completion": completion, "new_tokens": new_tokens, "finish": finish}
    if sample is not None:
        result["sample"] = sample
    line = json.dumps(result, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in a passed-through key: keep it escaped
        line = json.dumps(result)
    return line + "\n"
