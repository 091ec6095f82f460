"""`tape-export --hf`: every encoding loads with AutoModelForCausalLM and computes what
tape-train computes (logits, KV-cache decoding, generate, batched padded generate)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_utils import small_model, tokens
from tape_train.inference.hf_export import REMOTE_CODE_DIR, REMOTE_FILES, save_hf
from tape_train.model.config import POSITIONAL_ENCODINGS

transformers = pytest.importorskip("transformers")


# transformers 5 renamed from_pretrained's torch_dtype to dtype
_DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


# The cache's name in forward() and its outputs: ``cache`` from transformers 5.24 on.
_CACHE = ("cache" if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
          else "past_key_values")


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, **{_DTYPE_KW: torch.float32}).eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for pe in POSITIONAL_ENCODINGS:
        model = small_model(pe, dtype=torch.float32, tie_embeddings=pe == "alibi")
        out[pe] = (model, save_hf(model.state_dict(), model.cfg, root / pe))
    return out


@pytest.mark.parametrize("pe", POSITIONAL_ENCODINGS)
def test_logits_and_kv_cache_equal_tape_train(exports, pe):
    model, path = exports[pe]
    hf = _load(path)
    assert type(hf).__name__ == ("LlamaForCausalLM" if pe == "rope" else "TapeForCausalLM")
    x = tokens()
    with torch.no_grad():
        full = hf(input_ids=x).logits
        torch.testing.assert_close(full, model(x).logits, rtol=0, atol=1e-5)
        out = hf(input_ids=x[:, :9], use_cache=True)
        steps, cache = [out.logits], out[_CACHE]
        for i in range(9, x.shape[1]):
            out = hf(input_ids=x[:, i:i + 1], use_cache=True, **{_CACHE: cache})
            steps.append(out.logits)
            cache = out[_CACHE]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pe", ["tape", "t5", "fire"])
def test_generate_equals_tape_train_and_batched_padding_changes_nothing(exports, pe):
    model, path = exports[pe]
    hf = _load(path)
    prompts = [tokens(1, 7, seed=1)[0], tokens(1, 4, seed=2)[0]]
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    singles = []
    for p in prompts:
        ours = model.generate(p[None], max_new_tokens=8)
        theirs = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), **greedy)
        assert torch.equal(theirs[0], ours[0])
        singles.append(theirs[0, len(p):])
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):  # left padding
        batch[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    batched = hf.generate(batch, attention_mask=mask, **greedy)
    for i, new in enumerate(singles):
        assert torch.equal(batched[i, width:], new)


@pytest.mark.parametrize("pe", ["tape", "fire"])
def test_padded_batches_give_each_rows_own_logits(exports, pe):
    """Rows of different lengths, left- or right-padded, with the attention mask: every real
    token's logits are tape-train's on that row alone (the greedy tokens above would hide a
    small error), and so are left-padded incremental decoding's with a growing mask."""
    model, path = exports[pe]
    hf = _load(path)
    rows = [tokens(1, n, seed=n)[0] for n in (11, 4, 16)]
    width = max(len(r) for r in rows)
    with torch.no_grad():
        alone = [model(r[None]).logits[0] for r in rows]
        for left in (True, False):
            batch = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros_like(batch)
            spans = [slice(width - len(r), width) if left else slice(0, len(r)) for r in rows]
            for i, (r, span) in enumerate(zip(rows, spans)):
                batch[i, span], mask[i, span] = r, 1
            logits = hf(input_ids=batch, attention_mask=mask).logits
            for i, span in enumerate(spans):
                torch.testing.assert_close(logits[i, span], alone[i], rtol=0, atol=1e-5)
            if left:
                out = hf(input_ids=batch[:, :9], attention_mask=mask[:, :9], use_cache=True)
                steps, cache = [out.logits], out[_CACHE]
                for t in range(9, width):
                    out = hf(input_ids=batch[:, t:t + 1], attention_mask=mask[:, :t + 1],
                             use_cache=True, **{_CACHE: cache})
                    steps.append(out.logits)
                    cache = out[_CACHE]
                decoded = torch.cat(steps, dim=1)
                for i, span in enumerate(spans):
                    torch.testing.assert_close(decoded[i, span], alone[i], rtol=0, atol=1e-5)
                # Negative control: without the mask the padded rows see the pads.
                unmasked = hf(input_ids=batch).logits
                assert (unmasked[1, spans[1]] - alone[1]).abs().max() > 1e-4


@pytest.mark.slow
def test_remote_code_loads_without_tape_train(exports):
    _, path = exports["tape"]
    for name in REMOTE_FILES:  # as the export holds them
        assert "tape_train" not in (path / name).read_text().replace(
            "tape-train", "")
    code = ("import sys; sys.modules['tape_train'] = None\n"
            "import torch, transformers\n"
            f"m = transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}, "
            "trust_remote_code=True)\n"
            "print(type(m).__name__, m(torch.tensor([[1, 2, 3]])).logits.shape)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=path.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TapeForCausalLM torch.Size([1, 3, 97])" in proc.stdout


def test_export_is_readable_by_others_under_a_normal_umask(tmp_path):
    model = small_model("tape", dtype=torch.float32)
    old = os.umask(0o022)
    try:
        out = save_hf(model.state_dict(), model.cfg, tmp_path / "shared")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tape.TapeForCausalLM"
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_config_records_what_transformers_needs(exports):
    rope = json.loads(Path(exports["rope"][1], "config.json").read_text())
    assert rope["model_type"] == "llama" and "auto_map" not in rope
    assert not (exports["rope"][1] / "modeling_tape.py").exists()
    tape = json.loads(Path(exports["tape"][1], "config.json").read_text())
    assert tape["model_type"] == "tape_lm" and tape["pe"] == "tape"


def test_hidden_states_are_returned_as_llama_does_and_attentions_are_refused(exports):
    """output_hidden_states=True gave hidden_states=None and output_attentions=True gave
    attentions=None, silently: the first now returns Llama's tuple (embeddings, each block's
    output, the last normed), the second is refused (SDPA computes no attention weights)."""
    x = tokens()
    with torch.no_grad():
        llama = _load(exports["rope"][1])(input_ids=x, output_hidden_states=True)
        hf = _load(exports["tape"][1])
        out = hf(input_ids=x, output_hidden_states=True)
        assert len(out.hidden_states) == len(llama.hidden_states) == hf.config.num_hidden_layers + 1
        assert torch.equal(out.hidden_states[0], hf.embed(x))
        torch.testing.assert_close(hf.lm_head(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-6)
        assert hf(input_ids=x).hidden_states is None  # only when asked for
        with pytest.raises(ValueError, match="output_attentions=True is not supported"):
            hf(input_ids=x, output_attentions=True)


def test_position_ids_are_checked_against_the_attention_mask(exports):
    """position_ids were ignored: an offset gave the logits of positions 0, 1, ... silently.
    Those generate() passes in transformers 4.x (cumsum of the mask, 1 on padding) agree with
    the model's own and are accepted; any other is refused."""
    hf = _load(exports["tape"][1])
    x = tokens(2, 6)
    mask = torch.ones_like(x)
    mask[1, :2] = 0  # left padding
    counted = mask.cumsum(-1) - 1
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask).logits
        got = hf(input_ids=x, attention_mask=mask,
                 position_ids=counted.masked_fill(mask == 0, 1)).logits
        assert torch.equal(got, want)
        for bad in (counted + 3, torch.arange(6)[None].expand(2, -1), counted[:, :4]):
            with pytest.raises(ValueError, match="position_ids that differ from the positions"):
                hf(input_ids=x, attention_mask=mask, position_ids=bad)


def test_an_attention_mask_shorter_than_the_cache_is_named(exports):
    """A mask of the new tokens only, in a hand-written decoding loop, failed deep inside
    (a torch.cat size error): it is named, with the columns needed."""
    hf = _load(exports["tape"][1])
    x = tokens(1, 6)
    with torch.no_grad():
        out = hf(input_ids=x[:, :5], attention_mask=torch.ones(1, 5, dtype=torch.long),
                 use_cache=True)
        with pytest.raises(ValueError, match=r"shape \(1, 1\): .* at least 5 \+ 1 columns"):
            hf(input_ids=x[:, 5:], attention_mask=torch.ones(1, 1, dtype=torch.long),
               use_cache=True, **{_CACHE: out[_CACHE]})
        # Negative control: the whole sequence's mask decodes as the full forward.
        step = hf(input_ids=x[:, 5:], attention_mask=torch.ones(1, 6, dtype=torch.long),
                  use_cache=True, **{_CACHE: out[_CACHE]})
        torch.testing.assert_close(step.logits[:, -1], hf(input_ids=x).logits[:, -1],
                                   rtol=0, atol=1e-5)


def test_exports_in_directories_of_one_name_run_their_own_remote_code(tmp_path):
    """transformers 5 keys a remote config class by configuration_tape.py's bytes and the
    directory's name, and reuses the model class first loaded for it: an older export at
    a/export made a newer one at b/export run the older modelling code (measured: an export
    from before the transformers 5.24 cache fix then decoded without its cache). Exports
    now carry the modelling code's hash in configuration_tape.py."""
    model = small_model("tape", dtype=torch.float32)
    older = save_hf(model.state_dict(), model.cfg, tmp_path / "a" / "export")
    # An export written before this fix: the plain configuration file, other modelling code.
    (older / "configuration_tape.py").write_text((REMOTE_CODE_DIR / "configuration_tape.py")
                                                 .read_text())
    with open(older / "modeling_tape.py", "a") as fh:
        fh.write("\nTapeForCausalLM.older_code = True\n")
    info = json.loads((older / "export.json").read_text())
    del info["integrity"]  # nor had it the record of its files
    (older / "export.json").write_text(json.dumps(info))
    newer = save_hf(model.state_dict(), model.cfg, tmp_path / "b" / "export")
    first, second = _load(older), _load(newer)
    assert getattr(first, "older_code", False)
    assert not getattr(second, "older_code", False)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(second(input_ids=x).logits, model(x).logits, rtol=0,
                                   atol=1e-5)


def test_loss_honours_num_items_in_batch_as_llama_does(exports):
    """transformers 5's Trainer gives a forward with **kwargs num_items_in_batch and does not
    divide its loss by the gradient-accumulation steps: the remote code ignored it and
    returned each micro-batch's mean, so accumulating N micro-batches gave N times the
    gradient. Per micro-batch losses now add up to the mean over all labelled tokens, as
    Llama's do."""
    x = tokens(2, 12)
    labels = [x.clone(), x.clone()]
    labels[1][:, :8] = -100  # micro-batches with different numbers of labelled tokens
    micro = [(x, labels[0]), (x, labels[1])]
    count = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
    with torch.no_grad():
        for pe in ("tape", "rope"):
            hf = _load(exports[pe][1])
            summed = sum(hf(input_ids=i, labels=lab, num_items_in_batch=torch.tensor(count)).loss
                         for i, lab in micro)
            logits = hf(input_ids=x).logits[:, :-1]
            nll = torch.cat([torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), lab[:, 1:].flatten(), ignore_index=-100,
                reduction="none") for _, lab in micro])
            torch.testing.assert_close(summed, nll.sum() / count, rtol=1e-5, atol=0)
            # Without it, the loss is the micro-batch's own mean, as before.
            torch.testing.assert_close(hf(input_ids=x, labels=labels[1]).loss,
                                       nll[-2 * 11:][labels[1][:, 1:].flatten() != -100].mean(),
                                       rtol=1e-5, atol=0)


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    """(start, end) byte offsets of tensor ``name``'s data in the safetensors file."""
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + length])[name]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def _remove_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    del state[name]
    save_file(state, str(path), metadata={"format": "pt"})


def _flip_in_tensor(path: Path, name: str) -> None:
    start, end = _tensor_span(path, name)
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _cut_in_tensor(path: Path, name: str) -> None:
    start, end = _tensor_span(path, name)
    path.write_bytes(path.read_bytes()[:(start + end) // 2])


_DAMAGED_TENSOR = "layers.1.attn.k_proj.weight"
HF_DAMAGE = {  # what is done to the export, what the error must say
    "tensor removed": (lambda d: _remove_tensor(d / "model.safetensors", _DAMAGED_TENSOR),
                       rf"model.safetensors: tensor {_DAMAGED_TENSOR} is missing"),
    "tensor bytes changed": (lambda d: _flip_in_tensor(d / "model.safetensors", _DAMAGED_TENSOR),
                             rf"model.safetensors: tensor {_DAMAGED_TENSOR} differs from the "
                             rf"exported one"),
    "file cut short": (lambda d: _cut_in_tensor(d / "model.safetensors", _DAMAGED_TENSOR),
                       rf"model.safetensors: cut short at \d+ of \d+ bytes: tensor "
                       rf"{_DAMAGED_TENSOR} ends past the end"),
    "weights emptied": (lambda d: (d / "model.safetensors").write_bytes(b""),
                        r"model.safetensors: 0 bytes, too short to be a safetensors file"),
    "weights garbage": (lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)),
                        r"model.safetensors: cut short, its safetensors header"),
    "tokenizer file gone": (lambda d: (d / "tokenizer.json").unlink(),
                            r"tokenizer.json: missing \(export.json lists it"),
}


def _fresh_hf_export(root: Path, pe: str, tokenizer) -> Path:
    model = small_model(pe, dtype=torch.float32, vocab_size=tokenizer.vocab_size)
    return save_hf(model.state_dict(), model.cfg, root / pe, tokenizer=tokenizer.path)


@pytest.mark.parametrize("damage", list(HF_DAMAGE))
def test_a_damaged_hf_export_is_refused_naming_the_file_and_tensor(tmp_path, tok, damage):
    """transformers alone loads an export missing a tensor (or with a cut or changed one)
    with that tensor at random and a warning; the remote code checks export.json's record
    first and refuses it, naming the file and the tensor. Negative control: the intact
    export loads and computes what the saved model computes."""
    out = _fresh_hf_export(tmp_path, "tape", tok)
    reference = _load(out)(input_ids=tokens(vocab=97)).logits  # intact: loads
    change, message = HF_DAMAGE[damage]
    change(out)
    with pytest.raises(ValueError, match=message) as err:
        _load(out)
    assert str(out) in str(err.value)
    if damage == "tensor bytes changed":  # what loading it would have computed
        from safetensors.torch import load_file

        state = load_file(str(out / "model.safetensors"))
        model = small_model("tape", dtype=torch.float32, vocab_size=tok.vocab_size)
        model.load_state_dict(state, strict=False)
        assert (model(tokens(vocab=97)).logits - reference).abs().max() > 0


def test_an_hf_export_without_an_integrity_record_loads_with_a_warning(tmp_path, tok, caplog):
    out = _fresh_hf_export(tmp_path, "tape", tok)
    info = json.loads((out / "export.json").read_text())
    del info["integrity"]
    (out / "export.json").write_text(json.dumps(info))
    _flip_in_tensor(out / "model.safetensors", _DAMAGED_TENSOR)  # nothing to compare it with
    with caplog.at_level("WARNING"):
        _load(out)
    assert "no integrity record in export.json" in caplog.text
    # a model saved again by transformers (no export.json) loads without that word
    _load(out).save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved" / "export.json").exists()
    caplog.clear()
    with caplog.at_level("WARNING"):
        _load(tmp_path / "resaved")
    assert "integrity record" not in caplog.text


@pytest.mark.parametrize("pe", ["rope", "tape"])
def test_export_check_script_shipped_in_every_hf_export(tmp_path, tok, pe):
    """A RoPE export loads as transformers' own LlamaForCausalLM, which checks nothing: the
    export carries export_check.py, run by hand (torch, transformers and tape-train aside)."""
    out = _fresh_hf_export(tmp_path, pe, tok)
    script = out / "export_check.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def check():
        return subprocess.run([sys.executable, "-I", str(script), str(out)], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=60)

    ok = check()
    assert ok.returncode == 0 and "every file matches export.json" in ok.stdout, ok.stderr
    name = "model.layers.1.self_attn.k_proj.weight" if pe == "rope" else _DAMAGED_TENSOR
    _flip_in_tensor(out / "model.safetensors", name)
    bad = check()
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        f"error: {out / 'model.safetensors'}: tensor {name} differs from the exported one "
        f"{bad.stderr.split('exported one ', 1)[1].strip()}")
    assert "Traceback" not in bad.stderr


def test_settings_users_edit_are_not_damage(tmp_path, tok):
    """config.json and generation_config.json are edited on purpose (use_cache, sampling
    defaults): only their presence is checked, their parsers and the weights' shapes do the
    rest. Control: the same export with a deleted generation_config.json is refused."""
    out = _fresh_hf_export(tmp_path, "tape", tok)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "use_cache": False}, indent=1))
    generation = out / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "top_p": 0.5}))
    assert _load(out).config.use_cache is False
    generation.unlink()
    with pytest.raises(ValueError, match=r"generation_config.json: missing"):
        _load(out)
