"""Input formats, bad input (errors naming file:line, or counted logged skips), held-out eval."""

from __future__ import annotations

import gzip
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tape_train.data import DataConfig, DataError, build_train_loader, iter_eval_documents
from tape_train.data.testing import real_text_documents, write_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def texts():
    return [f"<{i}> {d[:200]}" for i, d in enumerate(real_text_documents(40))]


def cfg_for(path, **kw) -> DataConfig:
    base = dict(sources=[{"path": str(path)}], tokenizer="unused.model", prefetch=0,
                shuffle=False)
    base.update(kw)
    return DataConfig(**base)


def first_tokens(tok, cfg, n_batches=3) -> list[int]:
    loader = build_train_loader(cfg, tok, SEQ, 2)
    out = [t for _ in range(n_batches) for t in next(loader)["input_ids"].flatten().tolist()]
    loader.close()
    return out


def expected_stream(tok, texts) -> list[int]:
    return [t for text in texts for t in [tok.bos_id, *tok.encode(text), tok.eos_id]]


def test_all_formats_give_the_same_stream(tok, texts, tmp_path):
    """jsonl, jsonl.gz, jsonl.zst, parquet, a directory of .txt files, a glob: same documents,
    same tokens, in file order when shuffle is off."""
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"body": texts}), tmp_path / "a.parquet", row_group_size=7)
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    for i, t in enumerate(texts):
        (txt_dir / f"{i:03d}.txt").write_text(t)
    want = expected_stream(tok, texts)
    for cfg in (cfg_for(tmp_path / "a.jsonl"), cfg_for(tmp_path / "a.jsonl.gz"),
                cfg_for(tmp_path / "a.jsonl.zst"), cfg_for(txt_dir),
                cfg_for(tmp_path / "txt" / "*.txt"),
                DataConfig(sources=[{"path": str(tmp_path / "a.parquet"),
                                     "text_field": "body"}], prefetch=0, shuffle=False)):
        blocks = first_tokens(tok, cfg)
        # input_ids are each (SEQ + 1)-token block without its last token
        pos = 0
        for row in range(6):
            assert blocks[row * SEQ:(row + 1) * SEQ] == want[pos:pos + SEQ]
            pos += SEQ + 1


def test_a_utf8_byte_order_mark_starting_a_jsonl_file_is_dropped(tok, texts, tmp_path):
    """Windows editors start a file with a byte-order mark: it was "malformed JSON" at line 1,
    a file no run could read, so reading it now changes no run's stream. Plain, gzip and zstd:
    the stream of the same file without the mark; positions count records, not bytes, so a
    state saved mid-way is the one of the file without the mark and resumes exactly."""
    from tape_train.data.formats import UTF8_BOM, SkipLog, Shard, read_documents

    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "plain.jsonl").write_bytes(lines)
    (tmp_path / "bom.jsonl").write_bytes(UTF8_BOM + lines)
    (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(UTF8_BOM + lines))
    (tmp_path / "bom.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(UTF8_BOM + lines))
    want = first_tokens(tok, cfg_for(tmp_path / "plain.jsonl"), 6)
    for name in ("bom.jsonl", "bom.jsonl.gz", "bom.jsonl.zst"):
        assert first_tokens(tok, cfg_for(tmp_path / name), 6) == want, name
    states = {}
    for name in ("plain.jsonl", "bom.jsonl"):
        loader = build_train_loader(cfg_for(tmp_path / name), tok, SEQ, 2)
        for _ in range(3):
            next(loader)
        states[name] = json.loads(json.dumps(loader.state_dict()))
        loader.close()
    assert states["bom.jsonl"]["position"] == states["plain.jsonl"]["position"]
    resumed = build_train_loader(cfg_for(tmp_path / "bom.jsonl"), tok, SEQ, 2)
    resumed.load_state_dict(states["bom.jsonl"])
    rest = [t for _ in range(3) for t in next(resumed)["input_ids"].flatten().tolist()]
    resumed.close()
    assert rest == want[3 * 2 * SEQ:]
    # Only at the start of a JSONL file: a plain-text file keeps its bytes, the mark included,
    # and a mark starting a later line (files joined with theirs) is an error that says so.
    (tmp_path / "bom.txt").write_bytes(UTF8_BOM + b"some text")
    text = Shard("text", str(tmp_path / "bom.txt"))
    assert list(read_documents(text, 0, "text", False, SkipLog())) == [(0, "\ufeffsome text")]
    joined = _write_lines(tmp_path / "joined.jsonl", [UTF8_BOM + GOOD, UTF8_BOM + GOOD])
    docs = read_documents(Shard("jsonl", str(joined)), 0, "text", False, SkipLog())
    assert next(docs) == (0, "a good document with some words")
    with pytest.raises(DataError, match=r"joined\.jsonl:2: malformed JSON: a UTF-8 byte-order "
                                        r"mark starts this line, not the file"):
        next(docs)


def test_hub_source_through_datasets_streaming(tok, texts, tmp_path):
    """`hub:` sources go through datasets.load_dataset(streaming=True); a local dataset
    directory stands in for the Hub (no network here). Resume is exact there too."""
    hub = tmp_path / "hubdata"
    hub.mkdir()
    for s in range(2):
        pq.write_table(pa.table({"text": texts[s::2]}), hub / f"part-{s}.parquet")
    cfg = DataConfig(sources=[{"hub": str(hub), "split": "train"}], prefetch=0,
                     shuffle_buffer=5)
    ref = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    reference = [next(ref)["input_ids"] for _ in range(12)]
    first = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    for _ in range(7):
        next(first)
    resumed = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert all(bool((next(resumed)["input_ids"] == r).all()) for r in reference[7:])
    # Any datasets builder with data_files: the same files through the "parquet" builder.
    via_builder = DataConfig(sources=[{"hub": "parquet", "data_files": str(hub / "*.parquet")}],
                             prefetch=0, shuffle_buffer=5)
    loader = build_train_loader(via_builder, tok, SEQ, 2, seed=1)
    assert next(loader)["input_ids"].shape == (2, SEQ)


def _write_lines(path, lines: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


GOOD = json.dumps({"text": "a good document with some words"}).encode()
BAD_CASES = {
    "malformed JSON": b'{"text": "unterminated',
    "missing text field": json.dumps({"body": "wrong field"}).encode(),
    "text not a string": json.dumps({"text": 42}).encode(),
    "invalid UTF-8": b'{"text": "caf\xe9 latin-1 byte"}',
}
LONE_SURROGATE = b'{"text": "escaped lone surrogate \\udc80 here"}'  # valid JSON, invalid text


@pytest.mark.parametrize("reason", sorted(BAD_CASES))
def test_bad_record_is_an_error_naming_file_and_line(tok, tmp_path, reason):
    path = _write_lines(tmp_path / "bad.jsonl", [GOOD, GOOD, BAD_CASES[reason], GOOD])
    loader = build_train_loader(cfg_for(path), tok, SEQ, 2)
    with pytest.raises(DataError) as info:
        for _ in range(5):
            next(loader)
    message = str(info.value)
    assert f"{path}:3" in message and reason in message and "skip_bad_records" in message


def test_lone_surrogate_is_invalid_text(tok, tmp_path):
    path = _write_lines(tmp_path / "s.jsonl", [GOOD, LONE_SURROGATE])
    with pytest.raises(DataError, match=r"s.jsonl:2: invalid UTF-8: lone surrogate"):
        loader = build_train_loader(cfg_for(path), tok, SEQ, 2)
        for _ in range(3):
            next(loader)


@pytest.mark.parametrize("reason", sorted(BAD_CASES))
def test_bad_record_is_skipped_counted_and_logged_when_configured(tok, tmp_path, reason,
                                                                  caplog):
    path = _write_lines(tmp_path / "bad.jsonl", [GOOD, GOOD, BAD_CASES[reason], GOOD])
    loader = build_train_loader(cfg_for(path, skip_bad_records=True, prefetch=2), tok, SEQ, 2)
    with caplog.at_level(logging.WARNING, logger="tape_train.data"):
        next(loader)
    assert loader.stats["skipped"][reason] >= 1
    assert f"{path}:3" in caplog.text and reason in caplog.text
    loader.close()


def test_error_in_prefetch_thread_reaches_the_consumer(tok, tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", [GOOD, BAD_CASES["malformed JSON"]])
    loader = build_train_loader(cfg_for(path, prefetch=3), tok, SEQ, 2)
    with pytest.raises(DataError, match="bad.jsonl:2"):
        next(loader)


def test_empty_documents_and_files_are_counted_not_lost(tok, tmp_path, caplog):
    docs = ["first real document here", "", "   \n ", "second real document"]
    write_jsonl(tmp_path / "d" / "a.jsonl", docs)
    (tmp_path / "d" / "empty.jsonl").write_bytes(b"")
    loader = build_train_loader(cfg_for(tmp_path / "d"), tok, 8, 1)
    with caplog.at_level(logging.WARNING, logger="tape_train.data"):
        stream = [t for _ in range(6) for t in next(loader)["input_ids"].flatten().tolist()]
    assert loader.stats["skipped"]["empty document"] >= 2
    assert loader.stats["skipped"]["empty file"] >= 1
    assert "empty.jsonl" in caplog.text and "a.jsonl:2" in caplog.text
    want = expected_stream(tok, [docs[0], docs[3]])
    assert [t for i, t in enumerate(want) if i % 9 != 8][:len(stream)] == stream[:len(want)
                                                                                 - len(want) // 9]


@pytest.mark.parametrize("setup, match", [
    (lambda d: str(d / "missing.jsonl"), "no such file or directory"),
    (lambda d: str(d / "*.nothing"), "matched no supported files"),
    (lambda d: (d / "x.csv").write_text("a,b") and str(d / "x.csv"), "unsupported file type"),
    (lambda d: (d / "sub").mkdir() or str(d / "sub"), "holds no supported files"),
])
def test_missing_or_unsupported_paths_name_the_key(tok, tmp_path, setup, match):
    path = setup(tmp_path)
    with pytest.raises(DataError, match=match) as info:
        build_train_loader(cfg_for(path), tok, SEQ, 2)
    assert "data.sources[0].path" in str(info.value)


def test_a_saved_datasets_directory_as_path_says_to_read_it_as_hub(tok, texts, tmp_path):
    """``datasets``' save_to_disk writes Arrow files, which ``path`` does not read; ``hub``
    does (through load_dataset), and the error says so."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"holds no supported files .*save_to_disk.*hub: "):
        build_train_loader(cfg_for(tmp_path / "saved"), tok, SEQ, 2)
    hub = DataConfig(sources=[{"hub": str(tmp_path / "saved")}], prefetch=0, shuffle=False)
    want = expected_stream(tok, texts)  # two rows: blocks of SEQ + 1 tokens less their last
    assert first_tokens(tok, hub, 1) == want[:SEQ] + want[SEQ + 1:2 * SEQ + 1]
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError) as info:  # negative control: no such advice elsewhere
        build_train_loader(cfg_for(tmp_path / "plain"), tok, SEQ, 2)
    assert "save_to_disk" not in str(info.value)


def test_source_with_only_empty_files_is_an_error(tok, tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    loader = build_train_loader(cfg_for(tmp_path / "e.jsonl"), tok, SEQ, 2)
    with pytest.raises(DataError, match="no usable documents"):
        next(loader)


def test_truncated_compressed_file_names_the_file(tok, tmp_path):
    data = zstandard.ZstdCompressor().compress(
        b"".join(json.dumps({"text": f"doc {i} " * 50}).encode() + b"\n" for i in range(200)))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    loader = build_train_loader(cfg_for(path), tok, SEQ, 4)
    with pytest.raises(DataError, match="cut.jsonl.zst: cannot read after line .*truncated"):
        for _ in range(200):
            next(loader)
    gz = tmp_path / "cut.jsonl.gz"
    full = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 20}).encode() + b"\n"
                                  for i in range(2000)))
    gz.write_bytes(full[: len(full) // 2])
    loader = build_train_loader(cfg_for(gz), tok, SEQ, 4)
    with pytest.raises(DataError, match="cut.jsonl.gz: cannot read after line"):
        for _ in range(2000):
            next(loader)


def test_damaged_parquet_data_names_the_file_not_the_output(tok, texts, tmp_path, capsys):
    """A Parquet file whose footer reads but whose compressed column data is damaged failed
    with a bare OSError ("Corrupt snappy compressed data."), which `tape-data prepare` blamed
    on its --out directory."""
    from tape_train.data.cli import main

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts}), path, compression="snappy")
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    data = bytearray(path.read_bytes())
    middle = (column.dictionary_page_offset or column.data_page_offset) + \
        column.total_compressed_size // 2
    assert first_tokens(tok, cfg_for(path), 1)  # control: intact, it reads
    data[middle:middle + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    loader = build_train_loader(cfg_for(path), tok, SEQ, 2)
    with pytest.raises(DataError, match=r"d\.parquet: cannot read row group 0 of 1 \(.+\); "
                                        r"corrupt or truncated file\?"):
        next(loader)
    assert main(["prepare", "--input", str(path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{path}: cannot read row group 0" in err and str(tmp_path / "out") not in err


def test_parquet_missing_column_is_an_error(tok, tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    loader = build_train_loader(cfg_for(tmp_path / "p.parquet"), tok, SEQ, 2)
    with pytest.raises(DataError, match="no column 'text'.*body"):
        next(loader)


def test_eval_documents_are_held_out_from_training(tok, texts, tmp_path):
    write_jsonl(tmp_path / "c" / "all.jsonl", texts)
    cfg = cfg_for(tmp_path / "c", eval_fraction=0.3)
    evals = list(iter_eval_documents(cfg, tok))
    assert 3 <= len(evals) <= 25
    eval_texts = set()
    for ids, n_bytes in evals:
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        text = tok.decode(ids[1:-1])
        assert n_bytes == len(text.encode("utf-8"))
        eval_texts.add(text)
    # One full epoch of training documents (shuffle off: file order, minus held-out ones).
    loader = build_train_loader(cfg, tok, 16, 1)
    train_tokens = []
    for _ in range(300):
        batch = next(loader)  # whole block: input_ids plus the last label
        train_tokens += batch["input_ids"][0].tolist() + batch["labels"][0, -1:].tolist()
    train_text = tok.decode([t for t in train_tokens if t not in (tok.bos_id, tok.eos_id)])
    assert not any(t in train_text for t in eval_texts)  # no held-out document is trained on
    assert all(t in train_text for t in texts if t not in eval_texts)  # the rest all are
    capped = list(iter_eval_documents(cfg_for(tmp_path / "c", eval_fraction=0.3,
                                              eval_max_documents=2), tok))
    assert len(capped) == 2


def test_eval_min_tokens_keeps_only_long_documents(tok, texts, tmp_path):
    write_jsonl(tmp_path / "heldout.jsonl", texts[:12])
    base = dict(eval_sources=[str(tmp_path / "heldout.jsonl")])
    every = list(iter_eval_documents(cfg_for(tmp_path / "heldout.jsonl", **base), tok))
    lengths = sorted(len(ids) for ids, _ in every)
    threshold = lengths[len(lengths) // 2]
    assert lengths[0] < threshold  # the filter has something to drop (negative control)
    long = list(iter_eval_documents(
        cfg_for(tmp_path / "heldout.jsonl", eval_min_tokens=threshold, **base), tok))
    assert long == [d for d in every if len(d[0]) >= threshold]  # same order, only long ones
    capped = list(iter_eval_documents(cfg_for(tmp_path / "heldout.jsonl", eval_min_tokens=threshold,
                                              eval_max_documents=2, **base), tok))
    assert capped == long[:2]  # the cap counts kept documents only
    with pytest.raises(DataError, match="data.eval_min_tokens must be a positive integer"):
        cfg_for(tmp_path / "heldout.jsonl", eval_min_tokens=0)


def test_eval_sources_and_missing_eval_data(tok, texts, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", texts[:20])
    write_jsonl(tmp_path / "heldout.jsonl", texts[20:25])
    cfg = cfg_for(tmp_path / "train.jsonl", eval_sources=[str(tmp_path / "heldout.jsonl")])
    got = [tok.decode(ids[1:-1]) for ids, _ in iter_eval_documents(cfg, tok)]
    assert got == texts[20:25]
    with pytest.raises(DataError, match="no held-out data"):
        list(iter_eval_documents(cfg_for(tmp_path / "train.jsonl"), tok))
