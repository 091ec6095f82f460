"""Self-contained exported models: ``save_pretrained`` / ``from_pretrained``, no DeepSpeed.

An export directory holds:
    model.safetensors   consolidated weights (fp32 or bf16), our parameter names
    config.json         the ModelConfig
    tokenizer.model     the sentencepiece model the weights were trained with (if known)
    export.json         provenance: source checkpoint, step, tokens seen, dtype

Hugging Face directories (every encoding) are written by ``tape_train.inference.hf_export``.
Directories are written to a temporary sibling and renamed (an old one is renamed aside
first and deleted last), so a partial or half-deleted export never looks complete; they get the permissions of ordinary files and directories (the umask), not
``mkdtemp``'s private 0700.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from tape_train.files import fsync_dir, fsync_tree, remove_abandoned_scratch
from tape_train.model.config import ModelConfig
from tape_train.model.transformer import TransformerLM

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.model"
PROVENANCE = "export.json"


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` with the process umask applied: what ``open()`` would create."""
    try:
        with open("/proc/self/status") as fh:  # reads the umask without changing it
            for line in fh:
                if line.startswith("Umask:"):
                    return mode & ~int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return mode & ~current


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file of ``state``; safetensors creates it 0600, we give it the umask's mode
    so others can read an export on a shared cluster as they can any file."""
    import re

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        # Its I/O errors are strings ("... No space left on device (os error 28)"): give them
        # back their errno, so that a full disk or a file-size limit is named like any other.
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from exc
    os.chmod(path, umask_mode())


def check_export_target(out_dir: str | os.PathLike) -> None:
    """Raise ``FileExistsError`` unless ``out_dir`` may be replaced by an export: it is absent,
    an empty directory, or an earlier export (it holds ``export.json``). Anything else would
    be deleted by the replacement. The current directory, one that holds it, and a path that
    ends in ``.`` or ``..`` cannot be renamed into place (or out of it) at all."""
    given = str(out_dir)
    out_dir = Path(out_dir)
    resolved = Path(os.path.abspath(out_dir))
    if resolved == Path.cwd() or resolved in Path.cwd().parents:
        raise FileExistsError(f"{given or repr(given)} is the current directory or holds it; an "
                              f"export replaces its directory, so choose a new or empty one "
                              f"below it, e.g. --out exports/<name>")
    if out_dir.name in ("", ".", ".."):
        raise FileExistsError(f"{given}: name the directory itself ({resolved}), not a path "
                              f"ending in {out_dir.name or '.'}")
    if not out_dir.exists() and not out_dir.is_symlink():
        _check_export_parent(out_dir)
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose another --out")
    if (out_dir / PROVENANCE).is_file() or not any(out_dir.iterdir()):
        _check_export_parent(out_dir)
        return
    raise FileExistsError(f"{out_dir} is a non-empty directory that is not an export (no "
                          f"{PROVENANCE}); an export replaces its directory, so choose an "
                          f"empty or new --out")


def _check_export_parent(out_dir: Path) -> None:
    """Raise ``OSError`` naming the path unless the export's scratch sibling can be made
    beside ``out_dir``: its nearest existing ancestor must be a directory this process can
    write in (probed with a temporary file, removed at once)."""
    import tempfile

    from tape_train.files import nearest_existing

    existing = nearest_existing(out_dir.parent)
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is a file, so --out {out_dir} cannot be created "
                                 f"under it; choose another --out")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=f".{out_dir.name}.probe-"):
            pass
    except OSError as exc:
        raise OSError(f"cannot write in {existing}, where --out {out_dir} goes: "
                      f"{exc.strerror or exc}") from exc


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a fresh sibling directory, then rename it to ``out_dir``
    (which ``check_export_target`` must allow: an earlier export is replaced).

    An existing ``out_dir`` is renamed aside first and deleted only after the new one is in
    place: deleting it in place would let a kill leave a half-deleted directory that still
    loads (weights and config, no tokenizer)."""
    out_dir = Path(out_dir)
    check_export_target(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_scratch(out_dir.parent, f".{out_dir.name}.partial-")  # killed exports
    if out_dir.exists():  # else the one kept aside may be the only copy: leave it
        remove_abandoned_scratch(out_dir.parent, f".{out_dir.name}.replaced-")
    suffix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out_dir.parent / f".{out_dir.name}.partial-{suffix}"
    old = out_dir.parent / f".{out_dir.name}.replaced-{suffix}"
    tmp.mkdir()  # mode 0777 & ~umask, like any directory the user creates
    try:
        write(tmp)
        fsync_tree(tmp)
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.replace(old, out_dir)  # the new one never took its place: keep the old one
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_integrity(out_dir: Path) -> dict:
    """``{"integrity": {...}}`` for ``export.json``: the size and sha256 of every file of
    ``out_dir`` and of every tensor of its safetensors files
    (``tape_train/export_check.py``, the one place that writes and checks
    it; it is copied into every ``--hf`` export, whose remote code checks it too)."""
    from tape_train.export_check import KEY, describe

    return {KEY: describe(out_dir)}


def verify_export(path: Path) -> None:
    """Raise ``ValueError`` naming the first file (and tensor) of an export that differs
    from its ``export.json``. Exports written before the integrity record carry the xxh3 of
    the weights and the tokenizer (``checksums``), compared instead; those written before
    checksums, or without ``export.json``, have nothing to compare."""
    from tape_train.checkpoint_layout import CHECKSUM, file_checksum
    from tape_train.export_check import verify

    if verify(path):
        return
    try:
        info = json.loads((path / PROVENANCE).read_text())
    except FileNotFoundError:
        return
    sums = info.get("checksums") if isinstance(info, dict) else None
    if not isinstance(sums, dict):
        return
    for name, expected in sorted(sums.items()):
        if not (path / name).is_file():  # left out on purpose (--tokenizer given instead)
            continue
        actual = file_checksum(path / name)
        if actual != expected:
            raise ValueError(f"{path / name} is damaged: {info.get('checksum', CHECKSUM)} "
                             f"{actual}, {expected} was exported (bytes changed on disk or in "
                             f"transit); re-export the model")


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): store contiguous copies.
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().clone()
            for k, v in state.items()}


def save_pretrained(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
                    dtype: torch.dtype = torch.float32, tokenizer: str | Path | None = None,
                    provenance: dict | None = None,
                    extra: Callable[[Path], None] | None = None) -> Path:
    """Write an export directory from a (consolidated) state dict; ``extra(dir)`` may add
    files before the directory is published."""
    model_keys = set(parameter_names(cfg))
    if set(state) != model_keys:
        missing, extra = sorted(model_keys - set(state)), sorted(set(state) - model_keys)
        raise ValueError(f"state dict does not match the model config: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    if cfg.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}

    def write(tmp: Path) -> None:
        save_weights(cast_state(state, dtype), tmp / WEIGHTS)
        (tmp / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        if extra is not None:  # before export.json: its record covers every file
            extra(tmp)
        info = {"dtype": str(dtype).removeprefix("torch."), **(provenance or {}),
                **export_integrity(tmp)}
        (tmp / PROVENANCE).write_text(json.dumps(info, indent=2, default=str) + "\n")

    return write_dir_atomically(Path(out_dir), write)


def parameter_names(cfg: ModelConfig) -> list[str]:
    """Parameter names of ``TransformerLM(cfg)``, without allocating it."""
    with torch.device("meta"):
        return list(TransformerLM(cfg).state_dict().keys())


def weights_mismatch(state: dict[str, torch.Tensor], cfg: ModelConfig) -> str | None:
    """Why ``state`` does not load into ``TransformerLM(cfg)`` (names missing or unexpected,
    shapes that differ), in one line; ``None`` when it does. Nothing is allocated."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in TransformerLM(cfg).state_dict().items()}
    missing = [k for k in want if k not in state
               and not (cfg.tie_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in want]
    shapes = [f"{k} {list(state[k].shape)} where the config makes {list(want[k])}"
              for k in want if k in state and tuple(state[k].shape) != want[k]]
    parts = [f"{len(found)} {what} ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})"
             for what, found in (("missing", missing), ("unexpected", unexpected),
                                 ("of another shape", shapes)) if found]
    return "; ".join(parts) or None


def from_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> TransformerLM:
    """Load an export directory written by :func:`save_pretrained` (or ``tape-export``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path}: not an exported model (missing {name}); "
                                    f"create one with `tape-export <checkpoint> --out {path}`")
    try:
        data = json.loads((path / CONFIG).read_text())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"{path / CONFIG}: not valid JSON ({exc}); re-export the model") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path / CONFIG}: a JSON {type(data).__name__}, not an object; "
                         f"re-export the model")
    if "architectures" in data or "model_type" in data:  # written by `tape-export --hf`
        raise ValueError(f"{path}: a Hugging Face export (`tape-export --hf`), read by "
                         f"transformers' from_pretrained (trust_remote_code=True for an "
                         f"encoding other than rope), not by tape_train; for tape-generate "
                         f"export without --hf or pass the checkpoint")
    cfg = ModelConfig.from_dict(data, source=str(path / CONFIG)).for_any_device()
    verify_export(path)
    try:
        state = load_file(str(path / WEIGHTS), device=str(device))
    except SafetensorError as exc:
        raise ValueError(f"{path / WEIGHTS}: not a readable safetensors file, damaged or cut "
                         f"short ({type(exc).__name__}: {exc}); re-export the model") from exc
    problem = weights_mismatch(state, cfg)
    if problem:
        raise ValueError(f"{path / WEIGHTS}: weights do not match {path / CONFIG}: {problem}")
    if dtype is None:  # the export's own
        dtype = next(iter(state.values())).dtype if state else torch.float32
    with torch.device(device):
        # In the final dtype before the weights are copied in: an fp64 export loaded into
        # fp32 parameters first would be rounded to fp32 on the way.
        model = TransformerLM(cfg).to(dtype)
    model.load_state_dict(state, strict=False)
    return model.eval()
