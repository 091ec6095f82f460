"""Tokenizer: training, special ids, round trip on real text, foreign models, bad files, CLI."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sentencepiece as spm

from tape_train.data import SPECIAL_IDS, TokenizerError, load_tokenizer
from tape_train.data import tokenizer_cli
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    return train_small_tokenizer(tmp_path_factory.mktemp("tok"))


def test_special_ids_are_fixed_and_documented(small_tok):
    assert (small_tok.pad_id, small_tok.unk_id, small_tok.bos_id, small_tok.eos_id) == (
        SPECIAL_IDS["pad"], SPECIAL_IDS["unk"], SPECIAL_IDS["bos"], SPECIAL_IDS["eos"])
    assert [small_tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert small_tok.vocab_size == 800


def test_round_trip_on_real_text_not_seen_in_training(small_tok):
    # Text the tokenizer never saw: another stdlib module, plus characters outside its alphabet.
    import email.message
    unseen = Path(email.message.__file__).read_text()[:20000]
    exotic = "naïve café — Größe, 中文, emoji 😀, tabs\tand  double  spaces\n\n    indented"
    for text in (unseen, exotic):
        ids = small_tok.encode(text)
        assert all(0 <= i < small_tok.vocab_size for i in ids)
        assert small_tok.unk_id not in ids  # byte fallback: nothing is unknown
        assert small_tok.decode(ids) == text
    # The tokenizer actually compresses real text (a byte-level model would give ratio 1).
    assert len(small_tok.encode(unseen)) < 0.5 * len(unseen.encode())


def test_training_is_deterministic(tmp_path, small_tok):
    again = train_small_tokenizer(tmp_path)
    assert again.sha256 == small_tok.sha256
    other = train_small_tokenizer(tmp_path, vocab_size=700)  # negative control
    assert other.sha256 != small_tok.sha256


def test_unigram_model_type(tmp_path):
    tok = train_small_tokenizer(tmp_path, vocab_size=400, model_type="unigram", max_bytes=150_000)
    text = real_text_documents()[3]
    assert tok.decode(tok.encode(text)) == text


def _train_foreign_model(tmp_path: Path, **ids) -> Path:
    """A model with sentencepiece's default ids (Llama-style: unk=0, bos=1, eos=2, no pad)."""
    sentences = [line for doc in real_text_documents(100) for line in doc.splitlines()[:20]
                 if line.strip()]
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=writer,
                                   vocab_size=300, minloglevel=2, **ids)
    path = tmp_path / "foreign.model"
    path.write_bytes(writer.getvalue())
    return path


def test_loads_a_foreign_model_with_its_own_ids(tmp_path):
    tok = load_tokenizer(_train_foreign_model(tmp_path))
    assert (tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.pad_id == tok.unk_id  # no PAD in the model: documented fallback
    assert tok.vocab_size == 300


def test_model_without_bos_is_rejected(tmp_path):
    path = _train_foreign_model(tmp_path, bos_id=-1)
    with pytest.raises(TokenizerError, match="no BOS or EOS"):
        load_tokenizer(path)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"", "file is empty"),
    (b"this is not a protobuf \x00\xff" * 10, "not a valid sentencepiece model"),
])
def test_unreadable_tokenizer_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "broken.model"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_cli_train_and_info(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "corpus" / "a.jsonl", real_text_documents())
    spec = tmp_path / "spec.yaml"
    spec.write_text("vocab_size: 500\nmodel_type: bpe\nbyte_fallback: true\nnum_threads: 1\n")
    prefix = tmp_path / "out" / "tok"
    assert tokenizer_cli.main(["train", "--input", str(corpus.parent), "--spec", str(spec),
                               "--vocab-size", "450", "--max-bytes", "300000",
                               "--out", str(prefix)]) == 0
    tok = load_tokenizer(f"{prefix}.model")
    assert tok.vocab_size == 450  # the flag beats the spec
    record = (prefix.parent / "tok.training.json").read_text()
    assert '"max_bytes": 300000' in record
    assert tokenizer_cli.main(["info", f"{prefix}.model", "--text", "hello  world"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size: 450" in out and "round trip: True" in out and "'<s>'" in out


def test_cli_rejects_bad_spec_and_missing_input(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("vocab_sise: 500\n")
    assert tokenizer_cli.main(["train", "--input", str(tmp_path), "--spec", str(spec),
                               "--out", str(tmp_path / "t")]) == 1
    assert "vocab_sise" in capsys.readouterr().err
    for text, message in (("vocab_size: [500\n", f"{spec}:2: not valid YAML: expected ',' or "
                           f"']', but got '<stream end>' (column 1, while parsing a flow "
                           f"sequence from line 1, column 13); close the bracket or brace\n"),
                          ("- 500\n", "must be a mapping of keys to values")):
        spec.write_text(text)
        assert tokenizer_cli.main(["train", "--input", str(tmp_path), "--spec", str(spec),
                                   "--out", str(tmp_path / "t")]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    # A bad value of the spec file names the file; the same bad value given as a flag does not
    # (negative control), nor a spec value a flag overrides.
    spec.write_text("vocab_size: abc\nmodel_type: wordpiece\n")
    base = ["train", "--input", str(tmp_path), "--out", str(tmp_path / "t")]
    assert tokenizer_cli.main([*base, "--spec", str(spec), "--model-type", "bpe"]) == 1
    assert (f"tape-tokenizer: error: --spec {spec}: tokenizer vocab_size must be an integer > 4, "
            f"got 'abc'") in capsys.readouterr().err
    assert tokenizer_cli.main([*base, "--spec", str(spec), "--vocab-size", "500"]) == 1
    assert (f"error: --spec {spec}: tokenizer model_type='wordpiece' is not one of"
            in capsys.readouterr().err)
    assert tokenizer_cli.main([*base, "--spec", str(spec), "--vocab-size", "3",
                               "--model-type", "bpe"]) == 1
    assert ("tape-tokenizer: error: tokenizer vocab_size must be an integer > 4, got 3"
            in capsys.readouterr().err)
    assert tokenizer_cli.main(["train", "--input", str(tmp_path / "nope.jsonl"),
                               "--out", str(tmp_path / "t")]) == 1
    assert "nope.jsonl" in capsys.readouterr().err
    assert tokenizer_cli.main(["info", str(tmp_path / "missing.model")]) == 1


def test_a_missing_input_directory_is_named_and_out_leaves_no_directory(tmp_path, capsys):
    """The README's `tape-tokenizer train --input data/mine --out data/mine/tokenizer` before
    `data/mine` exists: the error says the input does not exist (it once created data/mine as
    --out's parent first, then called it a directory without supported files) and nothing
    is created; a vocabulary the text cannot fill leaves no new directory either."""
    missing = tmp_path / "mine"
    assert tokenizer_cli.main(["train", "--input", str(missing), "--vocab-size", "500",
                               "--out", str(missing / "tokenizer")]) == 1
    err = capsys.readouterr().err
    assert f"tape-tokenizer: error: --input: no such file or directory {str(missing)!r}" in err
    assert "holds no supported files" not in err and "Traceback" not in err, err
    assert not missing.exists()
    corpus = write_jsonl(tmp_path / "c.jsonl", real_text_documents(20))
    base = ["train", "--input", str(corpus), "--num-threads", "1"]
    assert tokenizer_cli.main([*base, "--vocab-size", "100000",
                               "--out", str(tmp_path / "new" / "t")]) == 1
    assert not (tmp_path / "new").exists()
    # negative control: a run that trains creates --out's directory
    assert tokenizer_cli.main([*base, "--vocab-size", "400",
                               "--out", str(tmp_path / "new" / "t")]) == 0
    assert (tmp_path / "new" / "t.model").is_file()


def test_a_vocabulary_size_the_text_cannot_fill_is_one_line_naming_the_option(tmp_path, capsys):
    """sentencepiece refuses a vocabulary larger than the text yields, or smaller than its
    alphabet, in C++ check text; the CLI says which option, the bound and what to change."""
    corpus = write_jsonl(tmp_path / "c.jsonl", real_text_documents(20))
    base = ["train", "--input", str(corpus), "--num-threads", "1", "--out", str(tmp_path / "t")]
    assert tokenizer_cli.main([*base, "--vocab-size", "100000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tape-tokenizer: error: tokenizer vocab_size 100000 is more pieces "
                          "than the text read (")
    assert "; lower vocab_size (--vocab-size) or give it more text" in err
    assert "trainer_spec_" not in err
    assert tokenizer_cli.main([*base, "--vocab-size", "10"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tokenizer vocab_size 10 is smaller than the " in err
    assert "raise vocab_size (--vocab-size) or lower character_coverage" in err
    # negative control: a size the text can fill trains
    assert tokenizer_cli.main([*base, "--vocab-size", "400"]) == 0
    assert load_tokenizer(tmp_path / "t.model").vocab_size == 400


def test_training_sentences_cut_long_paragraphs_between_characters():
    """A paragraph longer than one sentencepiece sentence is cut into pieces whose joined text
    is the paragraph: no character cut in two and dropped (a 3-byte '€' straddles the first
    8192-byte boundary: the byte cut lost it)."""
    from tape_train.data.tokenizer import MAX_SENTENCE_BYTES, TokenizerTrainSpec, training_sentences

    paragraph = "a" * (MAX_SENTENCE_BYTES - 1) + "€" + "ü😀" * 3000
    stats: dict = {}
    pieces = list(training_sentences([paragraph + "\n\nnext"], TokenizerTrainSpec(vocab_size=64),
                                     stats))
    assert "".join(pieces[:-1]) == paragraph and pieces[-1] == "next"
    assert all(len(p.encode("utf-8")) <= MAX_SENTENCE_BYTES for p in pieces)
    assert len(pieces) == 5 and stats["bytes"] == len((paragraph + "next").encode("utf-8"))


def _pieces_of_kinds(tok):
    sp = tok._sp
    special = [i for i in range(tok.vocab_size) if sp.IsControl(i) or sp.IsUnknown(i)]
    byte = [i for i in range(tok.vocab_size) if sp.IsByte(i)]
    return special, byte, [i for i in range(tok.vocab_size) if not tok._is_special(i)]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_decode_continuation_equals_the_whole_decode_after_any_context(tmp_path, model_type):
    """The streamed text after a prompt is decode(context + ids) less decode(context), though
    only the context's tail is decoded: over contexts ending in byte pieces (a character spelt
    in bytes), control pieces and ordinary ones, and continuations of every kind."""
    import random

    tok = train_small_tokenizer(tmp_path, model_type=model_type)
    special, byte, normal = _pieces_of_kinds(tok)
    text_ids = tok.encode("naïve 東京 ok\tdone — x ") + tok.encode("ä€😀 tail")
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        context = [tok.bos_id] + text_ids[: rng.randrange(len(text_ids) + 1)]
        context += rng.choice([[], tok.encode("€"), [tok.eos_id],
                               [rng.choice(normal)]])
        before = tok._sp.decode(context)
        ids = [rng.choice(rng.choice([special, byte, normal])) for _ in range(rng.randrange(6))]
        ids += tok.encode(rng.choice(["", " world", "€", "x"]))
        whole = tok._sp.decode(context + ids)
        if not whole.startswith(before):  # a context no prompt ends with
            continue
        assert tok.decode_continuation(context, ids) == whole[len(before):], (context, ids)
        checked += 1
    assert checked > 300
    # The tail stays short after a long prompt: the cost per streamed token does not grow.
    long_context = [tok.bos_id] + text_ids * 200
    assert len(tok.context_tail(long_context)) <= 8 + 8
    # Negative control: a tail that starts at a control piece decodes the text after it as a
    # text of its own (its first space taken for the dummy prefix), so the tail starts before.
    context, ids = [tok.bos_id] + tok.encode("Hello") + [tok.eos_id], tok.encode(" world")
    whole = tok._sp.decode(context + ids)[len(tok._sp.decode(context)):]
    assert tok._sp.decode([tok.eos_id] + ids) != whole
    assert tok.context_tail(context, keep=1)[0] != tok.eos_id
    assert tok.decode_continuation(context, ids) == whole
