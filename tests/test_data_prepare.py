"""`tape-data prepare`: local inputs and the Debian demo corpus; manifest, idempotence."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest

from tape_train.data import DataConfig, build_train_loader, iter_eval_documents
from tape_train.data import cli as data_cli
from tape_train.data import tokenizer_cli
from tape_train.data.corpus import read_complete_manifest
from tape_train.data.sources import is_held_out
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl


def _prepare_input(tmp_path, texts, out, *extra):
    return data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--out", str(out),
                          "--num-shards", "4", "--eval-fraction", "0.2", *extra])


def test_prepare_local_inputs(tmp_path, capsys):
    texts = real_text_documents(60)
    write_jsonl(tmp_path / "in" / "a.jsonl", texts[:40] + texts[:5])  # 5 exact duplicates
    for i, t in enumerate(texts[40:]):
        (tmp_path / "in" / f"t{i}.txt").write_text(t)
    out = tmp_path / "out"
    assert _prepare_input(tmp_path, texts, out) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    assert len(train) == 4 and manifest["splits"]["eval"]["shards"] == 1
    assert manifest["dropped"]["duplicates"] == 5
    total = manifest["splits"]["train"]["documents"] + manifest["splits"]["eval"]["documents"]
    assert total == len(set(texts))
    for shard in manifest["shards"]:
        data = (out / shard["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == shard["file_bytes"]
    # The held-out split is exactly the hash rule, and disjoint from training.
    cfg = DataConfig(sources=[str(out)], prefetch=0)
    import zstandard
    eval_lines = zstandard.ZstdDecompressor().stream_reader(
        open(out / "eval-00000-of-00001.jsonl.zst", "rb")).read().decode().splitlines()
    held = {json.loads(line)["text"] for line in eval_lines}
    assert held == {t for t in set(texts) if is_held_out(t, 0.2)} and held
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=500, max_bytes=200_000)
    evals = {tok.decode(ids[1:-1]) for ids, _ in iter_eval_documents(cfg, tok)}
    assert evals == held
    loader = build_train_loader(cfg, tok, 32, 2)
    assert next(loader)["input_ids"].shape == (2, 32)
    # Idempotent: a second run with the same options does nothing.
    mtime = (out / "manifest.json").stat().st_mtime_ns
    capsys.readouterr()
    assert _prepare_input(tmp_path, texts, out) == 0
    assert "already complete" in capsys.readouterr().out
    assert (out / "manifest.json").stat().st_mtime_ns == mtime
    # A damaged directory (a shard missing) is not complete, and a re-run repairs it.
    (out / train[0]["path"]).unlink()
    assert read_complete_manifest(out) is None
    assert _prepare_input(tmp_path, texts, out) == 0
    assert read_complete_manifest(out) is not None


def test_partial_output_is_never_taken_as_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00000-of-00004.jsonl.zst").write_bytes(b"partial")
    assert read_complete_manifest(out) is None
    (out / "manifest.json").write_text('{"format": "tape-data/1", "shards": [{"path": '
                                       '"train-00000-of-00004.jsonl.zst", "file_bytes": 999}]}')
    assert read_complete_manifest(out) is None  # size mismatch


def test_prepare_bad_input_is_an_error(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"),
                          "--out", str(tmp_path / "o")]) == 1
    assert "a.jsonl:2: malformed JSON" in capsys.readouterr().err
    assert not (tmp_path / "o" / "manifest.json").exists()
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--skip-bad-records",
                          "--out", str(tmp_path / "o")]) == 0


def _apt_reaches_archive() -> str | None:
    if not all(shutil.which(t) for t in ("apt-get", "apt-cache", "dpkg-deb")):
        return "apt-get/apt-cache/dpkg-deb not installed (not a Debian/Ubuntu machine)"
    probe = subprocess.run(["apt-cache", "show", "--no-all-versions", "fortunes-min"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return "apt has no package lists for the demo packages (run `apt-get update`)"
    return None


@pytest.mark.slow
def test_prepare_demo_corpus_end_to_end(tmp_path, capsys):
    reason = _apt_reaches_archive()
    if reason:
        pytest.skip(reason)
    out, cache = tmp_path / "demo", tmp_path / "cache"
    assert data_cli.main(["prepare", "--demo", "--out", str(out), "--cache-dir",
                          str(cache)]) == 0
    manifest = read_complete_manifest(out)
    assert manifest is not None
    assert manifest["splits"]["train"]["shards"] == 16
    assert manifest["splits"]["train"]["text_bytes"] > 10e6
    assert manifest["splits"]["eval"]["documents"] > 50
    assert len(manifest["packages"]) >= 6
    assert all(s["documents"] > 0 for s in manifest["sources"].values())
    capsys.readouterr()
    assert data_cli.main(["prepare", "--demo", "--out", str(out), "--cache-dir",
                          str(cache)]) == 0
    assert "already complete" in capsys.readouterr().out
    assert tokenizer_cli.main(["train", "--input", str(out), "--vocab-size", "1000",
                               "--max-bytes", "3000000", "--out", str(out / "tokenizer")]) == 0
    from tape_train.data import load_tokenizer
    tok = load_tokenizer(out / "tokenizer.model")
    cfg = DataConfig(sources=[str(out)], tokenizer=str(out / "tokenizer.model"),
                     eval_max_documents=20)
    loader = build_train_loader(cfg, tok, 128, 2, seed=0)
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 128)
    text = tok.decode(batch["input_ids"][0].tolist())
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)  # real prose, not bytes
    loader.close()
    assert len(list(iter_eval_documents(cfg, tok))) == 20
