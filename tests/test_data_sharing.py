"""Each data-parallel rank reads only its own share (documents sharding): local shards and Hub
streams, disjoint and complete per epoch, exact resume."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tape_train.data import DataConfig, SourceConfig, build_train_loader
from tape_train.data import formats
from tape_train.data.formats import SkipLog
from tape_train.data.sources import SourceCursor, rank_share
from tape_train.data.testing import real_text_documents, write_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def texts():
    return [f"[T{i:03d}] {t[:200]}" for i, t in enumerate(real_text_documents(60))]


def epoch_documents(source: SourceConfig, rank: int, world: int) -> list[str]:
    """The documents rank ``rank`` of ``world`` reads in its first epoch."""
    cursor = SourceCursor(source, 0, 3, True, 4, 0.0, False, SkipLog(), rank, world)
    docs = []
    while True:
        text = cursor.next_document()
        if cursor.epoch > 0:
            return docs
        docs.append(text)


@pytest.mark.parametrize("shards", [1, 3, 4, 7, 16])
def test_rank_share_assigns_every_record_to_exactly_one_rank(shards):
    records = 12
    for world in (1, 2, 3, 4, 8, 64):
        owners = {}
        for rank in range(world):
            own, stride, phase = rank_share(shards, rank, world)
            assert len(own) <= -(-shards // world) or len(own) == 1  # ≤ ceil(S/n), or 1 shard
            for s in own:
                for r in range(phase, records, stride):
                    assert (s, r) not in owners, (world, rank, s, r)
                    owners[(s, r)] = rank
        assert len(owners) == shards * records


def test_local_ranks_open_only_their_own_shards(texts, tmp_path, monkeypatch):
    for s in range(4):
        write_jsonl(tmp_path / "c" / f"part{s}.jsonl", texts[s::4])
    source = SourceConfig(path=str(tmp_path / "c"), key="data.sources[0]")
    opened = []
    real = formats._iter_lines
    monkeypatch.setattr(formats, "_iter_lines", lambda shard, *a: (opened.append(shard.path),
                                                                   real(shard, *a))[1])
    per_rank = []
    for rank in range(2):
        opened.clear()
        per_rank.append(epoch_documents(source, rank, 2))
        names = {p.rsplit("/", 1)[1] for p in opened}
        assert names == {f"part{rank}.jsonl", f"part{rank + 2}.jsonl"}, names
    assert sorted(per_rank[0] + per_rank[1]) == sorted(texts)
    # 8 ranks over 4 shards: each opens one shard and keeps every other record.
    per_rank = []
    for rank in range(8):
        opened.clear()
        per_rank.append(epoch_documents(source, rank, 8))
        assert {p.rsplit("/", 1)[1] for p in opened} == {f"part{rank % 4}.jsonl"}
    merged = [d for docs in per_rank for d in docs]
    assert sorted(merged) == sorted(texts) and len(set(merged)) == len(merged)


def test_hub_stream_ranks_read_disjoint_complete_shares(tok, texts, tmp_path):
    """Parquet through `datasets` streaming (`hub: parquet` + data_files stands in for the Hub)
    is read by row group (`IterableDataset.reshard`): each rank reads its own row groups, the
    same documents as `datasets.distributed.split_dataset_by_node` on the re-sharded stream,
    also with more ranks than files."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    hub = tmp_path / "hub"
    hub.mkdir()
    for s in range(2):
        pq.write_table(pa.table({"text": texts[s::2]}), hub / f"part-{s}.parquet",
                       row_group_size=10)  # 3 row groups per file
    source = SourceConfig(hub="parquet", data_files=str(hub / "*.parquet"),
                          key="data.sources[0]")
    ds = load_dataset("parquet", data_files=str(hub / "*.parquet"), split="train",
                      streaming=True).reshard()
    assert ds.n_shards == 6
    for rank in range(2):
        ours = epoch_documents(source, rank, 2)
        theirs = [r["text"] for r in split_dataset_by_node(ds, rank=rank, world_size=2)]
        assert sorted(ours) == sorted(theirs) and len(ours) == 30
    resharded = SourceCursor(source, 0, 3, True, 4, 0.0, False, SkipLog(), 5, 6)
    assert len(resharded.all_shards) == 6 and len(resharded.shards) == 1
    assert resharded.stride == 1  # whole row groups, no record interleaving
    per_rank = [epoch_documents(source, rank, 6) for rank in range(6)]
    assert all(len(docs) == 10 for docs in per_rank)  # one row group each
    merged = [d for docs in per_rank for d in docs]
    assert sorted(merged) == sorted(texts)
    # Exact resume on rank 4 of 6, through the loader.
    cfg = DataConfig(sources=[source.to_dict()], prefetch=0, shuffle_buffer=4)
    ref = build_train_loader(cfg, tok, SEQ, 2, 4, 6, seed=2)
    reference = [next(ref)["input_ids"] for _ in range(10)]
    first = build_train_loader(cfg, tok, SEQ, 2, 4, 6, seed=2)
    for _ in range(6):
        next(first)
    resumed = build_train_loader(cfg, tok, SEQ, 2, 4, 6, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert all(torch.equal(next(resumed)["input_ids"], r) for r in reference[6:])


def _two_parquet_files(texts, directory) -> str:
    """2 files × 3 row groups of 10 rows; returns the data_files glob."""
    directory.mkdir()
    for s in range(2):
        pq.write_table(pa.table({"text": texts[s::2]}), directory / f"part-{s}.parquet",
                       row_group_size=10)
    return str(directory / "*.parquet")


def test_parquet_hub_shards_are_row_groups_so_a_resume_reads_one(texts, tmp_path):
    """Every Parquet Hub shard is one row group (also with fewer ranks than files), so reading
    from record k of a shard streams at most that row group; JSON streams keep file shards."""
    glob = _two_parquet_files(texts, tmp_path / "pq")
    rows = [t for s in range(2) for t in texts[s::2]]  # the files' rows, in order
    source = SourceConfig(hub="parquet", data_files=glob, key="data.sources[0]")
    for world in (1, 2):
        cursor = SourceCursor(source, 0, 3, True, 4, 0.0, False, SkipLog(), 0, world)
        assert len(cursor.all_shards) == 6
    ds, shards = formats.hub_shards(source)
    for i, shard in enumerate(shards):
        got = list(formats.read_documents(shard, 0, "text", False, SkipLog(), ds))
        assert [t for _, t in got] == rows[10 * i:10 * i + 10]
        resumed = list(formats.read_documents(shard, 7, "text", False, SkipLog(), ds))
        assert resumed == [(r, rows[10 * i + r]) for r in (7, 8, 9)]
    # Control: the same files as file shards (the rule before) hold 30 records each.
    _, files = formats.hub_shards(source, row_groups=False)
    assert len(files) == 2
    write_jsonl(tmp_path / "js" / "a.jsonl", texts[:30])
    json_source = SourceConfig(hub="json", data_files=str(tmp_path / "js" / "*.jsonl"), key="k")
    assert len(formats.hub_shards(json_source)[1]) == 1
    # Its one file shared by 3 ranks: every third record each, disjoint and complete.
    per_rank = [epoch_documents(json_source, rank, 3) for rank in range(3)]
    assert [len(docs) for docs in per_rank] == [10, 10, 10]
    assert sorted(d for docs in per_rank for d in docs) == sorted(texts[:30])


def test_hub_state_saved_with_file_shards_still_resumes_exactly(tok, texts, tmp_path,
                                                                 monkeypatch, caplog):
    """A state saved when Parquet Hub streams were sharded by file (before row groups: rank 0
    of 2 over 2 files read file shards) has another fingerprint; it resumes its own stream
    exactly, with a warning, and a fresh loader reads row groups (another stream)."""
    from tape_train.data import DataError, sources

    glob = _two_parquet_files(texts, tmp_path / "pq")
    cfg = DataConfig(sources=[{"hub": "parquet", "data_files": glob}], prefetch=0,
                     shuffle_buffer=4)
    real = sources.hub_shards
    with monkeypatch.context() as patch:  # the code before: file shards when files >= ranks
        patch.setattr(sources, "hub_shards", lambda source, min_shards=1, row_groups=True:
                      real(source, min_shards, row_groups=False))
        ref = build_train_loader(cfg, tok, SEQ, 2, 0, 2, seed=2)
        reference = [next(ref)["input_ids"] for _ in range(10)]
        first = build_train_loader(cfg, tok, SEQ, 2, 0, 2, seed=2)
        for _ in range(5):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))
    fresh = build_train_loader(cfg, tok, SEQ, 2, 0, 2, seed=2)
    assert fresh.fingerprint != state["fingerprint"]
    assert not all(torch.equal(next(fresh)["input_ids"], r) for r in reference[:3])
    resumed = build_train_loader(cfg, tok, SEQ, 2, 0, 2, seed=2)
    with caplog.at_level("WARNING", logger="tape_train.data"):
        resumed.load_state_dict(state)
    assert "file by file" in caplog.text
    assert all(torch.equal(next(resumed)["input_ids"], r) for r in reference[5:])
    assert resumed.state_dict()["fingerprint"] == state["fingerprint"]
    with pytest.raises(DataError, match=r"fingerprint differs in seed \(saved 2, now 3\)\. "):
        build_train_loader(cfg, tok, SEQ, 2, 0, 2, seed=3).load_state_dict(state)  # no pass


def _shared_shard_warnings(tok, caplog, cfg, rank, world) -> list[str]:
    caplog.clear()
    with caplog.at_level("WARNING", logger="tape_train.data"):
        build_train_loader(cfg, tok, SEQ, 2, rank, world).close()
    return [r.getMessage() for r in caplog.records if "share one shard" in r.getMessage()]


def test_ranks_sharing_shards_are_warned_about_once_on_rank_0(tok, texts, tmp_path, caplog):
    for s in range(2):
        write_jsonl(tmp_path / "c" / f"part{s}.jsonl", texts[s::2])
    cfg = DataConfig(sources=[str(tmp_path / "c")], prefetch=0)
    (line,) = _shared_shard_warnings(tok, caplog, cfg, 0, 8)
    for part in ("data.sources[0]", "2 shard(s) for 8 data-parallel ranks", "up to 4 ranks",
                 "4x the bytes read", f"tape-data prepare --input {tmp_path / 'c'} --out DIR "
                 "--num-shards 8", "data.format: tokens"):
        assert part in line, part
    from tape_train.data.corpus import write_corpus

    write_corpus(({"text": t, "source": "s", "id": str(i)} for i, t in enumerate(texts)),
                 tmp_path / "p", num_shards=2)
    (line,) = _shared_shard_warnings(tok, caplog, DataConfig(sources=[str(tmp_path / "p")],
                                                             prefetch=0), 0, 4)
    assert f"re-run the `tape-data prepare` that wrote {tmp_path / 'p'} with --num-shards 4" \
        in line  # not --input of the directory, which would lose its eval split
    assert _shared_shard_warnings(tok, caplog, cfg, 1, 8) == []  # rank 0 only
    assert _shared_shard_warnings(tok, caplog, cfg, 0, 2) == []  # S >= n: whole shards
    assert _shared_shard_warnings(tok, caplog, DataConfig(sources=[str(tmp_path / "c")],
                                                          prefetch=0, sharding="global"),
                                  0, 8) == []  # every rank reads everything anyway


def test_prepared_shards_resume_from_the_nearest_zstd_frame(texts, tmp_path, monkeypatch):
    """Prepared shards are written as many zstd frames, indexed in the manifest, so reading
    from record k decompresses from the frame holding k — not from the start of the shard."""
    from tape_train.data.corpus import write_corpus
    from tape_train.data.formats import read_documents, resolve_local_shards

    docs = [{"text": t, "source": "s", "id": str(i)} for i, t in enumerate(texts)]
    write_corpus(docs, tmp_path / "p", num_shards=1, eval_fraction=0.0, frame_bytes=2000)
    (shard,) = resolve_local_shards(SourceConfig(path=str(tmp_path / "p"), key="k"))
    assert len(shard.frames) > 5 and shard.frames[0] == (0, 0)
    full = list(read_documents(shard, 0, "text", False, SkipLog()))
    assert [i for i, _ in full] == list(range(len(texts)))
    offsets = []
    real = formats._zstd_chunks
    monkeypatch.setattr(formats, "_zstd_chunks", lambda path, chunk_bytes=1 << 20, offset=0: (
        offsets.append(offset), real(path, chunk_bytes, offset))[1])
    for k in (0, 1, 17, 33, len(texts) - 1):
        offsets.clear()
        assert list(read_documents(shard, k, "text", False, SkipLog())) == full[k:], k
        expected = max(o for o, r in shard.frames if r <= k)
        assert offsets == [expected] and (k < shard.frames[1][1] or expected > 0)
