"""Pre-tokenised path: `tape-data prepare --tokenize`, the global sample index, O(1) resume,
and a world-size change continuing the same global token stream."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import torch

from tape_train.data import DataConfig, DataError, build_train_loader
from tape_train.data import cli as data_cli
from tape_train.data.corpus import read_complete_manifest
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl
from tape_train.data.tokens import feistel_permutation, token_dtype
from token_utils import rows

SEQ = 40


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("tokcorpus")
    texts = [f"[D{i:03d}] {t[:300]}" for i, t in enumerate(real_text_documents(120))]
    write_jsonl(root / "in" / "a.jsonl", texts)
    out = root / "out"
    assert data_cli.main(["prepare", "--input", str(root / "in"), "--out", str(out),
                          "--num-shards", "3", "--eval-fraction", "0.05", "--tokenize",
                          "--tokenizer", tok.path]) == 0
    return {"root": root, "out": out, "texts": texts}


def cfg_for(prepared, tok, **kw) -> DataConfig:
    return DataConfig(sources=[str(prepared["out"])], tokenizer=tok.path, format="tokens", **kw)


def test_feistel_permutation_is_a_keyed_bijection():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        assert sorted(feistel_permutation(np.arange(n), n, [7, 1]).tolist()) == list(range(n))
    a = feistel_permutation(np.arange(1000), 1000, [7, 1])
    b = feistel_permutation(np.arange(1000), 1000, [7, 2])
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))
    # Evaluated per index: a slice of indices gives the same values as the whole.
    big = 10**12 + 39
    idx = np.array([0, 5, big - 1])
    values = feistel_permutation(idx, big, [3])
    assert (values < big).all() and len(set(values.tolist())) == 3
    assert token_dtype(32000) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_prepare_tokenize_writes_checked_token_shards(prepared, tok, capsys):
    out = prepared["out"]
    manifest = read_complete_manifest(out)
    tokens = manifest["tokens"]
    assert tokens["dtype"] == "<u2" and tokens["tokenizer_sha256"] == tok.sha256
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    assert len(tokens["shards"]) == len(train) == 3
    import zstandard
    for text_shard, token_shard in zip(train, tokens["shards"]):
        data = (out / token_shard["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == token_shard["sha256"]
        ids = np.memmap(out / token_shard["path"], dtype=tokens["dtype"], mode="r")
        assert len(ids) == token_shard["tokens"]
        # Token shard i holds exactly text shard i's documents, in order, as BOS ids EOS.
        lines = zstandard.ZstdDecompressor().stream_reader(
            open(out / text_shard["path"], "rb")).read().decode().splitlines()
        expected = []
        for line in lines:
            expected += [tok.bos_id] + tok.encode(json.loads(line)["text"]) + [tok.eos_id]
        assert ids.tolist() == expected and token_shard["documents"] == len(lines)
    # Same options: nothing to do; a damaged token shard makes the directory incomplete.
    capsys.readouterr()
    args = ["prepare", "--input", str(prepared["root"] / "in"), "--out", str(out),
            "--num-shards", "3", "--eval-fraction", "0.05", "--tokenize", "--tokenizer", tok.path]
    assert data_cli.main(args) == 0 and "already complete" in capsys.readouterr().out
    shard = out / tokens["shards"][0]["path"]
    original = shard.read_bytes()
    shard.write_bytes(original[:-2])
    assert read_complete_manifest(out) is None
    with pytest.raises(DataError, match="not a complete prepared directory"):
        build_train_loader(cfg_for(prepared, tok), tok, SEQ, 2)
    shard.write_bytes(original)
    assert read_complete_manifest(out) is not None


def test_prepare_tokenize_bad_arguments_are_one_line_errors(prepared, tmp_path, capsys):
    base = ["prepare", "--input", str(prepared["root"] / "in"), "--out", str(tmp_path / "o")]
    assert data_cli.main(base + ["--tokenize"]) == 1
    assert "--tokenize and --tokenizer MODEL go together" in capsys.readouterr().err
    assert data_cli.main(base + ["--tokenize", "--tokenizer", str(tmp_path / "nope.model")]) == 1
    err = capsys.readouterr().err
    assert "nope.model: no such file" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_prepare_tokenize_output_does_not_depend_on_workers(prepared, tok, tmp_path,
                                                           monkeypatch, capsys):
    """Tokenising in batches on several threads writes the very bytes one thread writes (and
    the shard the fixture wrote with the default, all usable CPUs); batches of ~1 KB of text
    make each shuffle window many batches."""
    from tape_train.data import corpus

    monkeypatch.setattr(corpus, "TOKENIZE_BATCH_BYTES", 1024)
    args = ["prepare", "--input", str(prepared["root"] / "in"), "--num-shards", "3",
            "--eval-fraction", "0.05", "--tokenize", "--tokenizer", tok.path]
    hashes = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        assert data_cli.main(args + ["--out", str(out), "--workers", str(workers)]) == 0
        manifest = read_complete_manifest(out)
        hashes[workers] = [s["sha256"] for s in manifest["shards"] + manifest["tokens"]["shards"]]
    fixture = read_complete_manifest(prepared["out"])
    assert hashes[1] == hashes[3] == [s["sha256"] for s in fixture["shards"]
                                      + fixture["tokens"]["shards"]]
    capsys.readouterr()
    assert data_cli.main(args + ["--out", str(tmp_path / "w0"), "--workers", "0"]) == 1
    assert capsys.readouterr().err.strip() == "tape-data: error: --workers must be positive, got 0"


def test_prepare_workers_without_tokenize_says_it_does_nothing(prepared, tmp_path, caplog):
    base = ["prepare", "--input", str(prepared["root"] / "in"), "--num-shards", "3"]
    assert data_cli.main(base + ["--out", str(tmp_path / "a"), "--workers", "2"]) == 0
    assert "--workers sets the threads that tokenise with --tokenize" in caplog.text
    caplog.clear()
    assert data_cli.main(base + ["--out", str(tmp_path / "b")]) == 0
    assert "--workers" not in caplog.text  # the default says nothing


def test_one_epoch_visits_every_block_once(prepared, tok):
    loader = build_train_loader(cfg_for(prepared, tok), tok, SEQ, 4, seed=3)
    n = loader.sources[0].num_blocks
    stream = np.concatenate([np.memmap(p, dtype="<u2", mode="r")
                             for p in loader.sources[0].paths])
    blocks = {tuple(stream[k * (SEQ + 1):(k + 1) * (SEQ + 1)].tolist()) for k in range(n)}
    seen = [tuple(r.tolist()) for r in rows(loader, -(-n // 4))][:n]
    assert set(seen) == blocks and len(seen) == len(blocks) == n  # a permutation of all blocks
    assert loader.epochs == [1]
    ordered = build_train_loader(cfg_for(prepared, tok, shuffle=False), tok, SEQ, 4, seed=3)
    assert [tuple(r.tolist()) for r in rows(ordered, 2)] == [
        tuple(stream[k * (SEQ + 1):(k + 1) * (SEQ + 1)].tolist()) for k in range(8)]
    assert seen[:8] != [tuple(stream[k * (SEQ + 1):(k + 1) * (SEQ + 1)].tolist())
                        for k in range(8)]  # shuffled differs from file order
    second = [tuple(r.tolist()) for r in rows(loader, -(-n // 4))]
    assert second[:20] != seen[:20]  # epoch 2 is a different permutation


def test_exact_resume_and_world_size_change_continue_the_global_stream(prepared, tok):
    """The global sample sequence is the same for any dp_size: rank r of n at a step holds
    samples c + r·b …; a state saved on 2 ranks resumes on 3 (and on 1) exactly."""
    cfg, b = cfg_for(prepared, tok), 2
    single = build_train_loader(cfg, tok, SEQ, 1, 0, 1, seed=5)
    n_blocks = single.sources[0].num_blocks
    flat = rows(single, n_blocks + 30)
    start = n_blocks - 9  # the 2-rank run starts late in epoch 0 and crosses into epoch 1
    two = [build_train_loader(cfg, tok, SEQ, b, r, 2, seed=5) for r in range(2)]
    for loader in two:
        loader.load_state_dict({**loader.state_dict(), "position": {"samples": start}})
    steps = 4
    got = [rows(loader, steps) for loader in two]
    for t in range(steps):
        for r in range(2):
            for j in range(b):
                assert torch.equal(got[r][t * b + j], flat[start + t * 2 * b + r * b + j])
    state = json.loads(json.dumps(two[1].state_dict()))
    assert state == {**two[0].state_dict(), "dp_rank": 1}  # rank-independent position
    assert two[0].epochs == [1]
    consumed = start + steps * b * 2
    for n in (3, 2, 1):
        for r in range(n):
            loader = build_train_loader(cfg, tok, SEQ, b, r, n, seed=5)
            loader.load_state_dict(state)
            after = rows(loader, 2)
            for t in range(2):
                for j in range(b):
                    assert torch.equal(after[t * b + j], flat[consumed + t * n * b + r * b + j])
    # Negative control: another seed is another stream.
    other = build_train_loader(cfg, tok, SEQ, 1, 0, 1, seed=6)
    assert not all(torch.equal(x, y) for x, y in zip(rows(other, 5), flat[:5]))


def test_resume_is_O1_and_reads_only_the_delivered_blocks(prepared, tok):
    loader = build_train_loader(cfg_for(prepared, tok), tok, SEQ, 2, 1, 4, seed=1)
    far = {**loader.state_dict(), "position": {"samples": 10**12}}
    loader.load_state_dict(far)
    batch = next(loader)
    assert batch["input_ids"].shape == (2, SEQ)
    assert loader.stats["tokens_read"] == 2 * (SEQ + 1)
    assert loader.state_dict()["position"]["samples"] == 10**12 + 8


def test_token_loader_mismatches_are_errors(prepared, tok, tmp_path):
    other_tok = train_small_tokenizer(tmp_path, vocab_size=700)
    with pytest.raises(DataError, match="was tokenised with tokenizer"):
        build_train_loader(cfg_for(prepared, tok), other_tok, SEQ, 2)
    with pytest.raises(DataError, match="add_bos"):
        build_train_loader(cfg_for(prepared, tok, add_bos=False), tok, SEQ, 2)
    loader = build_train_loader(cfg_for(prepared, tok), tok, SEQ, 2, seed=1)
    next(loader)
    with pytest.raises(DataError, match="seq_len"):
        build_train_loader(cfg_for(prepared, tok), tok, SEQ + 1, 2,
                           seed=1).load_state_dict(loader.state_dict())
    text_loader = build_train_loader(DataConfig(sources=[str(prepared["out"])], prefetch=0),
                                     tok, SEQ, 2)
    next(text_loader)
    with pytest.raises(DataError, match="data.format=text"):
        loader.load_state_dict(text_loader.state_dict())
    write_jsonl(tmp_path / "plain" / "x.jsonl", ["text"])
    with pytest.raises(DataError, match=r"data.sources\[0\].path: .*not a complete prepared"):
        build_train_loader(DataConfig(sources=[str(tmp_path / "plain")], format="tokens"), tok,
                           SEQ, 2)
    with pytest.raises(DataError, match=r"data.sources\[0\]: data.format=tokens needs"):
        build_train_loader(DataConfig(sources=[{"hub": "parquet"}], format="tokens"), tok, SEQ, 2)
    with pytest.raises(DataError, match="data.format"):
        DataConfig(format="tokenz")


def test_a_re_prepared_token_directory_is_named_shard_by_shard(prepared, tok, tmp_path):
    """A directory prepared again since the state was saved (another document, another shard
    count): the refusal names the token shards that changed; the same directory resumes."""
    from tape_train.data.loader import resume_differences

    texts = prepared["texts"]
    write_jsonl(tmp_path / "in" / "a.jsonl", texts[:60])
    out = tmp_path / "out"
    prepare = ["prepare", "--input", str(tmp_path / "in"), "--out", str(out), "--num-shards",
               "3", "--tokenize", "--tokenizer", tok.path, "--force"]
    assert data_cli.main(prepare) == 0
    cfg = DataConfig(sources=[str(out)], tokenizer=tok.path, format="tokens")
    loader = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    assert resume_differences(state, cfg, tok, SEQ, 1) == []
    write_jsonl(tmp_path / "in" / "a.jsonl", texts[:61])
    assert data_cli.main(prepare) == 0
    (line,) = resume_differences(state, cfg, tok, SEQ, 1)
    assert re.match(rf"sources \(data.sources\[0\] \({re.escape(str(out))}\): "
                    rf"train-0000\d-of-00003.tokens changed \(\d+ -> \d+ tokens\)", line)
    with pytest.raises(DataError, match=re.escape(f"data fingerprint differs in {line}")):
        build_train_loader(cfg, tok, SEQ, 2, seed=1).load_state_dict(state)
    assert data_cli.main([*prepare[:6], "2", *prepare[7:]]) == 0
    (line,) = resume_differences(state, cfg, tok, SEQ, 1)
    assert ": train-00000-of-00003.tokens removed, train-00001-of-00003.tokens removed, " \
           "train-00002-of-00003.tokens removed and 2 more change(s))" in line


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update(dtype="int8"), r"tokens.dtype 'int8' is not a token dtype"),
    (lambda t: t.update(dtype="foo"), r"tokens.dtype 'foo' is not a token dtype"),
    (lambda t: t.update(vocab_size=100_000), r"tokens.vocab_size 100000 does not go with"),
    (lambda t: t["shards"][1].update(tokens=t["shards"][1]["tokens"] + 7),
     r"tokens.shards\[1\] \('train-00001-of-00003.tokens'\) lists \d+ tokens of 2 bytes but "
     r"file_bytes \d+"),
    (lambda t: t["shards"][0].update(tokens=None), r"tokens.shards\[0\] .* lists None tokens"),
])
def test_an_edited_token_index_is_refused_naming_the_entry(prepared, tok, tmp_path, edit, match):
    """A manifest whose `tokens` section disagrees with itself (edited by hand, damaged) is a
    one-line error naming the source, the manifest and the entry, before any block is read —
    not a numpy traceback, ids read in the wrong width, or blocks cut at shifted offsets."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(prepared["out"], out)
    cfg = DataConfig(sources=[str(out)], tokenizer=tok.path, format="tokens")
    next(build_train_loader(cfg, tok, SEQ, 2))  # negative control: the copy as written
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest["tokens"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"data.sources\[0\].path: .*manifest.json: {match}"):
        build_train_loader(cfg, tok, SEQ, 2)


def test_trainer_allows_a_dp_change_with_token_data():
    """The trainer's layout check (train/relayout.py) accepts a data-parallel change for
    data.format=tokens, whose stream is independent of dp, and still refuses it for text
    documents sharding (negative control)."""
    from tape_train.config import load_run_config
    from tape_train.parallel.grid import RankGrid
    from tape_train.train import relayout

    def marker(data):
        return {"layout": {"dp": 2, "sp": 1, "tp": 1}, "zero_stage": 3,
                "config": {"train": {"micro_batch_size": 2, "grad_accum_steps": 1,
                                     "synthetic_data": False}, "data": data}}

    now = (load_run_config(None, ["model=tiny", "train.micro_batch_size=2",
                                  "train.grad_accum_steps=2"]), RankGrid.from_sizes(1, rank=0))
    assert relayout.problems(marker({"sharding": "documents", "format": "tokens"}), *now) == []
    (problem,) = relayout.problems(marker({"sharding": "documents", "format": "text"}), *now)
    assert "data.format: tokens" in problem
