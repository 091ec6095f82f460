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


def _random_text(rng: random.Random) -> str:
    """Up to 30 pieces of adversarial text: specials' spellings, U+2581, combining marks,
    zero-width and control characters, CR/LF, tabs, and any code point but surrogates."""
    parts = ["a", "the", " ", "  ", "\n", "\r\n", "\t", "<s>", "</s>", "<unk>", "<pad>", "<0x41>",
             "▁", "e\u0301", "日本", "🤖", "\u200b", "\u200d", "\ufeff", "\x00", "\x7f", "ﬁ", "ｆ",
             "①", "\u2028", "עב", "12", "é", "<b>", "x>y"]
    out = []
    for _ in range(rng.randint(0, 30)):
        r = rng.random()
        if r < 0.6:
            out.append(rng.choice(parts))
        elif r < 0.85:
            out.append(chr(rng.randint(0x20, 0x7E)))
        else:
            code = rng.randint(0, 0x10FFFF)
            out.append(chr(code) if not 0xD800 <= code < 0xE000 else "?")
    return "".join(out)


def test_ids_and_decoding_match_on_random_text(tokenizer_dir):
    """Seeded fuzz: the exported tokenizer gives training's ids, and decodes them as
    sentencepiece (and tape-generate) does; a long document's ids also match for BPE
    (unigram: docs/evaluation.md, Known limits)."""
    sp, path = tokenizer_dir
    hf = transformers.AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    for _ in range(500):
        text = _random_text(rng)
        ids = sp.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode(ids) == sp.decode(ids) == text.replace("▁", " "), text
    from tape_train.inference.hf_tokenizer import _proto

    if _proto(sp.path).trainer_spec.model_type == 2:  # BPE
        document = "\n\n".join(_corpus()) * 8 + "".join(_random_text(rng) for _ in range(300))
        assert hf(document, add_special_tokens=False)["input_ids"] == sp.encode(document)


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


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
@pytest.mark.parametrize("byte_fallback", [True, False])
def test_spellings_of_control_and_byte_pieces_stay_text_without_their_characters(
        tmp_path, model_type, byte_fallback):
    """A unigram vocabulary without "<" (text with no markup, or a character_coverage that
    drops it): the exported tokenizer matched a literal "<s>" as BOS and "<0x41>" as the
    byte piece of "A" (which then decoded as "A"), where training gave "<", "s", ">"."""
    rng = random.Random(1)
    words = ["the", "model", "attention", "tokens", "layer", "state", "value", "日本", "  "]
    docs = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(300)]
    spec = TokenizerTrainSpec(vocab_size=280 if byte_fallback else 30, model_type=model_type,
                              byte_fallback=byte_fallback, num_threads=1)
    sp = train_tokenizer(docs, tmp_path / "tok", spec)
    assert "<" not in "".join(sp.id_to_piece(i) for i in range(4, sp.vocab_size)
                              if not sp.id_to_piece(i).startswith("<0x"))
    from tape_train.inference.hf_tokenizer import write_hf_tokenizer

    write_hf_tokenizer(sp.path, tmp_path, model_max_length=4096)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = ["<s>", "</s>", "<unk>", "<pad>", "a<s>b", "<0x41>", "x<0x41><0x42>", "日本<s>",
             "the <s> model", "<<s>>", "<>", "本<0x41>本"]
    for text in texts:
        assert hf(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text
    if byte_fallback:
        assert hf.decode(hf("<0x41>", add_special_tokens=False)["input_ids"]) == "<0x41>"
    for _ in range(300):  # strings of covered and uncovered characters, control spellings
        text = "".join(rng.choice(["<s>", "</s>", "<0x41>", "the", " ", "本", "<", "x", "é",
                                   "\n", "🤖"]) for _ in range(rng.randint(0, 8)))
        assert hf(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text


def test_a_unigram_export_warns_that_some_ids_differ(tokenizer_dir, tmp_path, caplog):
    """docs/evaluation.md, Known limits: unigram exports differ from training on near-ties of
    float32 scores; the export says so, a BPE export does not."""
    from tape_train.inference.hf_tokenizer import _proto, write_hf_tokenizer

    sp, _ = tokenizer_dir
    with caplog.at_level("WARNING", logger="tape_train.export"):
        write_hf_tokenizer(sp.path, tmp_path, model_max_length=64)
    unigram = _proto(sp.path).trainer_spec.model_type == 1
    assert ("is a unigram model" in caplog.text) == unigram
