"""Training loader: batch contract, exact resume, data-parallel sharding, fingerprint, prefetch."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from tape_train.data import DataConfig, DataError, build_train_loader
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

SEQ = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources of uniquely tagged real-text documents: A (3 shards, 45 docs), B (1 shard,
    6 docs). Small, so a few dozen batches cross several epoch boundaries."""
    root = tmp_path_factory.mktemp("corpus")
    docs = real_text_documents()
    a = [f"[A{i:03d}] {docs[i % len(docs)][:250]}" for i in range(45)]
    b = [f"[B{i:03d}] {docs[(7 * i + 3) % len(docs)][:150]}" for i in range(6)]
    for s in range(3):
        write_jsonl(root / "a" / f"part{s}.jsonl", a[s::3])
    write_jsonl(root / "b" / "only.jsonl", b)
    return {"root": root, "a": a, "b": b}


def make_cfg(corpus, **kw) -> DataConfig:
    base = dict(sources=[{"path": str(corpus["root"] / "a"), "weight": 2.0},
                         {"path": str(corpus["root"] / "b"), "weight": 1.0}],
                tokenizer="unused-here.model", shuffle_buffer=7, prefetch=2,
                block_shuffle_window=5)  # windows of 5 blocks: resumes cut mid-window
    base.update(kw)
    return DataConfig(**base)


def take(loader, n):
    out = [next(loader) for _ in range(n)]
    return [torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in out]


def split_documents(tok, rows) -> list[str]:
    """Decode a rank's consecutive blocks back into its complete documents (BOS ... EOS)."""
    stream = [t for row in rows for t in row.flatten().tolist()]
    docs, current = [], None
    for t in stream:
        if t == tok.bos_id:
            current = []
        elif t == tok.eos_id and current is not None:
            docs.append(tok.decode(current))
            current = None
        elif current is not None:
            current.append(t)
    return docs


def test_batch_contract(tok, corpus):
    loader = build_train_loader(make_cfg(corpus), tok, seq_len=SEQ, micro_batch_size=3)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels"}
    for key in ("input_ids", "labels"):
        assert batch[key].shape == (3, SEQ) and batch[key].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # shifted by one
    assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < tok.vocab_size
    assert loader.wait_seconds > 0
    state = loader.state_dict()
    json.dumps(state)  # JSON-serialisable
    inputs = state.pop("fingerprint_inputs")  # what names a changed file: grows with the files
    assert len(json.dumps(state)) < 1000  # small
    assert len(json.dumps(inputs)) < 800 + 100 * 4  # 4 files
    loader.close()


@pytest.mark.parametrize("prefetch, sharding, dp", [(2, "documents", (0, 1)),
                                                     (0, "documents", (1, 2)),
                                                     (3, "global", (1, 2))])
def test_exact_resume_at_many_cut_points(tok, corpus, prefetch, sharding, dp):
    """Shuffle on, a mixture, several epoch boundaries, prefetch on: after restoring the state
    taken at any cut point, batches are identical to the uninterrupted run."""
    cfg = make_cfg(corpus, prefetch=prefetch, sharding=sharding)
    kw = dict(seq_len=SEQ, micro_batch_size=2, dp_rank=dp[0], dp_size=dp[1], seed=5)
    ref_loader = build_train_loader(cfg, tok, **kw)
    total = 48
    reference = take(ref_loader, total)
    epochs = [c[0] for c in ref_loader.state_dict()["position"]["stream"]["sources"]]
    assert max(epochs) >= 2, "the test must cross epoch boundaries"
    ref_loader.close()
    for cut in (0, 1, 2, 5, 9, 17, 23, 31, 38, 46):
        first = build_train_loader(cfg, tok, **kw)
        assert all(torch.equal(x, y) for x, y in zip(take(first, cut), reference[:cut]))
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = build_train_loader(cfg, tok, **kw)
        resumed.load_state_dict(state)
        got = take(resumed, min(3, total - cut))
        assert all(torch.equal(x, y) for x, y in zip(got, reference[cut:cut + len(got)])), cut
        # Resume a resumed loader once more (a second resume must not restart the stream).
        state2 = json.loads(json.dumps(resumed.state_dict()))
        resumed.close()
        again = build_train_loader(cfg, tok, **kw)
        again.load_state_dict(state2)
        nxt = cut + len(got)
        if nxt < total:
            assert torch.equal(take(again, 1)[0], reference[nxt])
        again.close()


def test_resume_negative_control(tok, corpus):
    """A different seed gives a different stream (so equality above is not vacuous)."""
    a = build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ, 2, seed=1)
    b = build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ, 2, seed=2)
    assert not all(torch.equal(x, y) for x, y in zip(take(a, 5), take(b, 5)))


def test_state_reflects_received_batches_not_prefetched_ones(tok, corpus):
    eager = build_train_loader(make_cfg(corpus, prefetch=6), tok, SEQ, 2, seed=3)
    lazy = build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ, 2, seed=3)
    take(eager, 4)
    take(lazy, 4)
    deadline = time.monotonic() + 20
    while not eager._prefetcher._queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)  # let the producer run ahead until its queue is full
    assert eager._prefetcher._queue.full()
    assert eager.state_dict()["position"] == lazy.state_dict()["position"]
    assert eager.state_dict()["batches_received"] == 4
    eager.close()


def test_documents_sharding_is_disjoint_and_complete(tok, corpus):
    """Each rank's documents come only from its own share: over one epoch of every rank's share,
    the ranks' documents are disjoint and together cover the corpus (source A: 3 shards over 2
    ranks, whole shards; source B: 1 shard over 2 ranks, every other record)."""
    cfg = make_cfg(corpus, prefetch=0, block_shuffle_window=1)  # rows in packing order
    n = 2
    per_rank = [set(split_documents(tok, take(build_train_loader(cfg, tok, SEQ, 2, r, n,
                                                                 seed=9), 60)))
                for r in range(n)]
    tags = [{d[:6] for d in docs} for docs in per_rank]
    assert not tags[0] & tags[1]  # disjoint (each rank crossed several epochs of its share)
    assert tags[0] | tags[1] == {d[:6] for d in corpus["a"] + corpus["b"]}  # complete
    # Negative control: two ranks of *different* world sizes overlap.
    other = set(split_documents(tok, take(build_train_loader(cfg, tok, SEQ, 2, 0, 3,
                                                             seed=9), 30)))
    assert {d[:6] for d in other} & tags[1]


def test_global_sharding_is_independent_of_dp_size(tok, corpus):
    """Global mode: rank r takes global blocks r, r+n, ...; a run stopped on 2 ranks resumes on
    3 ranks and continues the same global block stream."""
    cfg = make_cfg(corpus, prefetch=0, sharding="global")
    b = 2
    flat = [row for batch in take(build_train_loader(cfg, tok, SEQ, 1, 0, 1, seed=4), 40)
            for row in batch]
    two = [build_train_loader(cfg, tok, SEQ, b, r, 2, seed=4) for r in range(2)]
    steps = 3
    for r, loader in enumerate(two):
        rows = [row for batch in take(loader, steps) for row in batch]
        assert all(torch.equal(x, y) for x, y in zip(rows, flat[r::2]))
    states = [loader.state_dict() for loader in two]
    assert states[0]["position"] == states[1]["position"]  # rank-independent state
    consumed = steps * b * 2
    assert states[0]["position"]["blocks"] == consumed
    for r in range(3):
        loader = build_train_loader(cfg, tok, SEQ, b, r, 3, seed=4)
        loader.load_state_dict(states[0])
        rows = [row for batch in take(loader, 2) for row in batch]
        assert all(torch.equal(x, y) for x, y in zip(rows, flat[consumed + r::3])), r


def test_fingerprint_mismatch_is_an_error_unless_overridden(tok, corpus, tmp_path, caplog):
    loader = build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ, 2, seed=1)
    take(loader, 3)
    state = loader.state_dict()
    other_seq = build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ + 8, 2, seed=1)
    with pytest.raises(DataError, match="seq_len") as info:
        other_seq.load_state_dict(state)
    assert "allow_mismatch" in str(info.value)
    other_tok = train_small_tokenizer(tmp_path, vocab_size=700)
    with pytest.raises(DataError, match="tokenizer"):
        build_train_loader(make_cfg(corpus, prefetch=0), other_tok, SEQ, 2,
                           seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="sources"):
        build_train_loader(make_cfg(corpus, prefetch=0, sources=[
            {"path": str(corpus["root"] / "a"), "weight": 1.0},
            {"path": str(corpus["root"] / "b"), "weight": 1.0}]), tok, SEQ, 2,
            seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="dp_rank/dp_size"):
        build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ, 2, 0, 2,
                           seed=1).load_state_dict(state)
    with caplog.at_level("WARNING", logger="tape_train.data"):
        other_seq.load_state_dict(state, allow_mismatch=True)
    assert "allow_mismatch=True" in caplog.text
    assert next(other_seq)["input_ids"].shape == (2, SEQ + 8)


def _changed_corpus(tmp_path, corpus):
    """A copy of the fixture's corpus that a test may edit: A (3 files), B (1 file)."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(corpus["root"], root)
    return {**corpus, "root": root}


def _state_after_two_batches(tok, corpus, tmp_path):
    """``(data, cfg, state, expected)``: an editable copy of the corpus, its loader config,
    the loader's state after two batches and the two batches that follow it."""
    data = _changed_corpus(tmp_path, corpus)
    cfg = make_cfg(data, prefetch=0)
    loader = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    take(loader, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    return data, cfg, state, take(loader, 2)


def test_a_changed_corpus_is_named_file_by_file(tok, corpus, tmp_path):
    """What changed since a state was saved (a file grown, added, removed, re-ordered, a
    weight), in the loader's refusal and in ``resume_differences`` (the preflight's check,
    which builds no loader); the unchanged corpus resumes (negative control)."""
    from tape_train.data.loader import resume_differences

    data, cfg, state, expected = _state_after_two_batches(tok, corpus, tmp_path)

    def differences(config=cfg) -> str:
        return ", ".join(resume_differences(state, config, tok, SEQ, 1))

    assert differences() == ""
    resumed = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(take(resumed, 2), expected))

    part1 = data["root"] / "a" / "part1.jsonl"
    original = part1.read_bytes()
    part1.write_bytes(original + b'{"text": "one more"}\n')
    line = (f"sources (data.sources[0] ({data['root'] / 'a'}): part1.jsonl changed "
            f"({len(original)} -> {len(original) + 21} bytes))")
    assert differences() == line
    with pytest.raises(DataError, match=re.escape(f"data fingerprint differs in {line}. Pass")):
        build_train_loader(cfg, tok, SEQ, 2, seed=1).load_state_dict(state)
    part1.write_bytes(original)
    write_jsonl(data["root"] / "a" / "part3.jsonl", ["a document added later"])
    assert differences().endswith(": part3.jsonl added)")
    (data["root"] / "a" / "part3.jsonl").unlink()
    (data["root"] / "a" / "part0.jsonl").rename(data["root"] / "part0.jsonl")
    assert differences().endswith(": part0.jsonl removed)")
    (data["root"] / "part0.jsonl").rename(data["root"] / "a" / "part0.jsonl")
    assert differences() == ""
    weights = make_cfg(data, prefetch=0, sources=[
        {"path": str(data["root"] / "a"), "weight": 1.0},
        {"path": str(data["root"] / "b"), "weight": 1.0}])
    assert differences(weights) == (f"sources (data.sources[0] ({data['root'] / 'a'}): "
                                    f"weight: saved 2.0, now 1.0)")
    reordered = make_cfg(data, prefetch=0, sources=[
        {"path": [str(data["root"] / "a" / f"part{i}.jsonl") for i in (0, 2, 1)],
         "weight": 2.0, "name": str(data["root"] / "a")},
        {"path": str(data["root"] / "b"), "weight": 1.0}])
    assert differences(reordered).endswith(": the same files in another order)")
    shuffled = make_cfg(data, prefetch=0, shuffle_buffer=8)
    assert differences(shuffled) == "packing (data.shuffle_buffer: saved 7, now 8)"


def test_a_file_edited_in_place_at_the_same_size_is_named(tok, corpus, tmp_path, monkeypatch):
    """Same name, same size, other bytes: refused in one line naming the file, by the loader
    and by ``resume_differences`` (the preflight's check); a state saved before content
    samples (negative control: the same state without them) resumes as before, on names and
    sizes only; an unchanged copy with new modification times resumes with the same stream."""
    import os
    import shutil

    from tape_train.data import state as state_module
    from tape_train.data.loader import resume_differences

    data, cfg, state, expected = _state_after_two_batches(tok, corpus, tmp_path)
    old = json.loads(json.dumps(state))
    for source in old["fingerprint_inputs"]["sources"]:
        for key in ("content", "content_digest", "content_rule"):
            source.pop(key, None)

    # An unchanged copy (the files rewritten, so their mtimes are new) resumes exactly.
    copy = tmp_path / "scratch"
    shutil.copytree(data["root"], copy, copy_function=shutil.copyfile)
    for f in copy.rglob("*.jsonl"):
        os.utime(f, (1, 1))
    moved = make_cfg({**data, "root": copy}, prefetch=0, sources=[
        {"path": str(copy / "a"), "weight": 2.0, "name": str(data["root"] / "a")},
        {"path": str(copy / "b"), "weight": 1.0, "name": str(data["root"] / "b")}])
    assert resume_differences(state, moved, tok, SEQ, 1) == []
    resumed = build_train_loader(moved, tok, SEQ, 2, seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(take(resumed, 2), expected))

    part1 = data["root"] / "a" / "part1.jsonl"
    original = part1.read_bytes()
    edited = original.replace(b"[A001]", b"[A999]", 1)
    assert edited != original and len(edited) == len(original)
    part1.write_bytes(edited)
    line = (f"sources (data.sources[0] ({data['root'] / 'a'}): part1.jsonl changed (same "
            f"{len(original)} bytes, other content))")
    assert resume_differences(state, cfg, tok, SEQ, 1) == [line]
    with pytest.raises(DataError, match=re.escape(f"data fingerprint differs in {line}. Pass")):
        build_train_loader(cfg, tok, SEQ, 2, seed=1).load_state_dict(state)
    # Negative control: without the content samples (a state saved before them) the edit is
    # not seen, and the state resumes its stream as before.
    assert resume_differences(old, cfg, tok, SEQ, 1) == []
    other_rule = json.loads(json.dumps(state))  # samples taken by another rule: not compared
    other_rule["fingerprint_inputs"]["sources"][0]["content_rule"] = "another rule"
    assert resume_differences(other_rule, cfg, tok, SEQ, 1) == []
    part1.write_bytes(original)
    resumed = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    resumed.load_state_dict(old)
    assert all(torch.equal(x, y) for x, y in zip(take(resumed, 2), expected))

    # Alongside another change (the seed) the edit is still named; more than LISTED_FILES
    # files: the source is named without its files.
    part1.write_bytes(edited)
    assert resume_differences(state, cfg, tok, SEQ, 2) == [line, "seed (saved 1, now 2)"]
    monkeypatch.setattr(state_module, "LISTED_FILES", 2)
    part1.write_bytes(original)
    many = build_train_loader(cfg, tok, SEQ, 2, seed=1).state_dict()
    part1.write_bytes(edited)
    assert resume_differences(many, cfg, tok, SEQ, 1) == [
        f"sources (data.sources[0] ({data['root'] / 'a'}): the content of some of its 3 files "
        f"changed at the same sizes (more than 2: not named in the checkpoint))"]


def test_content_sample_reads_head_tail_and_spaced_chunks(tmp_path, monkeypatch):
    """A file of up to 1 MiB is read whole: an edit anywhere changes its sample. A larger one
    is sampled (1 MiB read): an edit in the head, the tail or a sampled chunk changes the
    sample, one between two chunks does not (the documented bound); a file that cannot be
    read has no sample (it is then compared on name and size only). A source of many files
    reads less of each, within a budget per source."""
    import builtins

    from tape_train.data import formats

    assert formats.content_plan(1) == (1 << 20, f"xxh3/{1 << 20}/16")
    assert formats.content_plan(64)[0] == 1 << 20
    assert formats.content_plan(65)[0] == 1 << 19
    assert formats.content_plan(1024)[0] == 64 << 10
    assert formats.content_plan(10 ** 6)[0] == 8 << 10            # the floor per file
    for n in (1, 64, 65, 1000, 8192):
        assert formats.content_plan(n)[0] * n <= max(formats.CONTENT_BUDGET, n * (8 << 10))
    span = 1 << 20
    chunk = span // formats.CONTENT_SAMPLES
    size = 4 * span
    path = tmp_path / "big.jsonl"
    original = bytes(range(256)) * (size // 256)
    path.write_bytes(original)
    reads = []
    real_open = builtins.open

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def seek(self, offset):
            return self.fh.seek(offset)

        def read(self, n):
            data = self.fh.read(n)
            reads.append(len(data))
            return data

    monkeypatch.setattr(builtins, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    base = formats.content_sample(path, size)
    monkeypatch.setattr(builtins, "open", real_open)
    assert sum(reads) == span and len(reads) == formats.CONTENT_SAMPLES

    def edited_at(offset: int) -> str:
        data = bytearray(original)
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        return formats.content_sample(path, size)

    step = (size - chunk) // (formats.CONTENT_SAMPLES - 1)
    assert edited_at(0) != base
    assert edited_at(size - 1) != base
    assert edited_at(3 * step + 5) != base
    assert edited_at(chunk + 10) == base  # between two samples
    small_plan = formats.content_plan(1024)[0]
    assert formats.content_sample(path, size, small_plan) != base      # another rule
    whole = span
    path.write_bytes(original[:whole])
    base = formats.content_sample(path, whole)
    data = bytearray(original[:whole])
    data[whole // 2 + 7] ^= 0xFF  # the middle of a file read whole
    path.write_bytes(bytes(data))
    assert formats.content_sample(path, whole) != base
    small = tmp_path / "small.txt"
    small.write_bytes(b"abc")
    shard = formats.Shard("text", str(small), size=3)
    assert shard.content_sample() == formats.content_sample(small, 3)
    small.unlink()
    assert shard.content_sample() is None
    assert formats.Shard("hub", "hub:x/default/train#0", hub_index=0).content_sample() is None


def test_a_state_saved_before_it_named_its_files_gets_the_digests(tok, corpus, tmp_path,
                                                                   monkeypatch):
    """States saved before ``fingerprint_inputs`` (and sources of more than
    ``LISTED_FILES`` files) keep resuming; a change is told less precisely."""
    from tape_train.data import state as state_module
    from tape_train.data.loader import resume_differences

    data = _changed_corpus(tmp_path, corpus)
    cfg = make_cfg(data, prefetch=0)
    loader = build_train_loader(cfg, tok, SEQ, 2, seed=1)
    take(loader, 1)
    old = loader.state_dict()
    del old["fingerprint_inputs"]
    build_train_loader(cfg, tok, SEQ, 2, seed=1).load_state_dict(old)  # resumes as before
    monkeypatch.setattr(state_module, "LISTED_FILES", 2)
    many = build_train_loader(cfg, tok, SEQ, 2, seed=1).state_dict()
    assert "files" not in many["fingerprint_inputs"]["sources"][0]  # 3 files: only counted
    assert "files" in many["fingerprint_inputs"]["sources"][1]
    reweighted = make_cfg(data, prefetch=0, sources=[
        {"path": str(data["root"] / "a"), "weight": 1.0},
        {"path": str(data["root"] / "b"), "weight": 1.0}])
    assert resume_differences(many, reweighted, tok, SEQ, 1) == [
        f"sources (data.sources[0] ({data['root'] / 'a'}): weight: saved 2.0, now 1.0)"]
    write_jsonl(data["root"] / "a" / "part3.jsonl", ["a document added later"])
    (generic,) = resume_differences(old, cfg, tok, SEQ, 1)
    assert generic.startswith(f"sources (saved {old['fingerprint_fields']['sources']!r}, now '")
    (counted,) = resume_differences(many, cfg, tok, SEQ, 1)
    assert counted == (f"sources (data.sources[0] ({data['root'] / 'a'}): 3 file(s) then, 4 now "
                       f"(more than 2: not named in the checkpoint))")


def test_sources_unknown_offline_are_left_out_of_the_comparison(tok, corpus, tmp_path):
    """A Hub source's files are listed only online: the preflight passes ``None`` for it, and
    the other sources are compared one by one."""
    from tape_train.data.formats import resolve_local_shards
    from tape_train.data.loader import resume_differences

    data = _changed_corpus(tmp_path, corpus)
    cfg = make_cfg(data, prefetch=0)
    state = build_train_loader(cfg, tok, SEQ, 2, seed=1).state_dict()
    local = lambda: [None, resolve_local_shards(cfg.sources[1])]  # noqa: E731 - A "on the Hub"
    assert resume_differences(state, cfg, tok, SEQ, 1, text_shards=local()) == []
    write_jsonl(data["root"] / "a" / "part3.jsonl", ["not seen: A is unknown here"])
    assert resume_differences(state, cfg, tok, SEQ, 1, text_shards=local()) == []
    write_jsonl(data["root"] / "b" / "more.jsonl", ["a document added later"])
    assert resume_differences(state, cfg, tok, SEQ, 1, text_shards=local()) == [
        f"sources (data.sources[1] ({data['root'] / 'b'}): more.jsonl added)"]
    assert resume_differences(state, cfg, tok, SEQ, 2, text_shards=local()) == [
        f"sources (data.sources[1] ({data['root'] / 'b'}): more.jsonl added)",
        "seed (saved 1, now 2)"]


def test_bad_loader_arguments(tok, corpus):
    with pytest.raises(DataError, match="dp_rank"):
        build_train_loader(make_cfg(corpus), tok, SEQ, 2, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="seq_len"):
        build_train_loader(make_cfg(corpus), tok, 0, 2)
    loader = build_train_loader(make_cfg(corpus), tok, SEQ, 2)
    with pytest.raises(DataError, match="version"):
        loader.load_state_dict({"position": {}})


def test_a_tiny_source_never_runs_dry_on_any_rank(tok, tmp_path):
    """Sources loop over epochs, so even a corpus of one document per rank feeds every rank
    forever (no rank can stop early and leave the others hanging in a collective); a rank whose
    share is empty says so, naming the rank and the fix."""
    write_jsonl(tmp_path / "three.jsonl", ["first short document", "second", "third one"])
    cfg = DataConfig(sources=[str(tmp_path / "three.jsonl")], prefetch=0)
    for rank in range(3):
        loader = build_train_loader(cfg, tok, SEQ, 2, rank, 3, seed=0)
        for _ in range(5):
            assert next(loader)["input_ids"].shape == (2, SEQ)
        assert loader.stats["documents_tokenized"] > 5  # many epochs of its one document
    starved = build_train_loader(cfg, tok, SEQ, 2, 3, 4, seed=0)
    with pytest.raises(DataError, match="rank 3 of 4.*more shards/records than ranks"):
        next(starved)


def test_override_with_an_incompatible_position_restarts_the_stream(tok, corpus, caplog):
    two = build_train_loader(make_cfg(corpus, prefetch=0), tok, SEQ, 2, seed=1)
    take(two, 4)
    state = two.state_dict()
    one_cfg = make_cfg(corpus, prefetch=0, sources=[str(corpus["root"] / "a")])
    with pytest.raises(DataError, match="sources"):
        build_train_loader(one_cfg, tok, SEQ, 2, seed=1).load_state_dict(state)
    resumed = build_train_loader(one_cfg, tok, SEQ, 2, seed=1)
    with caplog.at_level("WARNING", logger="tape_train.data"):
        resumed.load_state_dict(state, allow_mismatch=True)
    assert "starting the stream from the beginning" in caplog.text
    fresh = build_train_loader(one_cfg, tok, SEQ, 2, seed=1)
    assert torch.equal(take(resumed, 1)[0], take(fresh, 1)[0])


@pytest.mark.parametrize("huge, plain", [((1e308, 1e308), (1.0, 1.0)),
                                         ((1.5e308, 7.5e307), (2.0, 1.0))])
def test_the_text_mixture_draws_by_the_ratio_of_weights_whose_sum_overflows(corpus, huge,
                                                                            plain):
    """Weights are relative: 1e308 and 1e308 draw as 1 and 1. Their float sum overflowed to
    inf, every share became 0 and the first source was never drawn. The same ratio in
    ordinary numbers (the control) draws the identical sources document for document."""
    from tape_train.data.config import SourceConfig
    from tape_train.data.formats import SkipLog
    from tape_train.data.sources import DocumentStream, SourceCursor

    def choices(weights) -> list[int]:
        cursors = [SourceCursor(SourceConfig(path=str(corpus["root"] / name), weight=w),
                                index=i, seed=1, shuffle=True, window_size=4,
                                eval_fraction=0.0, skip_bad=False, skips=SkipLog())
                   for i, (name, w) in enumerate(zip("ab", weights))]
        stream = DocumentStream(cursors, seed=1)
        return [stream.choice(g) for g in range(6000)]

    drawn = choices(huge)
    assert drawn == choices(plain)
    share = drawn.count(0) / len(drawn)
    assert abs(share - plain[0] / sum(plain)) < 0.03
