"""What ships, seen from outside: exports against a clean-room NumPy model of TAPE.

tests/cleanroom_reference.py is written from the spec and docs/model.md ("What an export
holds") alone and reads only what a user gets: model.safetensors and config.json of an export.
Here every weight of a small model is random and non-zero (TAPE's W_up and W_pa are zero at
init, which would make TAPE a RoPE model and hide its bugs); the native export
(`from_pretrained`) and the `--hf` remote code (`trust_remote_code=True`) must give the
reference's fp64 logits, greedy KV-cache decoding must follow its argmax, and layer-0
positions passed in must be the reference's. test_model_tape_reference.py checks the model's
layers against its own reference from the inside; this file checks the exported files, the
config.json keys of both exports and the remote code (the only test of its `rowsum` form).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import cleanroom_reference as ref
from model_utils import SMALL
from tape_train.inference.hf_export import save_hf
from tape_train.model import ModelConfig, TransformerLM, from_pretrained, save_pretrained

CASES = [("headmix", False), ("rowsum", True)]      # (tape_post_attn, tie_embeddings)
LENGTHS = (1, 7, 13, 30)


def random_tape_model(post_attn: str, tie: bool) -> TransformerLM:
    """4 blocks (3 carry E), every weight random: norms around 1, TAPE weights large enough
    that E is far from the layer-0 tables."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**SMALL, "num_layers": 4, "tape_post_attn": post_attn,
                                         "tie_embeddings": tie, "attn_backend": "eager"}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif ".pos_update." in name:
                param.normal_(0, 0.5 if name.endswith("w_x.weight") else 0.3)
            else:
                param.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}")
def exported(request, tmp_path_factory):
    """(native export dir, --hf export dir), written the way tape-export writes them."""
    model = random_tape_model(*request.param)
    root = tmp_path_factory.mktemp("cleanroom")
    return (save_pretrained(model.state_dict(), model.cfg, root / "native"),
            save_hf(model.state_dict(), model.cfg, root / "hf"))


def read_export(path):
    return (load_file(str(path / "model.safetensors")),
            json.loads((path / "config.json").read_text()))


def load_hf(path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True)
    return model.double().eval()


def sequence(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + length).integers(0, SMALL["vocab_size"], length)


def logits_of(model, ids, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None], **kwargs).logits[0].double().numpy()


def test_native_export_equals_the_reference(exported):
    weights, config = read_export(exported[0])
    model = from_pretrained(exported[0], dtype=torch.float64)
    for n in LENGTHS:
        ids = sequence(n)
        np.testing.assert_allclose(logits_of(model, ids), ref.forward(weights, config, ids),
                                   rtol=0, atol=1e-9, err_msg=f"N={n}")


def test_hf_remote_code_equals_the_reference(exported):
    model = load_hf(exported[1])
    weights, config = read_export(exported[1])
    for n in LENGTHS:
        ids = sequence(n)
        np.testing.assert_allclose(logits_of(model, ids), ref.forward(weights, config, ids),
                                   rtol=0, atol=1e-9, err_msg=f"N={n}")


def test_layer0_positions_passed_in_are_the_reference_positions(exported):
    weights, config = read_export(exported[0])
    model = from_pretrained(exported[0], dtype=torch.float64)
    ids, offset = sequence(13), 517
    positions = np.arange(offset, offset + len(ids))
    np.testing.assert_allclose(
        logits_of(model, ids, positions=torch.as_tensor(positions)[None]),
        ref.forward(weights, config, ids, positions), rtol=0, atol=1e-9)


def reference_greedy(weights, config, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(np.argmax(ref.forward(weights, config, np.array(seq))[-1])))
    return seq


def test_greedy_kv_cache_decoding_follows_the_reference(exported):
    weights, config = read_export(exported[0])
    prompt, steps = sequence(5), 12
    want = reference_greedy(weights, config, prompt, steps)
    ids = torch.as_tensor(prompt)[None]
    with torch.no_grad():
        ours = from_pretrained(exported[0], dtype=torch.float64).generate(ids, steps,
                                                                          temperature=0.0)
        hf = load_hf(exported[1]).generate(ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=steps, do_sample=False)
    assert ours[0].tolist() == want
    assert hf[0].tolist() == want


def test_wrong_weight_layouts_disagree_with_the_shipped_model(exported):
    """Negative controls: the reference reading W_pa transposed, or W_up and W_dn as each
    other's transpose (K_n transposed), or without the TAPE weights (plain RoPE) is far from
    the shipped logits, so the agreement above pins the layout."""
    weights, config = read_export(exported[0])
    ids = sequence(13)
    shipped = logits_of(from_pretrained(exported[0], dtype=torch.float64), ids)
    updates = [k for k in weights if ".pos_update." in k]
    assert {k.split(".", 2)[1] for k in updates} == {"0", "1", "2"}     # the last block has none
    variants = {
        "W_pa transposed": {k: weights[k].T for k in updates if k.endswith("w_pa")},
        "W_up, W_dn swapped": {
            **{k: weights[k.replace("w_up", "w_dn")].T for k in updates if k.endswith("w_up")},
            **{k: weights[k.replace("w_dn", "w_up")].T for k in updates if k.endswith("w_dn")}},
        "no TAPE update": {k: np.zeros_like(weights[k]) for k in updates},
    }
    for name, changed in variants.items():
        wrong = ref.forward({**weights, **changed}, config, ids)
        assert np.abs(wrong - shipped).max() > 1e-3, name
