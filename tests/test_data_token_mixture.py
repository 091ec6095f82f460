"""Weighted mixtures of pre-tokenised sources (`data.format: tokens`): exact shares, every
block of a source once per source epoch, O(1) location of any sample, exact resume on another
number of ranks, and one source (or a `path` list) keeping the concatenated stream."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from tape_train.data import DataConfig, DataError, build_train_loader
from tape_train.data import cli as data_cli
from tape_train.data.testing import real_text_documents, write_jsonl
from tape_train.data.token_mixture import MIXTURE_BLOCK, SampleMixture, integer_weights
from tape_train.data.tokens import feistel_permutation
from token_utils import rows

ROOT = Path(__file__).resolve().parents[1]
SEQ = 40
L = SEQ + 1
SIZES = {"a": 60, "b": 40, "c": 20}  # documents per source: three sources of different sizes


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tok):
    """Three tokenised prepared directories built from disjoint real-text documents."""
    root = tmp_path_factory.mktemp("mixture")
    texts = real_text_documents(sum(SIZES.values()))
    out, start = {}, 0
    for name, n in SIZES.items():
        write_jsonl(root / "in" / name / "x.jsonl",
                    [f"[{name}{i:03d}] {t[:300]}" for i, t in enumerate(texts[start:start + n])])
        start += n
        out[name] = root / name
        assert data_cli.main(["prepare", "--input", str(root / "in" / name), "--out",
                              str(out[name]), "--num-shards", "2", "--eval-fraction", "0",
                              "--tokenize", "--tokenizer", tok.path]) == 0
    return out


def streams(loader) -> list[np.ndarray]:
    """Each source's concatenated token stream, read independently of the loader."""
    return [np.concatenate([np.memmap(p, dtype="<u2", mode="r") for p in source.paths])
            for source in loader.sources]


def block_index(loader) -> dict[tuple, tuple[int, int]]:
    """Every block's tokens -> (source, block); all blocks of all sources are distinct."""
    out = {}
    for s, stream in enumerate(streams(loader)):
        for k in range(loader.sources[s].num_blocks):
            out[tuple(stream[k * L:(k + 1) * L].tolist())] = (s, k)
    assert len(out) == sum(source.num_blocks for source in loader.sources)
    return out


def mixture_cfg(dirs, tok, weights=(5, 3, 2), **kw) -> DataConfig:
    return DataConfig(sources=[{"path": str(dirs[name]), "weight": w}
                               for name, w in zip(SIZES, weights)],
                      tokenizer=tok.path, format="tokens", **kw)


def hamilton(n: int, weights: list[int]) -> list[int]:
    """Largest-remainder apportionment of n by weights, by Fractions (the reference)."""
    total = sum(weights)
    exact = [Fraction(n * w, total) for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda s: (-(exact[s] - counts[s]), s))
    for s in order[:n - sum(counts)]:
        counts[s] += 1
    return counts


def brute_force(weights: list[int], block: int, seed: int, n_blocks: int) -> list[tuple]:
    """(source, index) of samples 0 … n_blocks·block − 1, built block by block with running
    per-source counters: each block lists its sources in order by quota, permutes the list by
    the keyed Feistel permutation of the block's slots, and numbers each source's samples in
    list order."""
    counters = [0] * len(weights)
    out = []
    for k in range(n_blocks):
        quotas = np.subtract(hamilton((k + 1) * block, weights), hamilton(k * block, weights))
        assert (quotas >= 0).all()
        listed = []
        for s, q in enumerate(quotas):
            for _ in range(q):
                listed.append((s, counters[s]))
                counters[s] += 1
        position = feistel_permutation(np.arange(block), block, [seed, 0x4D58, k])
        out.extend(listed[p] for p in position)
    return out


# Odd blocks leave remainders, ties among them ([1, 1], [1, 1, 1]) and several extra samples
# per block ([2, 7, 1, 1], [1, 1, 1]); [1, 5] in blocks of 6 has none.
@pytest.mark.parametrize("weights, block", [([5, 3, 2], 16), ([1, 1], 7), ([2, 7, 1, 1], 13),
                                            ([1, 1, 1], 16), ([1, 5], 6)])
def test_mixture_matches_a_brute_force_and_its_shares_are_exact(weights, block):
    mixture = SampleMixture(weights, seed=9, block=block)
    n_blocks = 60
    sources, indices = mixture.locate(np.arange(n_blocks * block))
    assert list(zip(sources.tolist(), indices.tolist())) == brute_force(weights, block, 9,
                                                                         n_blocks)
    total = sum(weights)
    for k in range(n_blocks + 1):  # after every block: within 1 of the exact share
        counts = np.bincount(sources[:k * block], minlength=len(weights))
        assert counts.tolist() == list(mixture.before(k)) == mixture.counts(k * block)
        for s, w in enumerate(weights):
            assert abs(counts[s] - Fraction(k * block * w, total)) < 1
    # counts() inside a block, and a slice of indices located alone, agree with the whole.
    assert mixture.counts(5 * block + 3) == np.bincount(
        sources[:5 * block + 3], minlength=len(weights)).tolist()
    part = mixture.locate(np.arange(7 * block - 2, 9 * block + 1))
    assert np.array_equal(part[0], sources[7 * block - 2:9 * block + 1])
    assert np.array_equal(part[1], indices[7 * block - 2:9 * block + 1])


def test_mixture_locates_sample_10_to_the_12_in_constant_time():
    weights = [5, 3, 2]
    mixture = SampleMixture(weights, seed=1)
    k = 10**12 // MIXTURE_BLOCK
    # Not timed (a busy machine is slow): a walk over the 10^12 samples before would not end.
    sources, indices = mixture.locate(np.arange(k * MIXTURE_BLOCK, (k + 1) * MIXTURE_BLOCK))
    before, after = hamilton(k * MIXTURE_BLOCK, weights), hamilton((k + 1) * MIXTURE_BLOCK,
                                                                    weights)
    for s in range(3):  # the block holds exactly source s's samples before[s] … after[s] − 1
        assert sorted(indices[sources == s].tolist()) == list(range(before[s], after[s]))
    one = mixture.locate([10**12])
    assert (one[0][0], one[1][0]) == (sources[10**12 % MIXTURE_BLOCK],
                                      indices[10**12 % MIXTURE_BLOCK])
    # Unshuffled: each block lists its sources in order.
    plain = SampleMixture(weights, seed=1, shuffle=False, block=10)
    assert plain.locate(np.arange(10))[0].tolist() == [0] * 5 + [1] * 3 + [2] * 2


def test_integer_weights_are_exact_decimal_ratios():
    assert integer_weights([5, 3, 2]) == [5, 3, 2]
    assert integer_weights([0.1, 0.3]) == [1, 3]
    assert integer_weights([10.0, 6.0, 4.0]) == [5, 3, 2]
    assert integer_weights([0.5, 0.25]) == [2, 1]


def test_loader_shares_follow_the_weights(dirs, tok):
    loader = build_train_loader(mixture_cfg(dirs, tok), tok, SEQ, 8, seed=3)
    n = 3 * MIXTURE_BLOCK
    sources, _ = loader.locate(np.arange(n))
    counts = np.bincount(sources, minlength=3)
    assert counts.tolist() == hamilton(n, [5, 3, 2]) == [6144, 3686, 2458]
    # Negative control: another weight, other shares.
    other = build_train_loader(mixture_cfg(dirs, tok, weights=(5, 3, 3)), tok, SEQ, 8, seed=3)
    assert np.bincount(other.locate(np.arange(n))[0]).tolist() == hamilton(n, [5, 3, 3])
    # The rows the loader delivers are the blocks locate() names, from the right source.
    index = block_index(loader)
    got = [index[tuple(r.tolist())] for r in rows(loader, 20)]
    s, k = loader.locate(np.arange(160))
    assert got == list(zip(s.tolist(), k.tolist()))


def test_every_block_of_a_source_once_per_source_epoch(dirs, tok):
    """Over one mixture block (each small source passes many epochs), the rows of source s
    whose per-source index lies in epoch e are exactly all of s's blocks, each once."""
    loader = build_train_loader(mixture_cfg(dirs, tok), tok, SEQ, 16, seed=4)
    index = block_index(loader)
    seen = [index[tuple(r.tolist())] for r in rows(loader, MIXTURE_BLOCK // 16)]
    sources, indices = loader.mixture.locate(np.arange(MIXTURE_BLOCK))
    assert [s for s, _ in seen] == sources.tolist()
    sizes = [source.num_blocks for source in loader.sources]
    assert len(set(sizes)) == 3  # sources of different sizes, hence different epoch rates
    orders = {}
    for s, n in enumerate(sizes):
        mine = indices[sources == s]
        blocks = np.array([k for (t, k) in seen if t == s])
        full = mine.max() // n  # complete epochs of source s in this mixture block
        assert full >= 2
        for e in range(full):
            epoch = blocks[(mine // n) == e]
            assert sorted(epoch.tolist()) == list(range(n)), (s, e)  # all blocks, once each
            orders[s, e] = blocks[np.argsort(mine[(mine // n) == e])].tolist()
        assert orders[s, 0] != orders[s, 1]  # a fresh permutation every source epoch
    assert loader.epochs == [c // n for c, n in zip(loader.mixture.counts(MIXTURE_BLOCK), sizes)]
    # Epochs advance at each source's own rate: the source passed fastest (weight per block)
    # is ahead of the slowest. Which one that is depends on the tokenizer's block counts.
    rates = [w / n for w, n in zip((5, 3, 2), sizes)]
    fast, slow = int(np.argmax(rates)), int(np.argmin(rates))
    assert rates[fast] > 1.2 * rates[slow]
    assert loader.epochs[fast] > loader.epochs[slow]


def test_each_source_has_its_own_block_order(dirs, tok):
    """The same directory twice, 1:1: two sources with equal blocks still get independent
    permutations (keyed by the source), so the mixture is not the same blocks twice."""
    cfg = DataConfig(sources=[str(dirs["b"]), str(dirs["b"])], tokenizer=tok.path,
                     format="tokens")
    loader = build_train_loader(cfg, tok, SEQ, 2, seed=2)
    sources, blocks = loader.locate(np.arange(MIXTURE_BLOCK))
    _, indices = loader.mixture.locate(np.arange(MIXTURE_BLOCK))
    n = loader.sources[0].num_blocks
    first = [blocks[(sources == s) & (indices < n)][np.argsort(
        indices[(sources == s) & (indices < n)])].tolist() for s in (0, 1)]
    assert sorted(first[0]) == sorted(first[1]) == list(range(n)) and first[0] != first[1]


def test_exact_resume_and_dp_change_continue_the_global_mixture(dirs, tok):
    cfg, b = mixture_cfg(dirs, tok), 2
    single = build_train_loader(cfg, tok, SEQ, 1, 0, 1, seed=5)
    flat = rows(single, 48)
    # A late stretch crossing the first mixture-block boundary, read by an independent loader.
    late = build_train_loader(cfg, tok, SEQ, 1, 0, 1, seed=5)
    late.load_state_dict({**late.state_dict(), "position": {"samples": MIXTURE_BLOCK - 12}})
    flat_late = {MIXTURE_BLOCK - 12 + i: r for i, r in enumerate(rows(late, 28))}
    flat = {**dict(enumerate(flat)), **flat_late}

    for start in (0, 4, 20, MIXTURE_BLOCK - 12):
        two = [build_train_loader(cfg, tok, SEQ, b, r, 2, seed=5) for r in range(2)]
        for loader in two:
            loader.load_state_dict({**loader.state_dict(), "position": {"samples": start}})
        got = [rows(loader, 2) for loader in two]
        for t in range(2):
            for r in range(2):
                for j in range(b):
                    assert torch.equal(got[r][t * b + j], flat[start + t * 2 * b + r * b + j])
        state = json.loads(json.dumps(two[0].state_dict()))
        assert state == {**two[1].state_dict(), "dp_rank": 0}
        consumed = start + 2 * 2 * b
        for n in (1, 4):  # saved on 2 ranks, continued on 1 and on 4
            for r in range(n):
                loader = build_train_loader(cfg, tok, SEQ, b, r, n, seed=5)
                loader.load_state_dict(state)
                after = rows(loader, 1)
                for j in range(b):
                    assert torch.equal(after[j], flat[consumed + r * b + j]), (start, n, r, j)
    # Negative controls: another seed or other weights give another sequence.
    for other_cfg, seed in ((cfg, 6), (mixture_cfg(dirs, tok, weights=(2, 3, 5)), 5)):
        other = build_train_loader(other_cfg, tok, SEQ, 1, 0, 1, seed=seed)
        assert not all(torch.equal(x, flat[i]) for i, x in enumerate(rows(other, 16)))


def test_far_resume_reads_only_the_delivered_blocks(dirs, tok):
    loader = build_train_loader(mixture_cfg(dirs, tok), tok, SEQ, 2, 1, 4, seed=1)
    loader.load_state_dict({**loader.state_dict(), "position": {"samples": 10**12}})
    batch = next(loader)  # the reads are counted, not timed: a busy machine is slow
    assert batch["input_ids"].shape == (2, SEQ)
    assert loader.stats["tokens_read"] == 2 * L
    assert loader.state_dict()["position"]["samples"] == 10**12 + 8
    index = block_index(loader)
    s, k = loader.locate([10**12 + 2, 10**12 + 3])
    assert [index[tuple(torch.cat([batch["input_ids"][i], batch["labels"][i, -1:]]).tolist())]
            for i in range(2)] == list(zip(s.tolist(), k.tolist()))


def test_a_path_list_is_one_source_with_the_concatenated_stream(dirs, tok):
    """One source keeps the stream the loader always had: its directories concatenated, sample
    i = block perm_e(i mod N) keyed by (seed, tag, e); its weight does not matter; a state of
    that stream refuses to resume a mixture, saying how to continue it."""
    cfg = DataConfig(sources=[{"path": [str(dirs["a"]), str(dirs["c"])], "weight": 3}],
                     tokenizer=tok.path, format="tokens")
    loader = build_train_loader(cfg, tok, SEQ, 4, seed=7)
    assert loader.mixture is None and len(loader.sources) == 1
    stream = streams(loader)[0]
    n = loader.sources[0].num_blocks
    assert n == len(stream) // L and len(loader.sources[0].paths) == 4
    expected = [feistel_permutation([i % n], n, [7, 0x544B, i // n])[0] for i in range(n + 8)]
    got = rows(loader, -(-(n + 8) // 4))[:n + 8]
    assert [r.tolist() for r in got] == [stream[k * L:(k + 1) * L].tolist() for k in expected]
    assert loader.epochs == [(n + 8 + 3) // 4 * 4 // n]
    unweighted = build_train_loader(DataConfig(
        sources=[{"path": [str(dirs["a"]), str(dirs["c"])]}], tokenizer=tok.path,
        format="tokens"), tok, SEQ, 4, seed=7)
    assert unweighted.fingerprint == loader.fingerprint
    assert "mixture" not in loader.state_dict()["fingerprint_fields"]
    mixed = build_train_loader(DataConfig(sources=[str(dirs["a"]), str(dirs["c"])],
                                          tokenizer=tok.path, format="tokens"), tok, SEQ, 4, seed=7)
    assert mixed.mixture is not None and mixed.mixture.weights == [1, 1]
    with pytest.raises(DataError, match=r"concatenated all sources into one stream; to continue "
                                        r"that stream, list their directories in order as one "
                                        r"source"):
        mixed.load_state_dict(loader.state_dict())


def test_mixture_config_errors_name_the_key(dirs, tok, tmp_path):
    with pytest.raises(DataError, match=r"^data.sources\[2\].weight: 0.001 gives a share of "
                                        r"0.0001 of the samples, below the 1/4096"):
        build_train_loader(mixture_cfg(dirs, tok, weights=(5, 5, 0.001)), tok, SEQ, 2)
    build_train_loader(mixture_cfg(dirs, tok, weights=(2000, 2000, 1)), tok, SEQ, 2)  # 1/4001
    with pytest.raises(DataError, match=r"^data.sources\[1\]: data.format=tokens needs prepared"):
        build_train_loader(DataConfig(sources=[str(dirs["a"]), {"hub": "parquet"}],
                                      format="tokens"), tok, SEQ, 2)
    with pytest.raises(DataError, match=r"^data.sources\[2\]: the token corpus has \d+ tokens, "
                                        r"fewer than one block"):
        build_train_loader(mixture_cfg(dirs, tok), tok, 5000, 2)
    with pytest.raises(DataError, match=r"^data.sources\[0\].path\[1\]: .*not a complete"):
        build_train_loader(DataConfig(sources=[{"path": [str(dirs["a"]), str(tmp_path)]}],
                                      format="tokens"), tok, SEQ, 2)
    loader = build_train_loader(mixture_cfg(dirs, tok), tok, SEQ, 2, seed=1)
    with pytest.raises(DataError, match=r"differs in mixture \(saved \{'weights': '5:3:2', "
                                        r"'block': 4096, 'shards': \[2, 2, 2\]\}, now "
                                        r"\{'weights': '2:3:5'"):
        build_train_loader(mixture_cfg(dirs, tok, weights=(2, 3, 5)), tok, SEQ, 2,
                           seed=1).load_state_dict(loader.state_dict())
    # The same ratio written differently is the same stream.
    same = build_train_loader(mixture_cfg(dirs, tok, weights=(0.5, 0.3, 0.2)), tok, SEQ, 2, seed=1)
    same.load_state_dict(loader.state_dict())


def test_preflight_reports_each_source_and_refuses_a_bad_mixture(dirs, tok, tmp_path):
    from tape_train.config import load_run_config
    from tape_train.train.preflight import run_preflight

    cfg = load_run_config(None, ["model=tiny", "model.vocab_size=800", "train.seq_len=40",
                                 "train.micro_batch_size=2", f"train.run_dir={tmp_path / 'r'}"])
    cfg.data = mixture_cfg(dirs, tok)
    report = run_preflight(cfg, world_size=1, check_eval=False, check_resume=False, plan=False)
    assert report.problems == []
    lines = [ln for ln in report.lines if "of the samples" in ln]
    assert [ln.split(":")[0] for ln in lines] == [f"data.sources[{i}]" for i in range(3)]
    assert "50.0% of the samples" in lines[0] and "20.0% of the samples" in lines[2]
    cfg.data = mixture_cfg(dirs, tok, weights=(5, 5, 0.001))
    report = run_preflight(cfg, world_size=1, check_eval=False, check_resume=False, plan=False)
    assert len(report.problems) == 1 and report.problems[0].startswith("data.sources[2].weight")


def test_mixture_benchmark_runs(dirs, tok, tmp_path):
    """benchmarks/token_mixture.py end to end on the tiny directories (a few seconds)."""
    out = tmp_path / "mix.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "token_mixture.py"),
                           "--tokenizer", tok.path, "--single", str(dirs["a"]), "--mix",
                           f"{dirs['a']}:5", f"{dirs['b']}:3", str(dirs["c"]), "--seq-len",
                           str(SEQ), "--batch", "2", "--seconds", "0.3", "--repeats", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["weights"] == [5.0, 3.0, 1.0] and result["samples_delivered"] > 100
    assert result["tokens_per_cpu_s"]["single"] > 0 and result["tokens_per_cpu_s"]["mixture"] > 0
    assert result["shares"] == pytest.approx(result["target_shares"], abs=0.05)
