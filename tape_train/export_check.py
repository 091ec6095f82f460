"""What an export holds, recorded in its ``export.json`` and checked before its weights load.

Standalone (the standard library only): ``tape-export`` copies this file into every
``--hf`` directory, where the remote code's ``modeling_tape.py`` calls it from
``from_pretrained`` and ``python export_check.py DIR`` runs it by hand (a RoPE export loads
as transformers' own ``LlamaForCausalLM``, which checks nothing); tape-train's own loaders
import it from its package.

``export.json["integrity"]``::

    {"algorithm": "sha256",
     "files": {"config.json": {"size": 812, "sha256": "…"},
               "model.safetensors": {"size": 1234, "tensors":
                   {"embed.weight": {"dtype": "F32", "shape": [97, 64], "sha256": "…"}, …}}}}

A safetensors file is recorded per tensor (each tensor's bytes hashed, once, in file order), so
a tensor removed, renamed, reshaped or with bytes changed is named; other files whole. The
small JSON settings users edit on purpose (``EDITABLE``: ``use_cache``, generation defaults, a
chat template) need only be present: their parsers and the weights' shapes check them. Files
not listed (a README added later) are not checked; ``export.json`` itself is not listed.
"""

import hashlib
import json
import os
import struct
import sys

PROVENANCE = "export.json"
KEY = "integrity"
ALGORITHM = "sha256"
_CHUNK = 8 << 20
EDITABLE = ("config.json", "generation_config.json", "tokenizer_config.json",
            "special_tokens_map.json")


class ExportDamagedError(ValueError):
    """An export whose files differ from what its ``export.json`` records."""


def _digest_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _header(path, size):
    """The safetensors header of ``path`` (``size`` bytes): (tensor entries, data start).
    Raises ``ExportDamagedError`` when it cannot be read."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ExportDamagedError(f"{path}: {size} bytes, too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ExportDamagedError(f"{path}: cut short, its safetensors header ({length} bytes) "
                                     f"does not fit in the file's {size} bytes")
        try:
            entries = json.loads(fh.read(length))
        except ValueError as exc:
            raise ExportDamagedError(f"{path}: the safetensors header is not valid JSON "
                                     f"({exc})") from exc
    if not isinstance(entries, dict):
        raise ExportDamagedError(f"{path}: the safetensors header is not a JSON object")
    entries.pop("__metadata__", None)
    for name, entry in entries.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ExportDamagedError(f"{path}: tensor {name}: no valid data_offsets in the "
                                     f"safetensors header")
    return entries, 8 + length


def _tensor_digests(path, entries, start):
    """{name: sha256 of its bytes}, reading the file once in offset order."""
    out = {}
    with open(path, "rb") as fh:
        for name, entry in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            fh.seek(start + begin)
            h, left = hashlib.sha256(), end - begin
            while left:
                block = fh.read(min(left, _CHUNK))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            out[name] = h.hexdigest()
    return out


def describe(directory):
    """The ``integrity`` record of every regular file in ``directory`` but ``export.json``."""
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == PROVENANCE or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        if name.endswith(".safetensors"):
            entries, start = _header(path, size)
            digests = _tensor_digests(path, entries, start)
            files[name] = {"size": size, "tensors": {
                t: {"dtype": entries[t].get("dtype"), "shape": entries[t].get("shape"),
                    "sha256": digests[t]} for t in sorted(entries)}}
        else:
            files[name] = {"size": size, "sha256": _digest_file(path)}
    return {"algorithm": ALGORITHM, "files": files}


def _refuse(path, what):
    raise ExportDamagedError(f"{path}: {what}; re-export the model or copy it again")


def _check_safetensors(path, expected, size):
    tensors = expected.get("tensors") or {}
    try:
        entries, start = _header(path, size)
    except ExportDamagedError as exc:
        _refuse(path, f"{str(exc).removeprefix(f'{path}: ')} ({expected.get('size')} bytes "
                      f"were exported)")
    missing = [t for t in tensors if t not in entries]
    if missing:
        _refuse(path, f"tensor {missing[0]} is missing"
                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [t for t in entries if t not in tensors]
    if unexpected:
        _refuse(path, f"tensor {unexpected[0]} was not exported")
    for name, want in tensors.items():
        got = entries[name]
        for field in ("dtype", "shape"):
            if got.get(field) != want.get(field):
                _refuse(path, f"tensor {name} has {field} {got.get(field)}, "
                              f"{want.get(field)} was exported")
        if start + got["data_offsets"][1] > size:
            _refuse(path, f"cut short at {size} of {expected.get('size')} bytes: tensor {name} "
                          f"ends past the end of the file")
    if size != expected.get("size"):
        _refuse(path, f"{size} bytes, {expected.get('size')} were exported")
    digests = _tensor_digests(path, entries, start)
    for name in sorted(tensors, key=lambda t: entries[t]["data_offsets"][0]):
        if digests[name] != tensors[name].get("sha256"):
            _refuse(path, f"tensor {name} differs from the exported one ({ALGORITHM} "
                          f"{digests[name]}, {tensors[name].get('sha256')} was exported: bytes "
                          f"changed on disk or in transit)")


def verify(directory):
    """Raise ``ExportDamagedError`` naming the first file (and tensor) of ``directory`` that
    differs from its ``export.json``. Returns False when there is no ``integrity`` record
    to check against (no ``export.json``, or one written before it), True when all matched."""
    info_path = os.path.join(directory, PROVENANCE)
    try:
        with open(info_path, "rb") as fh:
            info = json.loads(fh.read())
    except FileNotFoundError:
        return False
    except ValueError as exc:
        raise ExportDamagedError(f"{info_path}: not valid JSON ({exc}); re-export the "
                                 f"model or copy it again") from exc
    record = info.get(KEY) if isinstance(info, dict) else None
    if record is None:
        return False
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM \
            or not isinstance(record.get("files"), dict):
        raise ExportDamagedError(f"{info_path}: its {KEY!r} record is not one this code reads "
                                 f"(algorithm {ALGORITHM}, a 'files' object); re-export the model")
    for name, expected in sorted(record["files"].items()):
        tensors = expected.get("tensors", {}) if isinstance(expected, dict) else None
        if (not isinstance(tensors, dict) or os.path.basename(name) != name
                or name in ("", ".", "..")
                or not all(isinstance(t, dict) for t in tensors.values())):
            raise ExportDamagedError(f"{info_path}: its {KEY!r} record is not one this code "
                                     f"reads (the entry of {name!r}); re-export the model")
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            _refuse(path, f"missing ({PROVENANCE} lists it: the export is incomplete)")
        size = os.path.getsize(path)
        if name in EDITABLE:
            continue
        if "tensors" in expected:
            _check_safetensors(path, expected, size)
        elif size != expected.get("size"):
            _refuse(path, f"{size} bytes, {expected.get('size')} were exported")
        elif _digest_file(path) != expected.get("sha256"):
            _refuse(path, f"its {ALGORITHM} differs from the exported file's (bytes changed on "
                          f"disk or in transit)")
    return True


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {os.path.basename(sys.argv[0])} EXPORT_DIR")
    try:
        checked = verify(sys.argv[1])
    except (ExportDamagedError, OSError) as exc:
        sys.exit(f"error: {exc}")
    print(f"{sys.argv[1]}: every file matches {PROVENANCE}" if checked else
          f"{sys.argv[1]}: nothing to check against (no {KEY!r} record in {PROVENANCE})")
