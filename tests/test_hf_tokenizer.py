"""Exported Hugging Face tokenizers give the ids training gave (sentencepiece through
tape_train.data.load_tokenizer) and decode them back; exports stop at EOS and pad batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from model_utils import small_model
from tape_train.data.tokenizer import TokenizerTrainSpec, load_tokenizer, train_tokenizer
from tape_train.inference.hf_export import save_hf

transformers = pytest.importorskip("transformers")

TORTURE = [
    "Hello world", "", " ", "x", "  two leading", "trailing  ", "a  b   c    d", "\ttabs\tand\t",
    "line\nbreak\n\nparagraph\n", "café naïve Æsir Ωμέγα 日本語 한국어", "emoji 🤖🚀👍🏽 ok",
    "digits 1234567890 and 3.14159", "<s> literal </s> <pad> <unk> specials", "<s>", "<0x41> is not a byte",
    "ctrl \x00\x01\x7f bytes", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math", "def f(x):\n    return x  # comment",
    "mixed\t \n  whitespace", "ЁЛКА ёлка", "\n",
]


def _corpus() -> list[str]:
    words = ["the", "model", "attention", "position", "encoding", "tokens", "layer", "state",
             "café", "naïve", "日本", "def", "return", "print", "value", "  indent", "42",
             "<tag>", "x>y", "<0x41>"]
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzéü"
    words += ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(300)]
    docs = []
    for i in range(400):
        line = " ".join(rng.choice(words) for _ in range(12))
        docs.append(f"{line}.\n    <b>{words[i % len(words)]}({i})</b>\n")
    return docs


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def tokenizer_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    spec = TokenizerTrainSpec(vocab_size=320, model_type=request.param, num_threads=1)
    train_tokenizer(_corpus(), root / "tok", spec)
    model = small_model("tape", dtype=torch.float32, vocab_size=320)
    out = save_hf(model.state_dict(), model.cfg, root / "export", tokenizer=root / "tok.model")
    return load_tokenizer(root / "tok.model"), out


def test_ids_and_decoding_match_the_training_tokenizer(tokenizer_dir):
    sp, path = tokenizer_dir
    hf = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    for text in TORTURE:
        expected = [sp.bos_id] + sp.encode(text)  # training: every document starts with BOS
        ids = hf(text)["input_ids"]
        assert ids == expected, (text, ids, expected)
        assert hf.decode(ids, skip_special_tokens=True) == sp.decode(expected) == text
        assert hf.decode(expected[1:]) == text
    assert hf("Hello world", add_special_tokens=False)["input_ids"] == sp.encode("Hello world")


def test_negative_control_parsing_special_strings_would_be_caught(tokenizer_dir):
    sp, path = tokenizer_dir
    parsing = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True,
                                                         split_special_tokens=False)
    ids = parsing("<s>", add_special_tokens=False)["input_ids"]
    assert ids == [sp.bos_id] != sp.encode("<s>")


def test_config_files_carry_the_training_special_ids(tokenizer_dir):
    sp, path = tokenizer_dir
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    for data in (config, generation):
        assert (data["bos_token_id"], data["eos_token_id"], data["pad_token_id"]) == (
            sp.bos_id, sp.eos_id, sp.pad_id)
    assert tok_config["add_bos_token"] is True and tok_config["add_eos_token"] is False
    assert (path / "tokenizer.model").read_bytes() == open(sp.path, "rb").read()
    hf = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (sp.bos_id, sp.eos_id,
                                                                   sp.pad_id)


@pytest.mark.parametrize("pe", ["rope", "tape"])
def test_generate_stops_at_eos_and_pads_batches(tmp_path, tokenizer_dir, pe):
    sp, _ = tokenizer_dir
    model = small_model(pe, dtype=torch.float32, vocab_size=320)
    with torch.no_grad():  # the residual stream stays the embedding, channel 0 large: the
        for layer in model.layers:  # only non-zero logit is EOS's
            layer.attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.embed.weight[:, 0] = 100.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[sp.eos_id, 0] = 1.0
    out = save_hf(model.state_dict(), model.cfg, tmp_path / pe, tokenizer=sp.path)
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    batch = tok(["a", "the model attention"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # left padding with PAD
    assert batch["input_ids"][0, 0] == sp.pad_id
    gen = hf.generate(**batch, max_new_tokens=10, do_sample=False)
    assert gen.shape[1] == batch["input_ids"].shape[1] + 1  # stopped right after EOS
    assert gen[:, -1].tolist() == [sp.eos_id, sp.eos_id]


def test_both_flags_give_the_training_form_of_a_document(tokenizer_dir):
    """docs/evaluation.md: add_bos_token=True with add_eos_token=True gives [BOS] ids [EOS],
    as the packer wraps documents (transformers 5; 4.x ignores the flags)."""
    from tape_train.data.packing import wrap_document

    sp, path = tokenizer_dir
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x ignores add_bos_token/add_eos_token here")
    both = transformers.AutoTokenizer.from_pretrained(path, add_bos_token=True,
                                                      add_eos_token=True)
    eos_only = transformers.AutoTokenizer.from_pretrained(path, add_eos_token=True)
    for text in ("Hello world", "", "  two\n\nlines "):
        ids = sp.encode(text)
        assert both(text)["input_ids"] == wrap_document(ids, sp.bos_id, sp.eos_id)
        assert eos_only(text)["input_ids"] == ids + [sp.eos_id]  # the documented pitfall


@pytest.mark.parametrize("pe", ["rope", "tape"])
def test_generate_emits_only_ids_the_tokenizer_decodes(tmp_path, tokenizer_dir, pe):
    """A model with a larger vocabulary than its tokenizer (allowed) generated ids no piece
    decodes, which decode() dropped silently: generation_config.json suppresses them, as
    tape-generate samples only the tokenizer's ids."""
    sp, _ = tokenizer_dir
    model = small_model(pe, dtype=torch.float32, vocab_size=400)
    with torch.no_grad():  # the ids past the tokenizer's win every greedy step
        model.lm_head.weight[320:] = 3 * model.lm_head.weight[:80].sign()
        model.lm_head.weight[:320] *= 0.01
    out = save_hf(model.state_dict(), model.cfg, tmp_path / pe, tokenizer=sp.path)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(320, 400))
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    prompt = tok("the model", return_tensors="pt")
    new = hf.generate(**prompt, max_new_tokens=6, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert len(new) > 0 and new.max() < 320
    hf.generation_config.suppress_tokens = None  # negative control: the model prefers them
    new = hf.generate(**prompt, max_new_tokens=6, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert new.min() >= 320


@pytest.mark.parametrize("setting", ["treat_whitespace_as_suffix", "escape_whitespaces"])
def test_whitespace_settings_the_files_cannot_reproduce_are_refused(tokenizer_dir, tmp_path,
                                                                   setting):
    """A model with whitespace as a suffix ("world▁") or unescaped got tokenizer files that
    gave other ids on every text, silently: it is refused, naming the setting."""
    from sentencepiece import sentencepiece_model_pb2

    from tape_train.inference.hf_tokenizer import build_fast_tokenizer

    sp, _ = tokenizer_dir
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(open(sp.path, "rb").read())
    if setting == "escape_whitespaces":
        proto.normalizer_spec.escape_whitespaces = False
    else:
        proto.trainer_spec.treat_whitespace_as_suffix = True
    odd = tmp_path / "odd.model"
    odd.write_bytes(proto.SerializeToString())
    assert load_tokenizer(odd).encode("Hello world") != sp.encode("Hello world")  # it matters
    with pytest.raises(ValueError, match=f"{setting}=(true|false) is not supported"):
        build_fast_tokenizer(odd)
    build_fast_tokenizer(sp.path)  # negative control
