"""Token-weighted perplexity at growing context lengths (spec §7).

Vocabulary used throughout (see docs/evaluation.md for the picture):

* A document is ``t[0..n-1]`` with BOS first and EOS last. It has ``P = n - 1`` *predictions*:
  token ``t[k]`` (k = 1..P) is predicted by the model output at input position ``k - 1``.
* A window of **length L** is what the model sees: ``L`` input tokens ``t[a:e]`` (positions
  0..L-1) with labels ``t[a+1:e+1]``, i.e. ``L`` predictions. A window of length L therefore
  predicts each of its tokens from 1..L tokens of context (counting the token right before
  it); in the spec's words, the L scored tokens of a non-overlapping window plus the one
  token in front of them form the window.
* ``nonoverlap``: windows start at a = 0, L, 2L, … and score all their labels, so every
  prediction of the document is scored exactly once; the last window (or a document with
  P < L) is shorter than L.
* ``sliding`` (stride S < L, the standard Hugging Face recipe made exact): the first window
  scores its first min(L, P) predictions; each following window ends S predictions later
  (or at the document end), is L long, and scores only the predictions the previous window
  did not, so every prediction is scored exactly once and each one after the first window
  sees at least L − S + 1 tokens.

A length is *measured* only by windows that really are L tokens long: a held-out set whose
documents are all shorter than L scores exactly the same predictions with the same context at
L as at any longer length, so its number would say nothing about L. Every result therefore
carries ``documents_at_length`` (documents with at least L predictions) and
``windows_at_length`` / ``tokens_at_length`` (full-length windows and the predictions they
score). A length without a single full-length window is not reported: an error when it is the
only length asked for, else ``measured: False`` with NaN values and a warning. A length whose
full-length windows score fewer than ``FEW_TOKENS`` predictions is flagged ``few_tokens``;
tables and plots mark it.

Perplexity is exp(total NLL / total scored tokens) over all documents: token-weighted, never a
mean of per-document perplexities. Bits per byte is total NLL / (ln 2 · bytes of the scored
text): a document that says where each token's text ends (``byte_ends``, from
``iter_eval_documents(..., byte_ends=True)``) counts the UTF-8 bytes of exactly the tokens
scored (a document the ``max_tokens`` cap cuts: its scored prefix; without BOS, nothing for the
first token); one that does not attributes its bytes evenly (``n_bytes / P`` per prediction),
exact only when it is scored whole.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from tape_train.eval.config import PROTOCOLS, EvalConfig, resolve_stride

log = logging.getLogger("tape_train.eval")
# Without a progress bar (a log file, --no-progress), rank 0 logs how far one length's
# evaluation is at most this often: a long one is otherwise silent for minutes.
PROGRESS_LOG_EVERY_S = 60.0
_clock = time.monotonic  # tests replace it

IGNORE_INDEX = -100
# Short windows (document tails, short documents) are pooled, sorted by length and padded to
# the longest of their batch; pooling this many batches' worth keeps the padding small.
_SHORT_POOL_BATCHES = 8
# Below this many predictions scored by full-length windows a length's number is flagged.
FEW_TOKENS = 1000

Reduce = Callable[[torch.Tensor], torch.Tensor]


class UnmeasuredLengthError(ValueError):
    """No held-out window reaches a requested length: there is nothing to report for it."""


@dataclass(frozen=True)
class WindowSpan:
    """One forward window over a document, in token indices of that document.

    The model sees inputs ``t[start:end]`` and labels ``t[start+1:end+1]``; the scored
    predictions are the tokens ``t[k]`` for ``first_scored <= k <= end``.
    """

    start: int
    first_scored: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored + 1


def window_spans(num_predictions: int, length: int, protocol: str,
                 stride: int | None = None) -> Iterator[WindowSpan]:
    """Windows covering predictions 1..``num_predictions`` of one document, each exactly once.

    Args:
        num_predictions: P = (tokens in the document) − 1.
        length: L, input tokens per window.
        protocol: ``nonoverlap`` or ``sliding``.
        stride: S for ``sliding`` (``None`` → L // 2); ignored by ``nonoverlap``.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if length < 1:
        raise ValueError(f"window length must be >= 1, got {length}")
    if protocol == "nonoverlap":
        for start in range(0, num_predictions, length):
            yield WindowSpan(start, start + 1, min(start + length, num_predictions))
        return
    stride = resolve_stride(length, stride)
    scored_until = 0        # predictions 1..scored_until are done
    end = min(length, num_predictions)
    while scored_until < num_predictions:
        yield WindowSpan(max(0, end - length), scored_until + 1, end)
        scored_until = end
        end = min(end + stride, num_predictions)


@dataclass
class _Window:
    input_ids: torch.Tensor     # (n,) int64
    labels: torch.Tensor        # (n,) int64, IGNORE_INDEX where not scored
    num_scored: int
    num_bytes: float            # UTF-8 bytes attributed to the scored predictions


def _document_windows(tokens: torch.Tensor, n_bytes: int, byte_ends: list[int] | None,
                      length: int, protocol: str, stride: int | None,
                      budget: int | None) -> Iterator[_Window]:
    """Windows of one document; stops after ``budget`` scored predictions (None: no cap).

    Capping cuts the window at the last allowed prediction: the scored tokens keep exactly the
    context they would have had (the model is causal), so a capped evaluation scores a prefix
    of the uncapped one with identical per-token losses. A window's bytes are those of the text
    its predictions cover (``byte_ends``), else its share of ``n_bytes``.
    """
    num_predictions = tokens.numel() - 1
    bytes_per_prediction = n_bytes / num_predictions
    for span in window_spans(num_predictions, length, protocol, stride):
        end = span.end
        if budget is not None and span.num_scored > budget:
            end = span.first_scored + budget - 1
        labels = tokens[span.start + 1:end + 1].clone()
        labels[:span.first_scored - span.start - 1] = IGNORE_INDEX
        num_scored = end - span.first_scored + 1
        num_bytes = (byte_ends[end] - byte_ends[span.first_scored - 1] if byte_ends is not None
                     else num_scored * bytes_per_prediction)
        yield _Window(tokens[span.start:end], labels, num_scored, num_bytes)
        if budget is not None:
            budget -= num_scored
            if budget <= 0:
                return


def _batches(windows: Iterable[_Window], length: int,
             batch_size: int) -> Iterator[list[_Window]]:
    """Group windows into forward batches: full-length windows together, short ones pooled."""
    full: list[_Window] = []
    short: list[_Window] = []

    def drain_short() -> Iterator[list[_Window]]:
        short.sort(key=lambda w: w.input_ids.numel())
        for i in range(0, len(short), batch_size):
            yield short[i:i + batch_size]
        short.clear()

    for window in windows:
        if window.input_ids.numel() == length:
            full.append(window)
            if len(full) == batch_size:
                yield full
                full = []
        else:
            short.append(window)
            if len(short) >= _SHORT_POOL_BATCHES * batch_size:
                yield from drain_short()
    if full:
        yield full
    yield from drain_short()


def _collate(batch: list[_Window]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest window: (b, n) input ids (pad 0) and labels (pad ignored).

    Right padding is exact for a causal model: no real position attends to a pad.
    """
    width = max(w.input_ids.numel() for w in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for row, window in enumerate(batch):
        n = window.input_ids.numel()
        input_ids[row, :n] = window.input_ids
        labels[row, :n] = window.labels
    return input_ids, labels


class HeldOutDocuments(list):
    """The documents ``materialize_documents`` kept, and whether ``max_tokens`` cut the
    held-out stream (``capped``: it had more predictions than the cap; passed on when the
    list is materialized again, where the documents past the cap are no longer there)."""

    capped: bool = False


def materialize_documents(documents: Iterable, max_tokens: int | None = None
                          ) -> HeldOutDocuments:
    """Validate held-out documents and keep them as ``(int64 tensor, n_bytes, byte_ends)``.

    Reading stops once the documents hold ``max_tokens`` predictions, so a capped evaluation
    tokenises only what it scores. Documents with fewer than two tokens predict nothing and are
    dropped. The result's ``capped`` says whether the held-out stream had more predictions
    than ``max_tokens`` (a document left unread, or the last one kept reaching past the cap).

    Args:
        documents: iterable of ``(token_ids, n_bytes)`` or ``(token_ids, n_bytes,
            byte_ends)``; ``token_ids`` a list of ints or a 1-D integer tensor including
            BOS/EOS, ``n_bytes`` the UTF-8 size of the text, ``byte_ends`` (optional; ``None``
            is allowed) for each token the UTF-8 offset in the text where the text it covers
            ends (non-decreasing, 0..n_bytes; BOS covers nothing): a prediction then counts
            the bytes of its own token, exactly (without it, each prediction of a document
            counts ``n_bytes / predictions``).
    """
    kept = HeldOutDocuments()
    kept.capped = bool(getattr(documents, "capped", False))
    predictions = 0
    for index, item in enumerate(documents):
        if max_tokens is not None and predictions >= max_tokens:
            kept.capped = True   # a document is left unread
            break
        try:
            token_ids, n_bytes, *rest = item
            byte_ends, = rest or (None,)
        except (TypeError, ValueError):
            raise ValueError(f"held-out document {index}: expected a (token_ids, n_bytes) pair "
                             f"or a (token_ids, n_bytes, byte_ends) triple, got "
                             f"{type(item).__name__}") from None
        if not isinstance(n_bytes, int) or isinstance(n_bytes, bool) or n_bytes < 0:
            raise ValueError(f"held-out document {index}: n_bytes must be a non-negative "
                             f"integer, got {n_bytes!r}")
        try:
            tokens = torch.as_tensor(token_ids)
        except (TypeError, ValueError) as err:
            raise ValueError(f"held-out document {index}: token_ids are not a list of "
                             f"integers ({err})") from None
        if tokens.dim() != 1 or (tokens.numel() and (tokens.dtype.is_floating_point
                                                     or tokens.dtype == torch.bool)):
            raise ValueError(f"held-out document {index}: token_ids must be a flat list of "
                             f"integers, got shape {tuple(tokens.shape)} dtype {tokens.dtype}")
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError(f"held-out document {index}: negative token id "
                             f"{int(tokens.min())}")
        if byte_ends is not None:
            byte_ends = _checked_byte_ends(index, byte_ends, tokens.numel(), n_bytes)
        if tokens.numel() < 2:
            continue
        kept.append((tokens.long(), n_bytes, byte_ends))
        predictions += tokens.numel() - 1
    if max_tokens is not None and predictions > max_tokens:
        kept.capped = True
    return kept


def _checked_byte_ends(index: int, byte_ends, num_tokens: int, n_bytes: int) -> list[int]:
    ends = [int(e) for e in byte_ends] if all(
        isinstance(e, int) and not isinstance(e, bool) for e in byte_ends) else None
    if ends is None or len(ends) != num_tokens or any(
            not 0 <= a <= b <= n_bytes for a, b in zip([0, *ends], [*ends, n_bytes])):
        raise ValueError(f"held-out document {index}: byte_ends must be {num_tokens} "
                         f"non-decreasing integers in 0..n_bytes={n_bytes} (one per token), "
                         f"got {list(byte_ends)[:8]!r}{' …' if len(byte_ends) > 8 else ''}")
    return ends


def _model_device(model: torch.nn.Module) -> torch.device:
    """Where inputs go: a DeepSpeed engine's ``device``, else where the module lives."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    for tensor in model.parameters():       # only the .device attribute is read
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def evaluate_perplexity(model: torch.nn.Module, documents: Iterable, *, lengths: list[int],
                        protocol: str = "nonoverlap", stride: int | None = None,
                        max_tokens: int | None = None, batch_size: int = 1,
                        device: torch.device | str | None = None, progress: bool = False,
                        reduce: Reduce | None = None, dp_rank: int = 0,
                        dp_size: int = 1, allow_unmeasured: bool = False,
                        heartbeat: Callable[[], None] | None = None) -> list[dict]:
    """Token-weighted perplexity of ``model`` at each context length, for one protocol.

    Args:
        model: follows the model contract ``model(input_ids, labels=labels) -> out`` with
            ``out.loss_sum`` (sum of NLL in nats over labels != -100) and ``out.num_tokens``;
            a DeepSpeed engine works (only ``model(...)``, ``.eval()``/``.train()`` are used).
        documents: held-out ``(token_ids, n_bytes)`` pairs, e.g. from
            ``tape_train.data.iter_eval_documents``; read once and kept for all lengths.
        lengths: context lengths L (input tokens per window).
        protocol: ``nonoverlap`` or ``sliding``.
        stride: sliding stride S (< every L); ``None`` → L // 2 per length.
        max_tokens: score only the first ``max_tokens`` predictions of the stream (the same
            ones for every length and protocol); ``None`` scores everything.
        batch_size: windows per forward call.
        device: where the inputs go; ``None`` asks the model.
        progress: show a tqdm bar per length (callers decide with
            ``tape_train.progress.show_progress``: only on a terminal by default).
        reduce: under data parallelism, a function summing a float64 tensor across the
            data-parallel ranks (e.g. an all-reduce returning its input); called exactly once
            per call, on every rank, with shape (len(lengths), 3) = (nll_sum, tokens, bytes).
        dp_rank, dp_size: this rank's data-parallel coordinates. Every rank must pass the
            same documents: rank r runs batches r, r + dp_size, …, and ranks with fewer
            batches run a discarded extra forward so all ranks call the model equally often
            (ZeRO-3 gathers parameters collectively inside every forward).
        allow_unmeasured: never raise for unmeasured lengths (warn; NaN values; the raw
            ``nll_sum``/``tokens`` sums stay), e.g. to score documents one by one.
        heartbeat: called after every batch, a sign of progress (the trainer's watchdog,
            ``tape_train.train.watchdog``, then measures a stall, not the whole evaluation).

    Returns:
        One dict per length, in the order given, with keys ``length``, ``protocol``,
        ``stride`` (None for nonoverlap), ``perplexity``, ``loss`` (NLL per token, nats),
        ``nll_sum`` (nats), ``tokens`` (scored predictions), ``bytes`` (UTF-8 bytes of the
        scored text), ``bits_per_byte``, ``documents`` (documents touched), ``windows``
        (forward windows, all ranks), ``max_tokens``, ``documents_at_length``,
        ``windows_at_length``, ``tokens_at_length`` (what reached the full length L),
        ``capped`` (``max_tokens`` cut the held-out stream: it holds more predictions than
        were scored), ``measured`` (False: no window reached L; values are NaN) and
        ``few_tokens``.

    Raises ``UnmeasuredLengthError`` if no length of ``lengths`` is reached by any window (with
    one length asked, that length); unmeasured lengths among measured ones are NaN + warning.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if not lengths:
        raise ValueError("lengths is empty: give at least one context length")
    for length in lengths:
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"context length must be a positive integer, got {length!r}")
        if protocol == "sliding":
            resolve_stride(length, stride)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..dp_size-1 (dp_size={dp_size})")

    docs = materialize_documents(documents, max_tokens)
    if not docs:
        raise ValueError("no held-out document has two or more tokens: nothing to score")
    device = torch.device(device) if device is not None else _model_device(model)
    was_training = model.training
    model.eval()
    rows, sums = [], []
    try:
        with torch.no_grad():
            for length in lengths:
                length_sums, info = _evaluate_length(model, docs, length, protocol, stride,
                                                     max_tokens, batch_size, device, progress,
                                                     dp_rank, dp_size, heartbeat)
                sums.append(length_sums)
                rows.append(info)
    finally:
        model.train(was_training)

    # The one read of the device per call: the sums stayed where the model computed them.
    totals = torch.stack(sums)
    if reduce is not None:
        totals = reduce(totals)
    totals = totals.tolist()
    for info, (_, tokens, _) in zip(rows, totals):
        # Every rank knows every window, so every rank finds a miscount (no rank is left
        # waiting in a collective of a later call).
        if round(tokens) != info["scored"]:
            raise RuntimeError(
                f"the model reported num_tokens={round(tokens)} at L={info['length']} for "
                f"windows with {info['scored']} labels != {IGNORE_INDEX}: it must sum the NLL "
                f"over exactly those")
    check_measured(rows, docs, allow_unmeasured, warn=dp_rank == 0)  # the same on every rank
    results = []
    for info, (nll_sum, tokens, n_bytes) in zip(rows, totals):
        info = {k: v for k, v in info.items() if k != "scored"}
        result = dict(info, **summarize(nll_sum, round(tokens), n_bytes))
        if not info["measured"]:
            result.update(perplexity=math.nan, loss=math.nan, bits_per_byte=math.nan)
        results.append(result)
        log.info("eval L=%d protocol=%s stride=%s ppl=%.4f loss=%.5f tokens=%d%s bpb=%.5f "
                 "(%d documents, %d windows, %d tokens at full length)", result["length"],
                 protocol, result["stride"], result["perplexity"], result["loss"],
                 result["tokens"], " (the first of the held-out set: max_tokens)"
                 if result["capped"] else "", result["bits_per_byte"],
                 result["documents_at_length"], result["windows_at_length"],
                 result["tokens_at_length"])
    return results


def check_measured(rows: list[dict], docs: list, allow_unmeasured: bool = False,
                   warn: bool = True) -> None:
    """Refuse (one length asked, or none reached) or warn (if ``warn``) about lengths no
    window reached."""
    missing = [r["length"] for r in rows if not r["measured"]]
    if not missing:
        return
    longest = max(t.numel() - 1 for t, *_ in docs)
    cap = rows[0].get("max_tokens")
    cut = [r["length"] for r in rows if r.get("cut_by_max_tokens")]
    if len(missing) == len(rows) and not allow_unmeasured:
        if cut:
            raise UnmeasuredLengthError(
                f"cannot evaluate {', '.join(f'L={n}' for n in missing)}: "
                f"{_why_cut(cut, cap, longest)}. Use a larger max_tokens (eval.max_tokens, "
                f"tape-eval --max-tokens) or shorter lengths")
        raise _unmeasured(missing, docs)
    for length in missing if warn else ():
        why = _why_cut([length], cap, longest) if length in cut else _why_unmeasured(docs)
        log.warning("eval L=%d: n/a, %s", length, why)


def _why_cut(lengths: list[int], cap: int, longest: int) -> str:
    named = ", ".join(f"L={n}" for n in lengths)
    return (f"the first max_tokens={cap} predictions scored hold no full window of {named} "
            f"(a held-out document of {longest} predictions reaches it, but the cap ends the "
            f"scoring before)")


def check_reachable(lengths: list[int], docs: list) -> None:
    """Before any model is loaded: refuse, as ``check_measured`` would after the evaluation,
    when every document of ``docs`` is too short for every length (a length some document
    reaches may still go unmeasured within ``max_tokens``: that is found after)."""
    longest = max(t.numel() - 1 for t, *_ in docs)
    if all(length > longest for length in lengths):
        raise _unmeasured(lengths, docs)


def _why_unmeasured(docs: list) -> str:
    longest = max(t.numel() - 1 for t, *_ in docs)
    within = " read within max_tokens" if getattr(docs, "capped", False) else ""
    return (f"no held-out document reaches it (the longest one{within} has {longest} "
            f"predictions): its perplexity would repeat a shorter length's")


def _unmeasured(lengths: list[int], docs: list) -> UnmeasuredLengthError:
    named = ", ".join(f"L={n}" for n in lengths)
    # A larger cap helps only where the cap cut the held-out set.
    cap = (", a larger max_tokens (eval.max_tokens, tape-eval --max-tokens: it cut the "
           "held-out set)" if getattr(docs, "capped", False) else "")
    return UnmeasuredLengthError(f"cannot evaluate {named}: {_why_unmeasured(docs)}. Use longer "
                                 f"held-out documents{cap} or shorter lengths")


def summarize(nll_sum: float, tokens: int, n_bytes: float) -> dict:
    """Perplexity, loss and bits per byte from token-weighted sums (NLL in nats)."""
    if tokens <= 0:
        raise ValueError("no tokens were scored")
    loss = nll_sum / tokens
    return {
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "loss": loss,
        "nll_sum": nll_sum,
        "tokens": tokens,
        "bytes": n_bytes,
        "bits_per_byte": nll_sum / (math.log(2) * n_bytes) if n_bytes > 0 else math.nan,
    }


def _evaluate_length(model, docs, length, protocol, stride, max_tokens, batch_size, device,
                     progress, dp_rank, dp_size, heartbeat=None) -> tuple[torch.Tensor, dict]:
    """This rank's sums at one length, ``(nll, tokens the model counted, bytes)`` in float64
    on ``device`` (nothing is read back here: no host sync per batch), and global counts
    (``scored``: the labels of every rank's windows, for the caller's check)."""
    total = sum(t.numel() - 1 for t, *_ in docs)
    if max_tokens is not None:
        total = min(total, max_tokens)
    counts = {"documents": 0, "windows": 0, "documents_at_length": 0, "windows_at_length": 0,
              "tokens_at_length": 0}

    def windows() -> Iterator[_Window]:
        budget = max_tokens
        for tokens, n_bytes, byte_ends in docs:
            if budget is not None and budget <= 0:
                return
            counts["documents"] += 1
            reached = False
            for window in _document_windows(tokens, n_bytes, byte_ends, length, protocol,
                                            stride, budget):
                counts["windows"] += 1
                if window.input_ids.numel() == length:
                    reached = True
                    counts["windows_at_length"] += 1
                    counts["tokens_at_length"] += window.num_scored
                if budget is not None:
                    budget -= window.num_scored
                yield window
            counts["documents_at_length"] += reached

    bar = None
    stride_note = f" S={resolve_stride(length, stride)}" if protocol == "sliding" else ""
    if progress:
        from tape_train.progress import progress_bar

        bar = progress_bar(total, desc=f"eval {protocol} L={length}{stride_note}", unit="tok",
                           mode="on", leave=False)
    started = logged = _clock()
    # NLL and the model's token count accumulate on the device in float64; bytes and the
    # expected count are known here.
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    scored, scored_bytes = 0, 0.0
    own_batches = 0
    first_batch = None
    num_batches = 0
    for index, batch in enumerate(_batches(windows(), length, batch_size)):
        num_batches += 1
        if first_batch is None:
            first_batch = batch
        batch_scored = sum(w.num_scored for w in batch)
        scored += batch_scored
        if index % dp_size == dp_rank:
            own_batches += 1
            out = _forward(model, batch, device)
            sums += torch.stack([out.loss_sum.detach().to(torch.float64),
                                 torch.as_tensor(out.num_tokens, dtype=torch.float64,
                                                 device=sums.device)])
            scored_bytes += sum(w.num_bytes for w in batch)
        if bar is not None:
            bar.update(batch_scored)
        elif dp_rank == 0 and _clock() - logged >= PROGRESS_LOG_EVERY_S:
            logged = _clock()
            _log_progress(f"eval {protocol} L={length}{stride_note}", scored, total,
                          logged - started)
        if heartbeat is not None:
            heartbeat()
    # Keep the forward count identical on every rank (collectives inside ZeRO-3's forward).
    for _ in range(math.ceil(num_batches / dp_size) - own_batches):
        _forward(model, first_batch, device)
    if bar is not None:
        bar.close()
    measured = counts["windows_at_length"] > 0
    info = {"length": length, "protocol": protocol,
            "stride": resolve_stride(length, stride) if protocol == "sliding" else None,
            **counts, "max_tokens": max_tokens,
            "capped": bool(getattr(docs, "capped", False)),
            "measured": measured,
            # a held-out document reaches the length: the cap ended the scoring first
            "cut_by_max_tokens": not measured and max_tokens is not None and length <= max(
                t.numel() - 1 for t, *_ in docs),
            "few_tokens": counts["tokens_at_length"] < FEW_TOKENS, "scored": scored}
    host_bytes = torch.tensor([scored_bytes], dtype=torch.float64)
    return torch.cat([sums, host_bytes.to(device, non_blocking=True)]), info


def _log_progress(what: str, done: int, total: int, seconds: float) -> None:
    """``eval sliding L=1024 S=512: 12,288 of 32,768 tokens (38 %), 102 tokens/s, 3 min 21 s
    left`` (the tokens scored so far by all ranks)."""
    from tape_train.progress import _elapsed

    rate = done / seconds if seconds > 0 else 0.0
    left = f", {_elapsed((total - done) / rate)} left" if rate > 0 and total >= done else ""
    share = f" ({100 * done / total:.0f} %)" if total else ""
    log.info("%s: %s of %s tokens%s, %.0f tokens/s%s", what, f"{done:,}", f"{total:,}", share,
             rate, left)


def _forward(model, batch: list[_Window], device: torch.device):
    """The model's output for one batch (inputs copied without waiting for the device)."""
    input_ids, labels = _collate(batch)
    return model(input_ids.to(device, non_blocking=True),
                 labels=labels.to(device, non_blocking=True))


def evaluate_schedule(model: torch.nn.Module, documents: Iterable, config: EvalConfig, *,
                      train_seq_len: int, device: torch.device | str | None = None,
                      progress: bool = False, reduce: Reduce | None = None, dp_rank: int = 0,
                      dp_size: int = 1, heartbeat: Callable[[], None] | None = None
                      ) -> list[dict]:
    """Every (length, protocol) of an ``EvalConfig``: what the trainer runs each interval.

    Lengths come from ``config.resolve_lengths(train_seq_len)``; the documents are read once
    and shared by all protocols. Results are ordered by protocol, then length.
    """
    lengths = config.resolve_lengths(train_seq_len)
    docs = materialize_documents(documents, config.max_tokens)
    results = []
    for protocol in config.protocols:
        results += evaluate_perplexity(
            model, docs, lengths=lengths, protocol=protocol, stride=config.sliding_stride,
            max_tokens=config.max_tokens, batch_size=config.batch_size, device=device,
            progress=progress, reduce=reduce, dp_rank=dp_rank, dp_size=dp_size,
            heartbeat=heartbeat)
    return results


def scalar_metrics(results: list[dict], prefix: str = "eval") -> dict[str, float]:
    """Flat ``{tag: value}`` for TensorBoard/JSONL: one curve per length and protocol.

    Tags look like ``eval/ppl/sliding/L1024``, ``eval/bpb/nonoverlap/L512``,
    ``eval/tokens/...``.
    """
    metrics = {}
    for r in results:
        if not r.get("measured", True):
            continue  # nothing was measured at this length: no point on any curve
        suffix = f"{r['protocol']}/L{r['length']}"
        metrics[f"{prefix}/ppl/{suffix}"] = r["perplexity"]
        metrics[f"{prefix}/loss/{suffix}"] = r["loss"]
        metrics[f"{prefix}/bpb/{suffix}"] = r["bits_per_byte"]
        metrics[f"{prefix}/tokens/{suffix}"] = float(r["tokens"])
    return metrics
