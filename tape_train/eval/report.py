"""Evaluation reports: a Markdown table, a JSON file and a perplexity-vs-length plot.

A *run* here is one evaluated model: ``{"label": str, "train_seq_len": int | None,
"results": [result dicts from evaluate_perplexity]}`` (extra keys are kept in the JSON).
Every file is written with ``tape_train.files.write_atomic``, so a reader never mistakes a
half-written report for a complete one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

from tape_train.files import write_atomic

REPORT_FORMAT = "tape-eval/1"


FEW_MARK = "†"
CAPPED_MARK = "‡"


def _measured(r: dict) -> bool:
    return r.get("measured", True)


def table_cell(text: str) -> str:
    """A label as one Markdown table cell: a ``|`` would start a new column and a line break
    end the row, shifting every number after it under another header."""
    return " ".join(str(text).splitlines()).replace("|", "\\|")


def plot_text(text: str) -> str:
    """A label as matplotlib shows it literally: ``$`` pairs are not TeX math (``cost $5 vs
    $10`` lost its dollars and went italic), and a leading ``_`` does not hide the line from
    the legend (matplotlib's convention for unlabelled artists)."""
    text = str(text).replace("$", "\\$")
    return f" {text}" if text.startswith("_") else text


def format_table(runs: list[dict]) -> str:
    """Markdown table, one row per (model, protocol, length): ppl, loss, bpb, tokens scored,
    and what really reached the length L (documents, full-length windows, their tokens).

    A length no window reached reads ``n/a``; one resting on few full-length tokens
    (``few_tokens``) carries a † and a footnote; a token count cut by ``max_tokens``
    (``capped``) a ‡ and a footnote.
    """
    lines = ["| model | protocol | L | L/L_train | stride | perplexity | loss (nats) | "
             "bits/byte | tokens | docs ≥ L | windows = L | tokens at L |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    few = False
    unmeasured = set()  # why: "cut" (max_tokens ended the scoring first) or "short"
    caps = set()
    for run in runs:
        train_len = run.get("train_seq_len")
        for r in sorted(run["results"], key=lambda r: (r["protocol"], r["length"])):
            ratio = f"{r['length'] / train_len:g}×" if train_len else "–"
            stride = str(r["stride"]) if r.get("stride") is not None else "–"
            mark = ""
            if not _measured(r):
                unmeasured.add("cut" if r.get("cut_by_max_tokens") else "short")
            elif r.get("few_tokens"):
                few, mark = True, f" {FEW_MARK}"
            cut = ""
            if r.get("capped"):
                caps.add(r.get("max_tokens"))
                cut = f" {CAPPED_MARK}"
            lines.append(f"| {table_cell(run['label'])} | {r['protocol']} | {r['length']} | "
                         f"{ratio} | {stride} | {_num(r, 'perplexity', 3)}{mark} | {_num(r, 'loss', 4)} | "
                         f"{_num(r, 'bits_per_byte', 4)} | {r['tokens']}{cut} | "
                         f"{r.get('documents_at_length', '–')} | "
                         f"{r.get('windows_at_length', '–')} | "
                         f"{r.get('tokens_at_length', '–')} |")
    if few:
        lines.append(f"\n{FEW_MARK} rests on fewer than {_few_tokens()} tokens scored by "
                     f"full-length windows: a rough estimate.")
    if caps:
        cap = ", ".join(str(c) for c in sorted(caps, key=str))
        lines.append(f"\n{CAPPED_MARK} max_tokens={cap} cut the held-out set: only its first "
                     f"{cap} predictions (documents in their fixed order) were scored, the same "
                     f"ones at every length and protocol; the rest of it was not scored.")
    if "short" in unmeasured:
        lines.append("\nn/a: no held-out document reaches this length, so nothing was measured "
                     "at it.")
    if "cut" in unmeasured:
        lines.append("\nn/a: max_tokens ended the scoring before a full window of this length, "
                     "which a held-out document reaches: a larger max_tokens measures it.")
    return "\n".join(lines) + "\n"


def _few_tokens() -> int:
    from tape_train.eval.perplexity import FEW_TOKENS

    return FEW_TOKENS


def _num(r: dict, key: str, digits: int) -> str:
    value = r[key]
    if not _measured(r) or value is None:
        return "n/a"
    return f"{value:.{digits}f}" if math.isfinite(value) else str(value)


def _json_safe(value):
    """NaN/inf are not JSON: write them as null (a perplexity overflow, zero-byte text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike, runs: list[dict], settings: dict | None = None) -> Path:
    """``{"format", "settings", "models": runs}`` with non-finite numbers as null."""
    payload = {"format": REPORT_FORMAT, "settings": settings or {}, "models": runs}
    text = json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n"
    return write_atomic(path, text)


def describe_settings(settings: dict) -> str:
    """What the table measured, in words: definitions and the settings of the evaluation."""
    lines = ["## What was measured", "",
             "- Perplexity = exp(total NLL / tokens scored) over all scored predictions "
             "(token-weighted); bits/byte = total NLL / (ln 2 · UTF-8 bytes of the scored "
             "text). Every prediction of a document is scored exactly once: its first token "
             "(BOS) is never predicted, its last (EOS, where the data adds it) is "
             "(docs/evaluation.md).",
             "- `nonoverlap`: consecutive windows of L input tokens; a prediction sees 1..L "
             "tokens. `sliding` (stride S): windows of L tokens advancing by S, each scoring "
             "only its new predictions; after a document's first window a prediction sees at "
             "least L − S + 1 tokens. Context never crosses a document boundary."]
    if "data" in settings:
        lines.append(f"- Held-out data: {settings['data']}.")
    if "max_tokens" in settings:
        cap = settings["max_tokens"]
        lines.append("- max_tokens: all (the whole held-out set)" if cap is None else
                     f"- max_tokens: {cap} (the first {cap} predictions of the held-out set, "
                     f"at most; ‡ in the table where this cut it; bits/byte counts the bytes "
                     f"of the text scored)")
    if "sliding" in settings.get("protocols", ["sliding"]):
        stride = settings.get("sliding_stride")
        lines.append(f"- Sliding stride: {'L // 2 per length' if stride is None else stride}.")
    extra = [f"{name} {settings[key]}" for key, name in (
        ("dtype", "dtype"), ("device", "device"), ("world_size", "processes"),
        ("batch_size", "batch size")) if key in settings]
    if extra:
        lines.append(f"- Run with {', '.join(extra)}.")
    return "\n".join(lines) + "\n"


def write_markdown(path: str | os.PathLike, runs: list[dict], title: str = "Perplexity vs "
                   "context length", settings: dict | None = None) -> Path:
    text = f"# {title}\n\n{format_table(runs)}"
    if settings:
        text += f"\n{describe_settings(settings)}"
    return write_atomic(path, text)


def plot_perplexity_vs_length(runs: list[dict], path: str | os.PathLike) -> Path:
    """PNG: one panel per protocol side by side, one line per model, log2 x, log y.

    A dashed vertical line marks each model's training length, so extrapolation is everything
    to its right. Lengths no window reached are left out; lengths resting on few tokens
    (``few_tokens``) are drawn as hollow markers, named in the legend. Uses matplotlib's Agg canvas directly (no pyplot, no display needed).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    protocols = sorted({r["protocol"] for run in runs for r in run["results"]})
    if not protocols:
        raise ValueError("nothing to plot: no results")
    fig = Figure(figsize=(5.2 * len(protocols), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(protocols), sharey=True, squeeze=False)[0]
    train_lens = sorted({run["train_seq_len"] for run in runs if run.get("train_seq_len")})
    for ax, protocol in zip(axes, protocols):
        few_labelled = False
        for run in runs:
            points = sorted((r["length"], r["perplexity"], bool(r.get("few_tokens")))
                            for r in run["results"] if r["protocol"] == protocol
                            and _measured(r) and r["perplexity"] is not None
                            and math.isfinite(r["perplexity"]))
            if points:
                xs, ys, thin = zip(*points)
                line, = ax.plot(xs, ys, marker="o", label=plot_text(run["label"]))
                hollow = [(x, y) for x, y, t in points if t]
                if hollow:
                    hx, hy = zip(*hollow)
                    ax.plot(hx, hy, linestyle="none", marker="o", markersize=9,
                            markerfacecolor="white", markeredgecolor=line.get_color(),
                            label=None if few_labelled else
                            f"few tokens (< {_few_tokens()} at full length)")
                    few_labelled = True
        for i, train_len in enumerate(train_lens):
            # Several: each line says whose it is (a bare "training length" named only one).
            trained = ", ".join(plot_text(run["label"]) for run in runs
                                if run.get("train_seq_len") == train_len)
            ax.axvline(train_len, color="0.4", linestyle=("--", ":", "-.")[i % 3], linewidth=1,
                       label="training length" if len(train_lens) == 1 else
                       f"training length {train_len}: {trained}")
        lengths = sorted({r["length"] for run in runs for r in run["results"]} | set(train_lens))
        length_axes(ax, lengths)
        ax.set_xlabel("context length L (tokens)")
        ax.set_title(protocol + (" (sliding window)" if protocol == "sliding" else
                                 " (non-overlapping windows)"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("perplexity")
    caption = plot_caption(runs)
    if caption:  # wrapped to the figure's width (about 17 small characters per inch)
        import textwrap

        fig.supxlabel(textwrap.fill(caption, int(17 * fig.get_figwidth())), fontsize="small",
                      color="0.3")
    return write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))


def length_axes(ax, lengths: list[int]) -> None:
    """log2 length axis and log perplexity axis, both in plain numbers (512 reads better than
    2^9 next to a table, 346 better than 3.46 x 10^2), ticks at the lengths evaluated.
    Shared with ``benchmarks/length_extrapolation.py``."""
    from matplotlib.ticker import LogFormatter, NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lengths[0] / 1.3, lengths[-1] * 1.3)
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def plot_caption(runs: list[dict]) -> str:
    """What the plot's points leave unsaid and the table marks (‡, n/a): that ``max_tokens``
    cut the held-out set, and which lengths have no point because nothing reached them."""
    results = [r for run in runs for r in run["results"]]
    notes = []
    caps = sorted({r.get("max_tokens") for r in results if r.get("capped")}, key=str)
    if caps:
        notes.append(f"every point scores only the first {', '.join(map(str, caps))} "
                     f"predictions of the held-out set (max_tokens cut it)")
    for cut, why in ((False, "no held-out document reaches it"),
                     (True, "max_tokens ended the scoring before a full window")):
        missing = sorted({r["length"] for r in results
                          if not _measured(r) and bool(r.get("cut_by_max_tokens")) == cut})
        if missing:
            notes.append("no point at L = " + ", ".join(map(str, missing)) +
                         f": {why} (n/a in the table)")
    return "; ".join(notes)


def write_reports(out_dir: str | os.PathLike, runs: list[dict],
                  settings: dict | None = None) -> dict[str, Path]:
    """``eval.json``, ``eval.md`` and ``ppl_vs_length.png`` in ``out_dir``; returns the paths.

    The JSON is written last, and an earlier report's JSON is removed first: its presence
    means the whole report is there, all of it from this call (an interrupted call leaves no
    JSON beside a new Markdown file or plot).
    """
    out = Path(out_dir)
    with _one_writer(out):
        (out / "eval.json").unlink(missing_ok=True)
        paths = {"markdown": write_markdown(out / "eval.md", runs, settings=settings),
                 "plot": plot_perplexity_vs_length(runs, out / "ppl_vs_length.png")}
        paths["json"] = write_json(out / "eval.json", runs, settings)
    return paths


@contextlib.contextmanager
def _one_writer(out: Path):
    """Hold an exclusive ``flock`` on the ``out`` directory itself (no lock file left in it)
    while the report is written: a second ``tape-eval`` given the same ``--out`` waits for the
    first one's three files, so the last one to finish leaves its whole report instead of a
    mix of both (its Markdown, the other's plot). Where the directory cannot be made or opened,
    or the filesystem locks no directories (NFS), nothing is serialised (the writes themselves
    then say what is wrong)."""
    import fcntl

    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # ENOLCK, EBADF, EOPNOTSUPP: no flock on this filesystem
            pass
        yield
    finally:
        os.close(fd)  # releases the lock
