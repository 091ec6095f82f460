"""Train one `tiny` model per positional encoding (and seed) under one token budget, evaluate
all of them at growing context lengths, and write ``docs/results.md`` with a plot.

    python benchmarks/length_extrapolation.py                     # the whole experiment
    python benchmarks/length_extrapolation.py --encodings tape rope --max-steps 20   # smoke run

Every step is resumable: training auto-resumes from the run directory (a finished run
returns at once) and evaluation is rerun from the checkpoints. The configuration is
``configs/experiments/length-extrapolation.yaml``.

A partial run (``--max-steps``, ``--eval-max-tokens`` or a subset of ``--encodings``) writes
its report under ``<run root>/report`` and, with ``--max-steps``, trains under
``<run_root>-partial`` (``--run-root``, ``--out-dir`` and ``--results`` override): it never
replaces the published ``docs/results.md`` and plot, nor trains the experiment's own runs
under another schedule.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from tape_train.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]


def runs_of(exp: dict, encodings: list[str]) -> list[tuple[str, int]]:
    seeds = exp.get("seeds", {})
    return [(pe, seed) for pe in encodings for seed in seeds.get(pe, seeds.get("default", [1]))]


def train(exp: dict, pe: str, seed: int, run_dir: Path, extra: list[str]) -> None:
    overrides = [f"{k}={v if isinstance(v, str) else json.dumps(v)}"  # YAML scalars: null
                 for k, v in exp.get("train_overrides", {}).items()]
    cmd = [sys.executable, "-m", "tape_train.train.cli", "--config", exp["recipe"], *overrides,
           f"model.pe={pe}", f"train.seed={seed}", f"train.run_dir={run_dir}",
           "logging.progress_bar=false", *extra]
    print(f"== train {pe} seed {seed}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def evaluate(exp: dict, runs: list[tuple[str, int]], run_root: Path, out: Path) -> dict:
    ev = exp["eval"]
    cmd = [sys.executable, "-m", "tape_train.eval.cli", "--out", str(out),
           "--lengths", *map(str, ev["lengths"]), "--protocols", *ev["protocols"],
           "--max-tokens", str(ev["max_tokens"]), "--checkpoint"]
    # Relative to the repository (the command runs there): the report carries no machine paths.
    cmd += [os.path.relpath(run_root / f"{pe}-seed{seed}", ROOT) for pe, seed in runs]
    cmd += ["--label", *[f"{pe}-seed{seed}" for pe, seed in runs]]
    print(f"== evaluate: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((out / "eval.json").read_text())


def aggregate(report: dict) -> dict[str, dict[tuple[str, int], list[float]]]:
    """encoding → (protocol, length) → perplexities over seeds; NaN where nothing was
    measured (no held-out window reached the length: ``measured`` false, perplexity null)."""
    table: dict[str, dict[tuple[str, int], list[float]]] = {}
    for model in report["models"]:
        pe = model["label"].rsplit("-seed", 1)[0]
        for r in model["results"]:
            ppl = r["perplexity"]
            if ppl is None or not r.get("measured", True):
                ppl = math.nan
            table.setdefault(pe, {}).setdefault((r["protocol"], r["length"]), []).append(ppl)
    return table


def cell(values: list[float], digits: int = 2) -> str:
    if any(math.isnan(v) for v in values):
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (f"{statistics.mean(values):.{digits}f} ± "
            f"{(max(values) - min(values)) / 2:.{digits}f}")


def plot(table, lengths, protocols, train_len, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tape_train.eval.report import length_axes

    fig = Figure(figsize=(5.4 * len(protocols), 4.3), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(protocols), sharey=True, squeeze=False)[0]
    for ax, protocol in zip(axes, protocols):
        for pe, cells in table.items():
            means = [statistics.mean(cells[(protocol, n)]) for n in lengths]  # NaN: a gap
            lo = [min(cells[(protocol, n)]) for n in lengths]
            hi = [max(cells[(protocol, n)]) for n in lengths]
            line, = ax.plot(lengths, means, marker="o", label=pe,
                            linewidth=2.5 if pe == "tape" else 1.4)
            if any(h > l for h, l in zip(hi, lo)):
                ax.fill_between(lengths, lo, hi, color=line.get_color(), alpha=0.2)
        ax.axvline(train_len, color="0.4", linestyle="--", linewidth=1, label="training length")
        length_axes(ax, sorted(set(lengths) | {train_len}))  # plain numbers, as tape-eval's
        ax.set(xlabel="context length L (tokens)", title=f"{protocol} windows")
        ax.grid(True, which="both", alpha=0.3)
    # One legend, beside the panels: inside, one per panel, it covered curves.
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))
    axes[0].set_ylabel("perplexity (held-out text)")
    fig.savefig(path, format="png", dpi=120)


def run_summary(run_dir: Path) -> dict:
    """Final loss, steps and tokens of one run, from its metrics log (``read_metrics``: a line
    cut by a kill is skipped, a replayed step counted once)."""
    from tape_train.train.metrics import read_metrics

    train_records = read_metrics(run_dir, "train")
    if not train_records:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no training steps logged")
    return {"loss": statistics.mean(r["loss"] for r in train_records[-20:]),
            "steps": train_records[-1]["step"], "tokens": train_records[-1]["tokens_seen"]}


def few_token_cells(report: dict) -> set[tuple[str, str, int]]:
    """(encoding, protocol, length) cells where a run's perplexity rests on fewer than
    tape-eval's FEW_TOKENS predictions at full length (its table's †)."""
    return {(model["label"].rsplit("-seed", 1)[0], r["protocol"], r["length"])
            for model in report["models"] for r in model["results"]
            if r.get("few_tokens") and r.get("measured", True)}


def write_results(exp, table, summaries, out_dir: Path, results_md: Path,
                  few: set[tuple[str, str, int]] = frozenset(),
                  config: str = "configs/experiments/length-extrapolation.yaml",
                  held_out: str | None = None) -> None:
    """``held_out``: what tape-eval scored (its ``settings.data``), named in the header."""
    ev = exp["eval"]
    lengths, protocols = ev["lengths"], ev["protocols"]
    train_len = int(exp["train_overrides"]["train.seq_len"])
    plot_path = out_dir / "ppl_vs_length.png"
    plot(table, lengths, protocols, train_len, plot_path)
    budgets = sorted({t["tokens"] for t in summaries.values()})
    budget = "under one token budget"
    if len(budgets) > 1:  # e.g. a run resumed to more steps, or left short by a kill
        seen = ", ".join(f"{b:,}" for b in budgets)
        budget = (f"under DIFFERENT token budgets ({seen} tokens; see the training runs "
                  f"below), so the rows do not compare")
        print(f"warning: the runs saw different numbers of tokens ({seen}): the report says "
              f"so", file=sys.stderr)
    # `max_tokens: null` (the docs' way to score the whole long-document set) read "at most
    # None scored tokens".
    scored = ("every held-out prediction" if ev.get("max_tokens") is None else
              f"at most {ev['max_tokens']} scored tokens")
    lines = ["# Length extrapolation at small scale", "",
             f"`tiny` models ({exp['recipe']}, overrides in "
             f"`{config}`), trained at L = "
             f"{train_len} {budget}, evaluated on "
             f"{held_out or 'the held-out documents of the runs’ data'} "
             f"({scored} per length and protocol). Cells are "
             "perplexity; with several seeds, mean ± half the range. Produced by "
             "`python benchmarks/length_extrapolation.py`.", "",
             f"![perplexity vs context length]({os.path.relpath(plot_path, results_md.parent)})",
             ""]
    longest = lengths[-1]
    for protocol in protocols:
        lines += [f"## {protocol}", "", "| encoding | " + " | ".join(f"L={n}" for n in lengths)
                  + f" | ppl(L={longest}) / ppl(L={train_len}) |",
                  "|---|" + "---:|" * (len(lengths) + 1)]
        for pe, cells in table.items():
            growth = [hi / lo for hi, lo in zip(cells[(protocol, longest)],
                                                cells[(protocol, train_len)])]  # NaN: n/a
            marked = [cell(cells[(protocol, n)]) + (" †" if (pe, protocol, n) in few else "")
                      for n in lengths]
            lines.append(f"| {pe} | " + " | ".join(marked) + f" | {cell(growth, 3)} |")
        lines.append("")
    lines += ["The last column is the extrapolation in one number: below 1, the model uses "
              "the context beyond its training length; above 1, it degrades there.", ""]
    if few:
        from tape_train.eval.perplexity import FEW_TOKENS

        lines += [f"†: rests on fewer than {FEW_TOKENS} predictions scored by full-length "
                  "windows (in at least one seed): a rough estimate; raise the evaluation's "
                  "max_tokens or use longer held-out documents.", ""]
    if any(math.isnan(v) for cells in table.values() for vs in cells.values() for v in vs):
        lines += ["n/a: no held-out document reaches this length, so nothing was measured at "
                  "it (tape-eval's `measured: false`); use longer held-out documents.", ""]
    lines += [f"Held-out text: {ev.get('data_note', 'see the experiment config')}.", ""]
    lines += ["## Training runs", "",
              "Same data order, token budget and schedule for every run; throughput per "
              "encoding is measured separately, on an idle machine, in "
              "[benchmarks.md](benchmarks.md).", "",
              "| run | steps | tokens | final training loss (mean of the last 20 steps) |",
              "|---|---:|---:|---:|"]
    for name, t in summaries.items():
        lines.append(f"| {name} | {t['steps']} | {t['tokens']:,} | {t['loss']:.3f} |")
    notes = out_dir / "notes.md"  # the human reading of the numbers, kept across re-runs
    if notes.is_file():
        lines += ["", notes.read_text().rstrip()]
    write_atomic(results_md, "\n".join(lines) + "\n")
    print(f"wrote {results_md} and {plot_path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/experiments/length-extrapolation.yaml")
    parser.add_argument("--encodings", nargs="+", help="subset of the experiment's encodings")
    parser.add_argument("--max-steps", type=int, help="override train.max_steps (smoke runs)")
    parser.add_argument("--run-root", help="override run_root (with --max-steps: "
                        "<run_root>-partial)")
    parser.add_argument("--results", help="the Markdown report (default: docs/results.md; a "
                        "partial run: <run root>/report/results.md)")
    parser.add_argument("--skip-train", action="store_true", help="evaluate existing runs only")
    parser.add_argument("--skip-eval", action="store_true",
                        help="rewrite the results from the last evaluation's eval.json")
    parser.add_argument("--eval-max-tokens", type=int, help="override eval.max_tokens (smoke runs)")
    parser.add_argument("--out-dir", help="override out_dir (plots and eval outputs; a "
                        "partial run: <run root>/report)")
    args = parser.parse_args()
    exp = yaml.safe_load((ROOT / args.config).read_text())
    encodings = args.encodings or exp["encodings"]
    unknown = sorted(set(encodings) - set(exp["encodings"]))
    if unknown:
        parser.error(f"--encodings {unknown} not in {args.config}: {exp['encodings']}")
    for option, value in (("--max-steps", args.max_steps),
                          ("--eval-max-tokens", args.eval_max_tokens)):
        if value is not None and value < 1:
            parser.error(f"{option} must be a positive integer, got {value}")
    run_root, out_dir, results_md = output_paths(args, exp, encodings)
    if args.eval_max_tokens:
        exp["eval"]["max_tokens"] = args.eval_max_tokens
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = [f"train.max_steps={args.max_steps}"] if args.max_steps else []
    runs = runs_of(exp, encodings)
    if not args.skip_train:
        for pe, seed in runs:
            train(exp, pe, seed, run_root / f"{pe}-seed{seed}", extra)
    summaries = {f"{pe}-seed{seed}": run_summary(run_root / f"{pe}-seed{seed}") for pe, seed in runs}
    if args.skip_eval:
        report = json.loads((out_dir / "eval" / "eval.json").read_text())
    else:
        report = evaluate(exp, runs, run_root, out_dir / "eval")
    write_results(exp, aggregate(report), summaries, out_dir, results_md,
                  few=few_token_cells(report), config=args.config,
                  held_out=(report.get("settings") or {}).get("data"))
    return 0


def output_paths(args: argparse.Namespace, exp: dict, encodings: list[str]
                 ) -> tuple[Path, Path, Path]:
    """(run root, out dir, results Markdown) of this invocation.

    A partial run (fewer steps, a smaller evaluation cap, a subset of the encodings) writes its
    report under ``<run root>/report``, not over the published ``docs/results.md``, its plot
    and evaluation; with ``--max-steps`` its runs are ``<run_root>-partial`` as well (the
    experiment's own runs, trained to other ``max_steps``, would no longer share one schedule
    and budget). ``--run-root``, ``--out-dir`` and ``--results`` override each of these.
    """
    partial = [option for option, used in (
        ("--max-steps", args.max_steps is not None),
        ("--eval-max-tokens", args.eval_max_tokens is not None),
        ("--encodings", set(encodings) != set(exp["encodings"]))) if used]
    if args.run_root:
        run_root = ROOT / args.run_root
    else:
        run_root = ROOT / (exp["run_root"] + ("-partial" if args.max_steps is not None else ""))
    report = run_root / "report"
    if args.out_dir:
        out_dir = ROOT / args.out_dir
    else:
        out_dir = report if partial else ROOT / exp["out_dir"]
    if args.results:
        results = ROOT / args.results
    else:
        results = report / "results.md" if partial else ROOT / "docs" / "results.md"
    if partial:
        print(f"partial run ({', '.join(partial)}): runs in {run_root}, report {results}, "
              f"plot and evaluation in {out_dir}", flush=True)
    return run_root, out_dir, results


if __name__ == "__main__":
    sys.exit(main())
