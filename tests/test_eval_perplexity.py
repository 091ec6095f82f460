"""Perplexity protocols (spec §7) against a direct per-token computation on the real model.

The direct computation defines each protocol independently of the implementation: token k of a
document (k ≥ 1) is predicted from ``t[context_start(k):k]``, with the context start given in
closed form below, by one forward call per token. A recording stand-in model (loss = the label
id) then checks windowing facts exactly: every prediction scored once, context bounds, the cap,
and the data-parallel split.
"""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tape_train.eval.perplexity import evaluate_perplexity, window_spans
from tape_train.model import TransformerLM, load_model_config

DOC_LENGTHS = (1, 2, 5, 8, 9, 13, 23)   # tokens incl. BOS/EOS; 1 predicts nothing


def tiny_model(pe: str = "tape", seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(load_model_config("tiny", num_layers=1, hidden_size=32, num_heads=2,
                                            intermediate_size=64, vocab_size=50, pe=pe,
                                            tape_position_size=8, attn_backend="eager"))
    # Live TAPE weights (W_up, W_pa start at zero) so the positional state depends on content.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.double()


def documents(seed: int = 0, lengths=DOC_LENGTHS, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (n,), generator=gen).tolist(), 3 * n + 1) for n in lengths]


def context_start(k: int, num_predictions: int, length: int, protocol: str, stride: int) -> int:
    """First context token of prediction k (1-based), straight from the protocol definition."""
    if protocol == "nonoverlap":
        return (k - 1) // length * length
    if k <= length:                                   # the document's first window
        return 0
    windows_after_first = math.ceil((k - length) / stride)
    end = min(length + windows_after_first * stride, num_predictions)
    return end - length


def direct_nll(model, docs, length, protocol, stride, max_tokens=None):
    nll, count = 0.0, 0
    with torch.no_grad():
        for tokens, _ in docs:
            for k in range(1, len(tokens)):
                if max_tokens is not None and count == max_tokens:
                    return nll, count
                a = context_start(k, len(tokens) - 1, length, protocol, stride)
                assert 0 <= a < k and k - a <= length
                logits = model(torch.tensor([tokens[a:k]])).logits[0, -1]
                nll -= torch.log_softmax(logits.double(), -1)[tokens[k]].item()
                count += 1
    return nll, count


@pytest.mark.parametrize("protocol,stride,batch_size,length", [
    ("nonoverlap", None, 3, 4), ("sliding", None, 1, 8), ("sliding", 3, 4, 4)])
def test_matches_direct_per_token_computation(protocol, stride, batch_size, length):
    model, docs = tiny_model(), documents()
    # A second length in the same call checks results come back per length, in order.
    results = evaluate_perplexity(model, docs, lengths=[length, 2], protocol=protocol,
                                  stride=stride if stride is None else 1,
                                  batch_size=batch_size)
    results = evaluate_perplexity(model, docs, lengths=[length], protocol=protocol,
                                  stride=stride, batch_size=batch_size) + results[1:]
    s = stride if stride is not None else length // 2
    expected, count = direct_nll(model, docs, length, protocol, s)
    r = results[0]
    assert r["length"] == length and r["protocol"] == protocol and results[1]["length"] == 2
    assert r["tokens"] == count == sum(n - 1 for n in DOC_LENGTHS)
    assert r["nll_sum"] == pytest.approx(expected, rel=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(expected / count), rel=1e-6)
    # Negative control: context matters here, so a different context length gives another NLL.
    assert abs(results[1]["nll_sum"] - expected) > 1e-4 * abs(expected)


def test_token_weighted_not_mean_of_document_perplexities():
    model, docs = tiny_model(seed=3), documents(seed=3)
    with torch.no_grad():   # peaked predictions: per-document perplexities spread widely
        model.lm_head.weight.mul_(40)
    whole = evaluate_perplexity(model, docs, lengths=[4])[0]
    per_doc = [evaluate_perplexity(model, [d], lengths=[4], allow_unmeasured=True)[0]
               for d in docs if len(d[0]) > 1]
    weighted = math.exp(sum(r["nll_sum"] for r in per_doc) / sum(r["tokens"] for r in per_doc))
    mean_of_ppl = sum(math.exp(r["nll_sum"] / r["tokens"]) for r in per_doc) / len(per_doc)
    assert whole["perplexity"] == pytest.approx(weighted, rel=1e-6)
    assert abs(mean_of_ppl - weighted) / weighted > 0.05   # the two really differ here


class RecordingModel(torch.nn.Module):
    """Model contract stand-in: the 'NLL' of a label is its id; records what it scored.

    ``scored`` holds (label id, context length) per scored label; with documents made of
    globally unique ids this identifies every prediction exactly.
    """

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.scored: list[tuple[int, int]] = []
        self.calls = 0
        self.grad_enabled: set[bool] = set()

    def forward(self, input_ids, labels=None):
        self.calls += 1
        self.grad_enabled.add(torch.is_grad_enabled())
        mask = labels != -100
        for row, col in mask.nonzero().tolist():
            self.scored.append((int(labels[row, col]), col + 1))
        loss_sum = (labels * mask).sum().double()
        return SimpleNamespace(loss_sum=loss_sum, num_tokens=mask.sum(), logits=None)


def unique_documents(lengths=DOC_LENGTHS):
    docs, offset = [], 0
    for n in lengths:
        docs.append((list(range(offset, offset + n)), 2 * n))
        offset += n
    return docs


def expected_predictions(docs, limit=None):
    ids = [t for tokens, _ in docs for t in tokens[1:]]
    return ids if limit is None else ids[:limit]


@pytest.mark.parametrize("protocol,stride,length", [
    (protocol, stride, length) for length in (1, 4, 6, 30)
    for protocol, stride in (("nonoverlap", None), ("sliding", None), ("sliding", 1),
                             ("sliding", 5))
    if stride is None or stride < length])
def test_every_prediction_scored_exactly_once_with_bounded_context(protocol, stride, length):
    docs = unique_documents()
    model = RecordingModel()
    # Coverage is checked at a length longer than every document too (L=30): allowed here.
    r = evaluate_perplexity(model, docs, lengths=[length], protocol=protocol, stride=stride,
                            batch_size=3, allow_unmeasured=True)[0]
    assert r["measured"] == (max(DOC_LENGTHS) - 1 >= length)
    scored_ids = [i for i, _ in model.scored]
    assert Counter(scored_ids) == Counter(expected_predictions(docs))
    assert r["tokens"] == len(scored_ids) == sum(n - 1 for n in DOC_LENGTHS)
    assert r["nll_sum"] == sum(scored_ids)
    assert r["bytes"] == pytest.approx(sum(b for t, b in docs if len(t) > 1))
    position = {t: k for tokens, _ in docs for k, t in enumerate(tokens)}
    s = stride if stride is not None else max(1, length // 2)
    for token, context in model.scored:
        k = position[token]   # tokens before it in its document
        assert 1 <= context <= min(k, length)
        if protocol == "sliding":   # spec §7: at least L − S tokens (+1: the token in front)
            assert context >= min(k, length - s + 1)
    assert model.grad_enabled == {False}
    assert model.training   # mode restored after evaluation


def test_exactly_once_check_catches_double_scoring():
    """Negative control: scoring every label of every sliding window double-counts."""
    docs = unique_documents()
    naive = Counter()
    for tokens, _ in docs:
        for span in window_spans(len(tokens) - 1, 4, "sliding", 2):
            naive.update(tokens[span.start + 1:span.end + 1])
    assert naive != Counter(expected_predictions(docs))


@pytest.mark.parametrize("protocol", ["nonoverlap", "sliding"])
def test_max_tokens_scores_the_same_prefix_with_unchanged_context(protocol):
    docs = unique_documents()
    cap = 17       # cuts the 9-token document (predictions 1+4+7 = 12 < 17 < 20 = 12+8)
    full_model, capped_model = RecordingModel(), RecordingModel()
    evaluate_perplexity(full_model, docs, lengths=[6], protocol=protocol)
    r = evaluate_perplexity(capped_model, docs, lengths=[6], protocol=protocol,
                            max_tokens=cap, batch_size=2)[0]
    first = expected_predictions(docs, cap)
    assert sorted(i for i, _ in capped_model.scored) == sorted(first)
    assert r["tokens"] == cap and r["max_tokens"] == cap
    context_full = dict(full_model.scored)
    assert all(context_full[i] == c for i, c in capped_model.scored)
    # Bytes (2 per token here): the 2-, 5- and 8-token documents fully, the 9-token one
    # prorated by 5 of its 8 predictions.
    assert r["bytes"] == pytest.approx(2 * (2 + 5 + 8) + 2 * 9 * 5 / 8)
    assert r["documents"] == 4   # the 1-token document predicts nothing; the 13 and 23 unread
    assert r["bits_per_byte"] == pytest.approx(r["nll_sum"] / (math.log(2) * r["bytes"]))


def test_every_result_says_whether_max_tokens_cut_the_held_out_set():
    """``capped``: the held-out stream had more predictions than were scored. Known also when
    the cap falls exactly on a document boundary (a document is left unread) and when the
    documents are materialized again (evaluate_schedule, the trainer's cached list). Controls:
    a cap at or above the whole set's predictions does not cut it."""
    from tape_train.eval.config import EvalConfig
    from tape_train.eval.perplexity import HeldOutDocuments, evaluate_schedule, \
        materialize_documents

    docs = unique_documents()                 # 1 + 4 + 7 + 8 + 12 + 22 = 54 predictions
    total = sum(n - 1 for n in DOC_LENGTHS)

    def capped(max_tokens, source=None):
        return [r["capped"] for r in evaluate_perplexity(
            RecordingModel(), docs if source is None else source, lengths=[4, 6],
            protocol="sliding", max_tokens=max_tokens, allow_unmeasured=True)]

    assert capped(17) == [True, True]         # inside a document
    assert capped(12) == [True, True]         # on a document boundary: the rest unread
    assert capped(total) == capped(total + 1) == capped(None) == [False, False]
    # Materialized once with the cap (tape-eval, the trainer), then evaluated: still known.
    kept = materialize_documents(docs, 12)
    assert kept.capped and sum(t.numel() - 1 for t, *_ in kept) == 12
    assert capped(12, kept) == [True, True]
    plain = HeldOutDocuments((t.tolist(), n, e) for t, n, e in kept)   # the trainer's copy
    plain.capped = kept.capped
    results = evaluate_schedule(RecordingModel(), plain, EvalConfig(
        lengths=[4], protocols=["nonoverlap"], max_tokens=12), train_seq_len=4)
    assert [r["capped"] for r in results] == [True]
    assert not materialize_documents(docs, total).capped


def test_bits_per_byte_and_cap_on_the_real_model():
    model, docs = tiny_model(seed=5), documents(seed=5)
    r = evaluate_perplexity(model, docs, lengths=[4], protocol="sliding", max_tokens=20)[0]
    expected, count = direct_nll(model, docs, 4, "sliding", 2, max_tokens=20)
    assert r["tokens"] == count == 20
    assert r["nll_sum"] == pytest.approx(expected, rel=1e-6)
    assert r["bytes"] == pytest.approx(sum(3 * n + 1 for n in (2, 5, 8, 9)))  # exactly 4 docs
    assert r["bits_per_byte"] == pytest.approx(r["nll_sum"] / (math.log(2) * r["bytes"]),
                                               rel=1e-12)
    assert r["loss"] == pytest.approx(expected / 20)


def _simulated_ranks(dp_size, evaluate):
    """``evaluate(rank, reduce)`` on ``dp_size`` threads whose ``reduce`` really sums over
    them (an all-reduce); returns (results by rank, the tensors each rank handed in)."""
    import threading

    barrier = threading.Barrier(dp_size)
    handed, results, errors = {}, {}, []

    def rank_body(rank):
        def reduce(t):
            handed[rank] = t.clone()
            barrier.wait(timeout=30)
            total = sum(handed[r] for r in range(dp_size))
            barrier.wait(timeout=30)     # all have summed before any rank's next call
            return total
        try:
            results[rank] = evaluate(rank, reduce)
        except Exception as err:   # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(dp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[r] for r in range(dp_size)], [handed[r] for r in range(dp_size)]


def test_data_parallel_split_sums_to_single_rank_with_equal_forward_counts():
    docs = unique_documents()
    single = evaluate_perplexity(RecordingModel(), docs, lengths=[4, 6], protocol="sliding",
                                 batch_size=2)
    dp_size, models = 3, [RecordingModel() for _ in range(3)]
    ranks, handed = _simulated_ranks(dp_size, lambda rank, reduce: evaluate_perplexity(
        models[rank], docs, lengths=[4, 6], protocol="sliding", batch_size=2, reduce=reduce,
        dp_rank=rank, dp_size=dp_size))
    assert len({m.calls for m in models}) == 1   # ZeRO-3 needs the same number of forwards
    assert [tuple(t.shape) for t in handed] == [(2, 3)] * dp_size
    for results in ranks:                         # every rank reports the whole
        for got, want in zip(results, single):
            assert got.keys() == want.keys() and got["tokens"] == want["tokens"]
            for key, value in want.items():                 # sums in another order
                assert got[key] == (pytest.approx(value, rel=1e-12)
                                    if isinstance(value, float) else value), key
    for i, whole in enumerate(single):
        for j, key in enumerate(("nll_sum", "tokens", "bytes")):
            assert sum(float(t[i, j]) for t in handed) == pytest.approx(whole[key])
            assert all(0 < float(t[i, j]) < whole[key] for t in handed)   # really split
    # Negative control: a reduce that sums nothing leaves each rank with its share, which
    # every rank finds short of the windows it knows (no rank reports a partial number).
    with pytest.raises(RuntimeError, match="num_tokens="):
        evaluate_perplexity(RecordingModel(), docs, lengths=[4, 6], protocol="sliding",
                            batch_size=2, reduce=lambda t: t, dp_rank=1, dp_size=dp_size)


def test_heartbeat_is_called_once_per_batch_of_every_length_and_protocol():
    """The trainer's watchdog sees an evaluation move batch by batch (evaluate_schedule's
    heartbeat), so a long evaluation is not taken for a stuck rank."""
    from tape_train.eval.config import EvalConfig
    from tape_train.eval.perplexity import evaluate_schedule

    docs = unique_documents()
    model, beats = RecordingModel(), []
    evaluate_schedule(model, docs, EvalConfig(lengths=[4, 6], protocols=["nonoverlap",
                                                                          "sliding"],
                                              batch_size=2),
                      train_seq_len=4, heartbeat=lambda: beats.append(model.calls))
    assert len(beats) == model.calls > 4        # one beat per forward of a batch
    assert beats == sorted(beats) and beats[-1] == model.calls


def test_a_long_evaluation_without_a_bar_logs_how_far_it_is(monkeypatch, caplog):
    """Without a progress bar (a log file, --no-progress) rank 0 logs one line per interval
    with the tokens scored of the total, the rate and the time left (a long length was
    silent for minutes); other ranks and runs with a bar log none."""
    import logging

    from tape_train.eval import perplexity

    clock = iter(float(i) for i in range(10_000))     # one "second" per call
    monkeypatch.setattr(perplexity, "_clock", lambda: next(clock))
    monkeypatch.setattr(perplexity, "PROGRESS_LOG_EVERY_S", 3.0)
    model, docs = tiny_model(), documents()
    total = sum(len(t) - 1 for t, _ in docs)

    def lines(**kwargs) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tape_train.eval"):
            evaluate_perplexity(model, docs, lengths=[4], protocol="nonoverlap",
                                batch_size=1, **kwargs)
        return [r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage()]

    got = lines()
    assert got and all(line.startswith("eval nonoverlap L=4: ") for line in got), got
    assert f" of {total} tokens (" in got[-1] and " left" in got[0], got
    assert lines(progress=True) == []                 # negative control: a bar draws it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):   # rank 1 of 2: silent
        perplexity._evaluate_length(model, [(torch.tensor(t), n, None) for t, n in docs
                                            if len(t) > 1], 4,
                                    "nonoverlap", None, None, 1, "cpu", False, 1, 2)
    assert not [r for r in caplog.records if "tokens/s" in r.getMessage()]


def test_bad_input_is_named():
    model = RecordingModel()
    with pytest.raises(ValueError, match="document 1: n_bytes"):
        evaluate_perplexity(model, [([1, 2], 3), ([1, 2], -1)], lengths=[4])
    with pytest.raises(ValueError, match="document 0: token_ids must be a flat list"):
        evaluate_perplexity(model, [([[1, 2]], 3)], lengths=[4])
    with pytest.raises(ValueError, match="sliding_stride=4 must be smaller"):
        evaluate_perplexity(model, [([1, 2], 3)], lengths=[8, 4], protocol="sliding", stride=4)
    with pytest.raises(ValueError, match="nothing to score"):
        evaluate_perplexity(model, [([1], 3)], lengths=[4])
    for ends in ([0, 2], [0, 2, 1], [0, 1, 4], [0, 1.5, 3], "abc"):   # 3 tokens, 3 bytes
        with pytest.raises(ValueError, match="document 1: byte_ends must be 3 non-decreasing"):
            evaluate_perplexity(model, [([1, 2], 3), ([1, 2, 3], 3, ends)], lengths=[4])
    with pytest.raises(ValueError, match="document 0: expected a .token_ids, n_bytes. pair"):
        evaluate_perplexity(model, [([1, 2], 3, [0, 1], "extra")], lengths=[4])

    class IgnoresMask(RecordingModel):
        def forward(self, input_ids, labels=None):
            return SimpleNamespace(loss_sum=torch.zeros(()),
                                   num_tokens=torch.tensor(labels.numel()))
    with pytest.raises(RuntimeError, match="num_tokens="):
        evaluate_perplexity(IgnoresMask(), [([1, 2, 3, 4], 3)], lengths=[2], protocol="sliding",
                            stride=1)


# ----------------------------------------------------------------------------------------------
# Lengths the held-out documents do not reach are never reported as measured
# ----------------------------------------------------------------------------------------------


def test_a_length_cut_by_max_tokens_says_so_not_that_no_document_reaches_it(caplog):
    """max_tokens below a length that a document reaches: the message said 'no held-out
    document reaches it (the longest one ... has 63 predictions)' for L=32."""
    from tape_train.eval.perplexity import UnmeasuredLengthError

    model, docs = RecordingModel(), documents(seed=5, lengths=(64,))  # 63 predictions
    with caplog.at_level("WARNING", logger="tape_train.eval"):
        at8, at32 = evaluate_perplexity(model, docs, lengths=[8, 32], max_tokens=24)
    assert at8["measured"] and not at32["measured"]
    assert ("eval L=32: n/a, the first max_tokens=24 predictions scored hold no full window "
            "of L=32 (a held-out document of 63 predictions reaches it") in caplog.text
    assert "no held-out document reaches it" not in caplog.text
    with pytest.raises(UnmeasuredLengthError, match=r"cannot evaluate L=32: the first "
                       r"max_tokens=24 .* Use a larger max_tokens"):
        evaluate_perplexity(model, docs, lengths=[32], max_tokens=24)
    # control: beyond the longest document the old reason stands
    with pytest.raises(UnmeasuredLengthError, match="L=128: no held-out document reaches it"):
        evaluate_perplexity(model, docs, lengths=[128], max_tokens=24)


def test_short_documents_cannot_report_a_long_length(caplog):
    from tape_train.eval.perplexity import UnmeasuredLengthError

    model, short = tiny_model(seed=5), documents(seed=5, lengths=(8, 9, 7, 8))  # ≤ 8 predictions
    # One length asked, none reached: an error naming it, never a number.
    with pytest.raises(UnmeasuredLengthError, match="L=128: no held-out document reaches it"):
        evaluate_perplexity(model, short, lengths=[128])
    # Several lengths: the unreached one is n/a (NaN, measured False) with a warning.
    with caplog.at_level("WARNING", logger="tape_train.eval"):
        at4, at128 = evaluate_perplexity(model, short, lengths=[4, 128])
    assert "eval L=128: n/a" in caplog.text
    assert not at128["measured"] and math.isnan(at128["perplexity"])
    assert at128["documents_at_length"] == at128["windows_at_length"] == 0
    # Negative control: L=4 is reached by every document (≥ 6 predictions each).
    assert at4["measured"] and math.isfinite(at4["perplexity"])
    assert at4["documents_at_length"] == 4
    assert at4["windows_at_length"] == sum((n - 1) // 4 for n in (8, 9, 7, 8))  # full windows
    assert at4["tokens_at_length"] == 4 * at4["windows_at_length"] and at4["few_tokens"]
    # Data-parallel ranks find the same: only rank 0 says so (one line, not one per GPU).
    whole = torch.tensor([[r["nll_sum"], r["tokens"], r["bytes"]] for r in (at4, at128)],
                         dtype=torch.float64)  # what the all-reduce would give every rank
    caplog.clear()
    with caplog.at_level("WARNING", logger="tape_train.eval"):
        for rank in range(3):
            evaluate_perplexity(model, short, lengths=[4, 128], dp_rank=rank, dp_size=3,
                                reduce=lambda t: whole.to(t.dtype))
    assert caplog.text.count("eval L=128: n/a") == 1


def test_length_reached_by_only_some_documents_counts_only_those():
    model = tiny_model(seed=6)
    docs = documents(seed=6, lengths=(40, 6, 6, 6))  # one document of 39 predictions
    [r] = evaluate_perplexity(model, docs, lengths=[16], protocol="nonoverlap")
    assert r["documents"] == 4 and r["documents_at_length"] == 1
    assert r["windows_at_length"] == 2 and r["tokens_at_length"] == 32
    assert r["tokens"] == 39 + 3 * 5 and r["measured"]
    [s] = evaluate_perplexity(model, docs, lengths=[16], protocol="sliding")
    assert s["documents_at_length"] == 1 and s["windows_at_length"] == 4  # ends 16, 24, 32, 39


def test_an_unreached_length_advises_a_larger_cap_only_when_the_cap_cut_the_data():
    """The error always said 'use ... a larger eval max_tokens' and '(within max_tokens if
    set)', also for a held-out set scored whole, where a larger cap changes nothing."""
    from tape_train.eval.perplexity import UnmeasuredLengthError

    model, docs = tiny_model(seed=5), documents(seed=5, lengths=(8, 9, 7, 30))
    with pytest.raises(UnmeasuredLengthError) as whole:
        evaluate_perplexity(model, docs, lengths=[64])          # every document read
    assert "(the longest one has 29 predictions)" in str(whole.value)
    assert "max_tokens" not in str(whole.value)
    with pytest.raises(UnmeasuredLengthError) as cut:           # the 30-token one is not read
        evaluate_perplexity(model, docs, lengths=[16], max_tokens=20)
    assert "(the longest one read within max_tokens has 8 predictions)" in str(cut.value)
    assert "a larger max_tokens (eval.max_tokens, tape-eval --max-tokens: it cut the " \
           "held-out set)" in str(cut.value)


def test_the_report_says_why_a_length_has_no_number():
    """The table's footnote and the plot's caption said 'no held-out document reaches this
    length' also where max_tokens ended the scoring before a full window (the log line was
    right): each unmeasured length now carries its reason."""
    from tape_train.eval.report import format_table, plot_caption

    model, docs = RecordingModel(), documents(seed=5, lengths=(64,))  # 63 predictions
    results = evaluate_perplexity(model, docs, lengths=[8, 32, 128], max_tokens=24,
                                  allow_unmeasured=True)
    assert [r["cut_by_max_tokens"] for r in results] == [False, True, False]
    runs = [{"label": "m", "train_seq_len": 8, "results": results}]
    table, caption = format_table(runs), plot_caption(runs)
    assert ("n/a: max_tokens ended the scoring before a full window of this length, which a "
            "held-out document reaches: a larger max_tokens measures it.") in table
    assert "n/a: no held-out document reaches this length" in table  # L=128: control
    assert ("no point at L = 128: no held-out document reaches it (n/a in the table); no point "
            "at L = 32: max_tokens ended the scoring before a full window") in caption
    measured_only = [{**runs[0], "results": results[:1]}]
    assert "n/a" not in format_table(measured_only)
    assert "no point" not in plot_caption(measured_only)
