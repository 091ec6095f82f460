"""The pins of pyproject.toml can be installed together from PyPI (`make demo`'s install)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib  # Python >= 3.11
except ImportError:  # Python 3.10: the same parser as the tomli package (the test extra)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# What PyPI's wheels of a torch release require of Triton (their metadata: `triton==X;
# platform_system == "Linux"`). PyTorch's CPU build requires none. A new torch pin: add its line.
TORCH_TRITON = {"2.13.0": "3.7.1"}


def _dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {req.name: req for req in map(Requirement, project["dependencies"])}


def test_the_triton_requirement_admits_the_one_of_the_pinned_torch():
    deps = _dependencies()
    (pin,) = deps["torch"].specifier
    assert pin.operator == "==", f"torch is pinned exactly, got {deps['torch']}"
    assert pin.version in TORCH_TRITON, (f"torch=={pin.version}: add the Triton version its "
                                         f"PyPI wheels require to TORCH_TRITON")
    triton = deps["triton"].specifier
    assert triton.contains(TORCH_TRITON[pin.version]), (
        f"{deps['triton']} excludes triton=={TORCH_TRITON[pin.version]}, which PyPI's "
        f"torch=={pin.version} requires: pip cannot install the project from PyPI")
    assert triton.contains(metadata.version("triton"))  # the Triton the tests run here
    assert not triton.contains("9.0"), "an upper bound keeps an untested Triton out"
