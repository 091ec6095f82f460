"""Export directories: safetensors round trip, Hugging Face Llama export, bad input."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from model_utils import small_model, tokens
from tape_train.model import TransformerLM, from_pretrained, save_pretrained
from tape_train.inference.hf_export import save_hf


@pytest.mark.parametrize("pe, tie", [("tape", False), ("fire", False), ("rope", True)])
def test_export_then_load_gives_identical_logits(tmp_path, pe, tie):
    model = small_model(pe, dtype=torch.float32, tie_embeddings=tie)
    out = save_pretrained(model.state_dict(), model.cfg, tmp_path / "export",
                          provenance={"step": 7})
    loaded = from_pretrained(out)
    x = tokens()
    assert torch.equal(loaded(x).logits, model(x).logits)
    assert json.loads((out / "export.json").read_text())["step"] == 7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export.partial")]


def test_fp64_export_loads_without_rounding_through_fp32(tmp_path):
    model = small_model("tape")                                  # fp64, live TAPE weights
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights fp32 cannot hold (the model was initialised in fp32)
        for param in model.parameters():
            param.add_(1e-3 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    loaded = from_pretrained(save_pretrained(model.state_dict(), model.cfg, tmp_path / "e",
                                             dtype=torch.float64))
    assert loaded.embed.weight.dtype == torch.float64
    for name, param in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], param), name
    x = tokens()
    assert torch.equal(loaded(x).logits, model(x).logits)
    # Negative control: the same weights rounded to fp32 give measurably other fp64 logits.
    rounded = copy.deepcopy(model).to(torch.float32).to(torch.float64)
    assert (rounded(x).logits - model(x).logits).abs().max() > 1e-9


def test_bf16_export_halves_the_file_and_stays_close(tmp_path):
    model = small_model("tape", dtype=torch.float32)
    fp32 = save_pretrained(model.state_dict(), model.cfg, tmp_path / "fp32")
    bf16 = save_pretrained(model.state_dict(), model.cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(bf16) < 0.6 * size(fp32)
    loaded = from_pretrained(bf16, dtype=torch.float32)
    x = tokens()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=5e-2)


def test_hf_llama_export_loads_in_transformers_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = small_model("rope", dtype=torch.float32)
    out = save_hf(model.state_dict(), model.cfg, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, model(x).logits, rtol=0, atol=1e-5)


def test_mismatched_states_are_refused(tmp_path):
    tape = small_model("tape", dtype=torch.float32)
    rope = small_model("rope", dtype=torch.float32)
    with pytest.raises(ValueError, match="missing .*pos_update|unexpected .*pos_update"):
        save_pretrained(rope.state_dict(), tape.cfg, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(FileNotFoundError, match="not an exported model .missing model.safetensors"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_a_cuda_only_backend_of_the_training_run_does_not_follow_the_weights(tmp_path, backend):
    """A run trained with attn_backend=triton/flash on GPUs: its export loads and runs on CPU
    (the backend becomes auto); a device-neutral choice is kept."""
    model = small_model("tape", dtype=torch.float32)
    cfg = dataclasses.replace(model.cfg, attn_backend=backend)
    as_trained = TransformerLM(cfg)
    as_trained.load_state_dict(model.state_dict())
    with pytest.raises((RuntimeError, ValueError), match=f"attn_backend={backend}"):
        as_trained(tokens())  # what loading the config as it was saved would give on CPU
    loaded = from_pretrained(save_pretrained(model.state_dict(), cfg, tmp_path / "export"))
    assert loaded.cfg.attn_backend == "auto"
    torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits)
    kept = dataclasses.replace(model.cfg, attn_backend="eager")
    assert from_pretrained(save_pretrained(model.state_dict(), kept,
                                           tmp_path / "eager")).cfg.attn_backend == "eager"


def test_a_kill_while_replacing_an_export_never_leaves_a_half_deleted_one(tmp_path,
                                                                          monkeypatch):
    import shutil

    from tape_train.model import pretrained

    model = small_model("tape", dtype=torch.float32)
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"sentencepiece model")
    out = tmp_path / "export"
    save_pretrained(model.state_dict(), model.cfg, out, tokenizer=tokenizer,
                    provenance={"step": 1})
    complete = sorted(p.name for p in out.iterdir())
    assert pretrained.TOKENIZER in complete
    real_rmtree, victim = shutil.rmtree, pretrained.TOKENIZER

    def killed_midway(path, *args, **kwargs):  # deletes the tokenizer, then the process dies
        if (Path(path) / pretrained.WEIGHTS).is_file() and (Path(path) / victim).is_file():
            (Path(path) / victim).unlink()
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(pretrained.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(model.state_dict(), model.cfg, out, tokenizer=tokenizer,
                        provenance={"step": 2})
    # The directory that loads is complete: the new export with every file.
    assert sorted(p.name for p in out.iterdir()) == complete
    assert json.loads((out / pretrained.PROVENANCE).read_text())["step"] == 2
    from_pretrained(out)


def test_scratch_of_a_killed_export_is_removed_by_the_next_one(tmp_path):
    """A SIGKILLed export leaves .DIR.partial-<pid>-<hex> beside DIR; the next export to DIR
    removes it, but not the scratch of a live process (negative control)."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = tmp_path / f".export.partial-{dead.pid}-0123abcd"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".export.partial-{alive.pid}-89abcdef"
        busy.mkdir()
        model = small_model("rope", dtype=torch.float32)
        save_pretrained(model.state_dict(), model.cfg, tmp_path / "export")
        assert not abandoned.exists() and busy.is_dir()
    finally:
        alive.kill()
        alive.wait()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped weights": (lambda d: _flip(d / "model.safetensors"),
                        r"model.safetensors: tensor \S+ differs from the exported one \(sha256"),
    "flipped tokenizer": (lambda d: _flip(d / "tokenizer.model"),
                          "tokenizer.model: its sha256 differs from the exported file's"),
    "truncated weights": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:5000]),
        r"model.safetensors: cut short at 5000 of \d+ bytes: tensor \S+ ends past the end"),
    "tokenizer gone": (lambda d: (d / "tokenizer.model").unlink(),
                     r"tokenizer.model: missing \(export.json lists it"),
    "garbled config": (lambda d: (d / "config.json").write_text("{"),
                       "config.json: not valid JSON"),
    "config a list": (lambda d: (d / "config.json").write_text("[1]"),
                      "config.json: a JSON list, not an object"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_export_is_named_instead_of_loaded(tmp_path, damage):
    """export.json records the sha256 of every file and of every tensor: bytes changed on disk
    are refused naming the file and the tensor (they used to load and generate silently); a
    garbled config or a cut safetensors file is one line naming it, not a traceback."""
    from tape_train.inference.generate import main as generate
    from tape_train.loading import load_model

    model = small_model("tape", dtype=torch.float32)
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"sentencepiece model")
    out = save_pretrained(model.state_dict(), model.cfg, tmp_path / "export",
                          tokenizer=tokenizer)
    from_pretrained(out)  # negative control: as exported
    change, message = DAMAGE[damage]
    change(out)
    with pytest.raises(ValueError, match=message) as err:
        load_model(out)
    assert str(out) in str(err.value)
    assert generate([str(out), "--prompt", "x", "--device", "cpu"]) == 1


def test_exports_without_checksums_still_load_and_a_cut_one_is_named(tmp_path):
    """Exports written before checksums: nothing to compare, they load; a safetensors file cut
    short is then named by its parse error (safetensors' own error type, not a traceback)."""
    model = small_model("rope", dtype=torch.float32)
    out = save_pretrained(model.state_dict(), model.cfg, tmp_path / "export")
    info = json.loads((out / "export.json").read_text())
    assert set(info["integrity"]["files"]) == {"model.safetensors", "config.json"}
    del info["integrity"]
    (out / "export.json").write_text(json.dumps(info))
    from_pretrained(out)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        from_pretrained(out)


def test_exports_with_the_earlier_xxh3_checksums_are_still_checked(tmp_path):
    """Exports written before the integrity record carry the xxh3 of their weights."""
    from tape_train.checkpoint_layout import file_checksum

    model = small_model("rope", dtype=torch.float32)
    out = save_pretrained(model.state_dict(), model.cfg, tmp_path / "export")
    info = json.loads((out / "export.json").read_text())
    del info["integrity"]
    info.update(checksum="xxh3_64",
                checksums={"model.safetensors": file_checksum(out / "model.safetensors")})
    (out / "export.json").write_text(json.dumps(info))
    from_pretrained(out)
    _flip(out / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors is damaged: xxh3_64"):
        from_pretrained(out)


def test_an_export_holding_no_tensors_is_named(tmp_path):
    from safetensors.torch import save_file

    model = small_model("rope", dtype=torch.float32)
    out = save_pretrained(model.state_dict(), model.cfg, tmp_path / "export")
    (out / "export.json").unlink()                  # no checksums to refuse it first
    save_file({}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors: weights do not match .*config.json"):
        from_pretrained(out)


def test_an_export_missing_its_weights_is_named_as_an_export(tmp_path):
    from tape_train.loading import load_model

    model = small_model("rope", dtype=torch.float32)
    out = save_pretrained(model.state_dict(), model.cfg, tmp_path / "export")
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="not an exported model .missing model.safetensors"):
        load_model(out)  # not "no complete checkpoint under export/checkpoints"


@pytest.mark.parametrize("entry", ["x", {"size": 1, "tensors": "x"},
                                   {"size": 1, "tensors": {"a": 1}}])
def test_an_integrity_record_of_another_shape_is_one_error_not_a_traceback(tmp_path, entry):
    """An export.json whose integrity entries are not objects (edited by hand, another tool)
    raised AttributeError from the check; it is refused like any record this code cannot read,
    and so is an entry naming a path outside the export."""
    import json

    from tape_train.export_check import ExportDamagedError, verify

    (tmp_path / "model.safetensors").write_bytes(b"")
    for name, value in (("model.safetensors", entry), ("../outside", {"size": 0})):
        record = {"integrity": {"algorithm": "sha256", "files": {name: value}}}
        (tmp_path / "export.json").write_text(json.dumps(record))
        with pytest.raises(ExportDamagedError, match=r"record is not one this code reads "
                                                      r"\(the entry of "):
            verify(tmp_path)
