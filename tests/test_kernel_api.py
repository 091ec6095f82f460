"""The fused kernel's Python surface: availability, input validation, lazy Triton import."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tape_train.kernels import tape_attention_triton, triton_available

REPO = Path(__file__).resolve().parents[1]


def _inputs(shape=(1, 2, 8, 32), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(5)]


def test_package_import_does_not_import_triton():
    code = "import sys, tape_train.kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_triton_available_on_cpu_only_with_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available("cpu") == (importlib.util.find_spec("triton") is not None)


def test_cpu_without_interpreter_raises_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        tape_attention_triton(*_inputs())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x: x.__setitem__(slice(0, 5), [torch.randn(1, 2, 8, 48)] * 5), "head dim 48"),
        (lambda x: x.__setitem__(1, torch.randn(1, 2, 9, 32)), "k has shape"),
        (lambda x: x.__setitem__(2, x[2].half()), "dtypes differ"),
        (lambda x: x.__setitem__(3, x[3].half()), "e0 dtype"),
        (lambda x: x.__setitem__(4, torch.randn(2, 8, 32)), r"e1 must be \(b, M, N, D\)"),
        (lambda x: x.__setitem__(0, x[0].to(torch.int32)), "q dtype"),
    ],
)
def test_bad_inputs_name_the_argument(mutate, message):
    inputs = _inputs()
    mutate(inputs)
    with pytest.raises(ValueError, match=message):
        tape_attention_triton(*inputs)


def test_broadcast_e_passes_validation(monkeypatch):
    """Layer-0 tables with batch dim 1 are accepted (validation happens before availability)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, e0, e1 = _inputs((2, 2, 8, 32))
    with pytest.raises(RuntimeError, match="cannot run"):
        tape_attention_triton(q, k, v, e0[:1], e1[:1])
