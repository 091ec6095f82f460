"""Block shuffle windows of the text loader (``data.block_shuffle_window``): the rows of a
batch are not consecutive blocks of the packed stream; window 1 is packing order; a resume at
any batch (mid-window, prefetch, ``global`` sharding across a dp change) continues the same
stream; a state saved before block windows resumes in packing order; a changed window is a
stream change."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from tape_train.data import DataConfig, DataError, build_train_loader
from tape_train.data.loader import resume_differences
from tape_train.data.packing import pack_documents
from tape_train.data.testing import real_text_documents, write_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two shards of tagged real-text documents of ~2 KB: each spans several blocks."""
    root = tmp_path_factory.mktemp("blocks")
    docs = [f"[D{i:03d}] {text}" for i, text in enumerate(real_text_documents(80))]
    for s in range(2):
        write_jsonl(root / f"part{s}.jsonl", docs[s::2])
    return root


def make_cfg(corpus, **kw) -> DataConfig:
    return DataConfig(**{"sources": [str(corpus)], "tokenizer": "unused-here.model",
                         "shuffle_buffer": 16, "prefetch": 0, **kw})


def rows(loader, batches: int) -> list[list[tuple[int, ...]]]:
    """``batches`` batches as lists of rows, each row its whole ``SEQ + 1``-token block."""
    out = []
    for _ in range(batches):
        batch = next(loader)
        full = [ids + [labels[-1]] for ids, labels in zip(batch["input_ids"].tolist(),
                                                          batch["labels"].tolist())]
        out.append([tuple(row) for row in full])
    return out


def packed(cfg, tok, n: int, seed: int = 7, **kw) -> list[tuple[int, ...]]:
    """The first ``n`` blocks of the packed stream, in packing order: the blocks the loader
    emitted, one after the other, before block windows existed."""
    loader = build_train_loader(cfg, tok, SEQ, 1, seed=seed, **kw)
    return [tuple(b) for b, _ in itertools.islice(
        pack_documents(loader._documents(), SEQ + 1), n)]


def successors(batches, blocks) -> float:
    """The fraction of neighbouring rows of a batch that are consecutive packed blocks."""
    follows = set(zip(blocks, blocks[1:]))
    pairs = [pair for batch in batches for pair in zip(batch, batch[1:])]
    return sum(pair in follows for pair in pairs) / len(pairs)


def test_the_default_window_decorrelates_the_rows_of_a_batch(tok, corpus):
    """With the default window, the rows of a micro-batch are rarely neighbouring windows of
    one document (they were all of them in packing order: the negative control, window 1,
    emits exactly the packed stream); each window emits its own blocks, each once."""
    cfg = make_cfg(corpus)
    window = cfg.block_shuffle_window
    assert window > 1
    blocks = packed(cfg, tok, 2 * window)
    shuffled = rows(build_train_loader(cfg, tok, SEQ, 8, seed=7), 2 * window // 8)
    assert successors(shuffled, blocks) < 0.1
    flat = [row for batch in shuffled for row in batch]
    for w in range(2):
        assert Counter(flat[w * window:(w + 1) * window]) == Counter(
            blocks[w * window:(w + 1) * window])
    assert flat[:window] != blocks[:window]

    in_order = make_cfg(corpus, block_shuffle_window=1)
    ordered = rows(build_train_loader(in_order, tok, SEQ, 8, seed=7), 2 * window // 8)
    assert [row for batch in ordered for row in batch] == blocks
    assert successors(ordered, blocks) == 1.0
    assert ordered[0][0][0] == tok.bos_id  # the stream starts at a document start
    # shuffle: false turns block windows off too.
    unshuffled = make_cfg(corpus, shuffle=False)
    assert rows(build_train_loader(unshuffled, tok, SEQ, 8, seed=7), 4) == rows(
        build_train_loader(make_cfg(corpus, shuffle=False, block_shuffle_window=1), tok, SEQ,
                           8, seed=7), 4)


def test_ranks_of_documents_sharding_permute_their_own_windows(tok, corpus):
    """``documents`` sharding: each rank's windows are permuted by a seed of its own (as its
    document windows are), over its own packed stream."""
    cfg = make_cfg(corpus, block_shuffle_window=16)
    for rank in range(2):
        blocks = packed(cfg, tok, 32, dp_rank=rank, dp_size=2)
        got = rows(build_train_loader(cfg, tok, SEQ, 4, rank, 2, seed=7), 8)
        flat = [row for batch in got for row in batch]
        assert Counter(flat[:16]) == Counter(blocks[:16]) and flat[:16] != blocks[:16]
        assert successors(got, blocks) < 0.5


@pytest.mark.parametrize("prefetch, sharding, dp", [(3, "documents", (0, 1)),
                                                     (0, "documents", (1, 2)),
                                                     (2, "global", (1, 2))])
def test_exact_resume_mid_window(tok, corpus, prefetch, sharding, dp):
    """A state taken after any batch (at, before and after a window boundary) resumes the
    same rows, re-reading only its window; windows of 12 blocks, batches of 2 rows per rank."""
    cfg = make_cfg(corpus, prefetch=prefetch, sharding=sharding, block_shuffle_window=12)
    kw = dict(seq_len=SEQ, micro_batch_size=2, dp_rank=dp[0], dp_size=dp[1], seed=3)
    reference = rows(build_train_loader(cfg, tok, **kw), 24)
    for cut in (1, 3, 5, 6, 7, 11, 13, 20):
        first = build_train_loader(cfg, tok, **kw)
        assert rows(first, cut) == reference[:cut]
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        position = state["position"]
        assert position["window_start"] % 12 == 0
        assert 0 <= position["blocks"] - position["window_start"] < 12
        resumed = build_train_loader(cfg, tok, **kw)
        resumed.load_state_dict(state)
        assert rows(resumed, 4) == reference[cut:cut + 4], cut
        resumed.close()


def test_global_windows_continue_across_a_dp_change(tok, corpus):
    """``global`` sharding: every rank permutes the global block index the same way, so a run
    stopped on 1 rank (mid-window) continues the same global stream on 2."""
    cfg = make_cfg(corpus, sharding="global", block_shuffle_window=10, prefetch=2)
    flat = [row for batch in rows(build_train_loader(cfg, tok, SEQ, 2, 0, 1, seed=4), 30)
            for row in batch]
    assert successors([flat], packed(cfg, tok, 60, seed=4)) < 0.5
    for cut in (3, 5, 7):  # 6, 10 and 14 blocks consumed
        one = build_train_loader(cfg, tok, SEQ, 2, 0, 1, seed=4)
        rows(one, cut)
        state = json.loads(json.dumps(one.state_dict()))
        one.close()
        for r in range(2):
            loader = build_train_loader(cfg, tok, SEQ, 1, r, 2, seed=4)
            loader.load_state_dict(state)
            got = [row for batch in rows(loader, 6) for row in batch]
            assert got == flat[2 * cut + r:2 * cut + 12:2], (cut, r)
            loader.close()


def _old_state(cfg, tok, batches: int) -> tuple[dict, list]:
    """A state as saved before block windows: window 1's state less its window start (the
    format and fingerprint of that code, which emitted the packed stream in order), and the
    rows that followed it."""
    loader = build_train_loader(make_cfg(cfg, block_shuffle_window=1), tok, SEQ, 2, seed=5)
    rows(loader, batches)
    state = json.loads(json.dumps(loader.state_dict()))
    state["position"].pop("window_start")
    return state, rows(loader, 6)


def test_a_state_saved_before_block_windows_resumes_in_packing_order(tok, corpus, caplog):
    """Not refused: it resumes its own stream exactly (window 1), says so in one line, and
    keeps doing so on the next resume; the preflight's check finds no difference."""
    state, expected = _old_state(corpus, tok, 5)
    cfg = make_cfg(corpus)  # the default window
    assert resume_differences(state, cfg, tok, SEQ, 5) == []
    loader = build_train_loader(cfg, tok, SEQ, 2, seed=5)
    with caplog.at_level("WARNING", logger="tape_train.data"):
        loader.load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if "block shuffle windows" in r.getMessage()]
    assert len(lines) == 1 and "packing order" in lines[0]
    assert rows(loader, 3) == expected[:3]
    again_state = json.loads(json.dumps(loader.state_dict()))
    assert "window_start" not in again_state["position"]
    again = build_train_loader(cfg, tok, SEQ, 2, seed=5)
    again.load_state_dict(again_state)
    assert rows(again, 3) == expected[3:6]


def test_a_changed_window_is_a_stream_change(tok, corpus, caplog):
    """A state saved with one window, resumed with another: named by the loader and the
    preflight's check like a changed shuffle_buffer, refused unless allowed; allowed, the run
    continues from the saved window's start with the new window."""
    cfg = make_cfg(corpus, block_shuffle_window=8)
    loader = build_train_loader(cfg, tok, SEQ, 2, seed=5)
    rows(loader, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    line = "packing (data.block_shuffle_window: saved 8, now 1)"
    in_order = make_cfg(corpus, block_shuffle_window=1)
    assert resume_differences(state, in_order, tok, SEQ, 5) == [line]
    assert resume_differences(state, make_cfg(corpus, block_shuffle_window=16), tok, SEQ,
                              5) == ["packing (data.block_shuffle_window: saved 8, now 16)"]
    assert resume_differences(state, cfg, tok, SEQ, 5) == []
    with pytest.raises(DataError, match=r"data fingerprint differs in packing \(data\."
                                        r"block_shuffle_window: saved 8, now 1\)"):
        build_train_loader(in_order, tok, SEQ, 2, seed=5).load_state_dict(state)
    changed = build_train_loader(in_order, tok, SEQ, 2, seed=5)
    with caplog.at_level("WARNING", logger="tape_train.data"):
        changed.load_state_dict(state, allow_mismatch=True)
    assert "resuming despite mismatch" in caplog.text
    blocks = packed(cfg, tok, 12, seed=5)
    # Window 1 from the saved window's start (block 0), skipping the 6 blocks emitted.
    assert [row for batch in rows(changed, 3) for row in batch] == blocks[6:12]


@pytest.mark.parametrize("value", [0, -4, True, 2.5, "8"])
def test_a_bad_window_names_the_key(value):
    with pytest.raises(DataError, match=r"run.yaml: data.block_shuffle_window must be a "
                                        r"positive integer .*got " + repr(value)[:3]):
        DataConfig.from_dict({"block_shuffle_window": value}, source="run.yaml")


def test_the_wait_for_a_window_is_logged_at_the_start_and_a_resume(tok, corpus, caplog):
    """The first batch waits for one whole window to be tokenised (seconds at long seq_len):
    a line before and one after say what it is, at the start and at a resume; window 1 has
    no such wait and logs nothing."""
    kw = dict(seq_len=SEQ, micro_batch_size=2, dp_rank=0, dp_size=1, seed=3)
    caplog.set_level("INFO", logger="tape_train.data")
    loader = build_train_loader(make_cfg(corpus, block_shuffle_window=8), tok, **kw)
    rows(loader, 3)
    lines = [r.getMessage() for r in caplog.records if "block window" in r.getMessage()]
    note = f"the first block window: data.block_shuffle_window=8 blocks of {SEQ + 1} tokens"
    assert lines[0] == f"data: tokenising {note}, 0.0 M tokens before the first batch"
    assert lines[1].startswith(f"data: tokenised {note}, 0.0 M tokens in ") and len(lines) == 2
    state = loader.state_dict()
    caplog.clear()
    resumed = build_train_loader(make_cfg(corpus, block_shuffle_window=8), tok, **kw)
    resumed.load_state_dict(state)
    rows(resumed, 1)
    lines = [r.getMessage() for r in caplog.records if "block window" in r.getMessage()]
    assert [line.split(":")[1] for line in lines] == [
        " tokenising block window 0.. again (resuming at block 6)",
        " tokenised block window 0.. again (resuming at block 6)"]
    caplog.clear()
    rows(build_train_loader(make_cfg(corpus, block_shuffle_window=1), tok, **kw), 2)
    assert not [r for r in caplog.records if "block window" in r.getMessage()]
