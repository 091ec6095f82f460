"""Where the shipped YAML configs, tokenizer specs and Slurm templates live.

In a source checkout (editable install) they are the repository's ``configs/``,
``tokenizer/`` and ``launch/slurm/``; a wheel carries the same files as package data under
``tape_train/_resources/`` (mapped in pyproject.toml). One function resolves both, so named
configs (``--config demo``, ``base: tiny``, ``tape-model info tiny``) and ``tape-submit``'s
templates work from any directory after any kind of install.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# resource name -> directory relative to the repository root (source checkout); setup.py
# copies each into the wheel as tape_train/_resources/<name with "/" as "_">
SOURCE_DIRS = {
    **{f"configs/{kind}": f"configs/{kind}"
       for kind in ("model", "data", "train", "experiments", "lm_eval")},
    "tokenizer": "tokenizer",
    "slurm": "launch/slurm",
}


def resource_dir(name: str) -> Path:
    """The directory of resource ``name`` (a key of ``SOURCE_DIRS``): the packaged copy when
    installed from a wheel, else the source tree's."""
    if name not in SOURCE_DIRS:
        raise KeyError(f"unknown resource {name!r}; known: {', '.join(SOURCE_DIRS)}")
    packaged = _PACKAGE / "_resources" / name.replace("/", "_")
    if packaged.is_dir():
        return packaged
    return _PACKAGE.parent / SOURCE_DIRS[name]


def named_file(name_or_path: str | Path, resource: str, suffix: str = ".yaml") -> Path:
    """``name_or_path`` itself when it is an existing file or has a suffix, else
    ``<resource_dir(resource)>/<name><suffix>`` (so ``demo`` finds ``configs/train/demo.yaml``)."""
    path = Path(name_or_path)
    if path.is_file() or path.suffix or len(path.parts) > 1:
        return path
    return resource_dir(resource) / f"{path.name}{suffix}"
