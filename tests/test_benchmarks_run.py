"""``benchmarks/run.py --quick`` end to end on a shrunken model: every part runs in its own
processes and the JSON, Markdown and PNGs come out with sane numbers. Slow-ish (~30 s on 2
quiet cores): it spawns three trainers. Timeouts are hang guards, far above the expected time."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run.py"
SHRINK = ["model.num_layers=2", "model.vocab_size=512"]


def _run(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    # The timeout only catches a hang: a slow or busy CPU must not fail the test. The demo
    # recipe's dtype is `auto` (fp32 where bf16 is slow), so it never depends on bf16 speed.
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_writes_a_consistent_report(tmp_path):
    from tape_train.config import load_run_config
    from tape_train.model.flops import training_flops_per_token

    out = tmp_path / "docs"
    proc = _run("--quick", "--out-dir", str(out), "--work-dir", str(tmp_path),
                "--encodings", "tape", "rope", "--seq-lens", "64", "--tokens-per-step", "128",
                "--steps", "2", "--checkpoint-reps", "2", "--stdlib-text",
                "--data-megabytes", "0.3", "--set", *SHRINK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[training] N=64 round 1/1" in proc.stdout  # progress lines as it goes
    report = json.loads((out / "benchmarks" / "benchmarks.json").read_text())
    assert set(report) >= {"command", "machine", "load_average", "elapsed_s", "data",
                           "checkpoint", "training"}
    assert {"cpu", "logical_cpus", "torch", "date"} <= set(report["machine"])

    training = report["training"]
    assert 0 < training["gemm_peak_tflops"] < 100
    assert [(r["pe"], r["seq_len"], r["micro_batch"]) for r in training["rows"]] == [
        ("tape", 64, 2), ("rope", 64, 2)]
    for row in training["rows"]:
        assert len(row["step_times_s"]) == len(row["preemptions_per_step"]) == 2
        assert row["step_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(128 / row["step_s"])
        assert 0 < row["mfu"] < 1
        assert row["peak_rss_mib"] >= row["setup_peak_rss_mib"] > 50
        # FLOPs come from the one FLOP model, for the config that actually ran.
        cfg = load_run_config(ROOT / "configs/train/demo.yaml",
                              [f"model.pe={row['pe']}", *SHRINK]).model
        assert row["flops_per_token"] == training_flops_per_token(cfg, 64, micro_batch=2)
    [ratio] = training["tape_vs_rope"]
    tape, rope = training["rows"]
    assert ratio["time_ratio"] == pytest.approx(tape["step_s"] / rope["step_s"])
    assert ratio["flop_ratio"] == pytest.approx(tape["flops_per_token"] / rope["flops_per_token"])
    assert ratio["flop_ratio"] > 1  # TAPE does more work than RoPE

    data = report["data"]
    assert data["raw_tokens_per_s"] > 0 and data["pipeline_tokens_per_s"] > 0

    ckpt = report["checkpoint"]
    assert [r["raw_first"] for r in ckpt["reps"]] == [False, True]  # the order alternates
    for rep in ckpt["reps"]:
        assert rep["bytes"] > 1e6 and rep["files"] >= 2  # DeepSpeed's shards and our state
        assert rep["raw_bytes"] == pytest.approx(rep["bytes"], rel=1e-3)  # as many bytes raw
    for key in ("save_gbps", "save_durable_gbps", "raw_write_gbps", "raw_write_durable_gbps",
                "load_gbps", "raw_read_gbps"):
        assert ckpt[key] > 0, key

    md = (out / "benchmarks.md").read_text()
    assert "python benchmarks/run.py --quick" in md and "| tape |" in md
    for section in ("## Training throughput", "### TAPE vs RoPE", "## Peak memory",
                    "## Data pipeline", "## Checkpoint save and load"):
        assert section in md
    for png in ("throughput.png", "memory.png"):
        assert (out / "benchmarks" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("tape-bench-*"))  # scratch removed after success


def test_bad_request_fails_before_measuring(tmp_path):
    proc = _run("--quick", "--out-dir", str(tmp_path), "--seq-lens", "96",
                "--tokens-per-step", "128", timeout=300)
    assert proc.returncode == 2
    assert "not a positive multiple of N=96" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure injected is 'no CUDA'")
def test_worker_failure_is_reported_with_its_traceback(tmp_path):
    # Valid config, but the trainer cannot start on this machine: the child's error must reach
    # the parent's stderr with the traceback and the log's path, and nothing is written.
    proc = _run("--quick", "--parts", "checkpoint", "--out-dir", str(tmp_path / "docs"),
                "--work-dir", str(tmp_path), "--set", "train.device=cuda", timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "checkpoint worker (tiny) failed" in proc.stderr
    assert "torch.cuda.is_available() is False" in proc.stderr
    assert "checkpoint.log" in proc.stderr and "scratch kept" in proc.stderr
    assert not (tmp_path / "docs").exists()


def test_cpu_attention_benchmark_runs_every_variant():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"),
                          "--dtypes", "float32", "--seq-lens", "32", "--tokens", "64",
                          "--heads", "2", "--head-dim", "8", "--reps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("float32"))
    ratios = [float(cell.rstrip("x")) for cell in row.split()[3:]]
    assert len(ratios) == 3 and all(r > 0 for r in ratios), row


def test_lean_activations_benchmark_compares_like_with_like(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lean_activations.py"),
                          "--sizes", "tiny", "--seq-len", "512", "--reps", "1",
                          "--json", str(tmp_path / "lean.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "lean.json").read_text())["rows"]
    assert [r["pe"] for r in rows] == ["tape", "rope"]
    # The same model and batch: the same loss. The lean one keeps less once a micro-batch has
    # more tokens than the hidden size (below, the head's fp32 ∂W, V × C, outweighs the logits).
    for r in rows:
        assert r["loss"]["lean"] == pytest.approx(r["loss"]["plain"], rel=1e-5)
        assert 0 < r["lean_saved_mib"] < r["plain_saved_mib"]
        assert r["plain_s"] > 0 and r["lean_s"] > 0


def test_tape_update_benchmark_compares_like_with_like(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tape_update.py"),
                          "--sizes", "tiny", "--seq-len", "128", "--rounds", "1",
                          "--trace-sizes", "tiny", "--json", str(tmp_path / "upd.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "upd.json").read_text())
    for r in res["update"]:       # the plain form keeps E' and more; the node, at real head
        assert 0 < r["node_kept_bytes"] < r["plain_kept_bytes"]       # widths, less than E
        assert r["D"] < 64 or r["node_kept_bytes"] < r["e_bytes"] < r["plain_kept_bytes"]
        assert r["plain_us"] > 0 and r["node_us"] > 0 and r["node_ops"] > 0
    (model,) = res["model"]
    assert model["node_loss"] == pytest.approx(model["plain_loss"], rel=1e-6)
    for r in res["trace"]:
        assert r["rope_gib"] < r["node_gib"] < r["plain_gib"]


def test_length_extrapolation_summary_reads_a_log_cut_by_a_kill(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import length_extrapolation

    rows = [{"kind": "train", "step": s, "loss": 1.0 / s, "tokens_seen": 10 * s} for s in (1, 2)]
    log = "".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "step": 3, "lo'
    (tmp_path / "metrics.jsonl").write_text(log)  # a run killed while logging step 3
    assert length_extrapolation.run_summary(tmp_path) == {"loss": 0.75, "steps": 2,
                                                          "tokens": 20}


@pytest.mark.parametrize("args, message", [
    (["--work-dir", "{tmp}/missing"], "--work-dir {tmp}/missing does not exist"),
    (["--work-dir", "{tmp}/file"], "--work-dir {tmp}/file is not a directory"),
    (["--out-dir", "{tmp}/file"], "--out-dir {tmp}/file exists and is not a directory"),
    (["--tokens-per-step", "0"], "--tokens-per-step 0 is not a positive multiple of N=128"),
    (["--seq-lens", "0"], "--seq-lens must be positive, got 0"),
    (["--data-megabytes", "-1"], "--data-megabytes must be > 0 and --data-repeats >= 1"),
    (["--data-repeats", "0"], "--data-megabytes must be > 0 and --data-repeats >= 1"),
])
def test_bad_scratch_output_or_sizes_are_named_before_measuring(tmp_path, args, message):
    """A --work-dir that does not exist (or is a file) was tempfile.mkdtemp's traceback after
    the checks; --tokens-per-step 0 passed the multiple check (0 % N == 0)."""
    (tmp_path / "file").write_text("x")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--out-dir" not in args:
        args += ["--out-dir", str(tmp_path / "out")]
    proc = _run("--quick", "--stdlib-text", *args, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message.format(tmp=tmp_path) in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


def _length_extrapolation(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import length_extrapolation

    return length_extrapolation


@pytest.mark.parametrize("options, partial", [
    ({}, False),                                      # the experiment: the published report
    ({"encodings": ["rope", "tape"]}, False),         # all of them, in another order
    ({"max_steps": 20}, True),
    ({"eval_max_tokens": 512}, True),
    ({"encodings": ["tape"]}, True),
])
def test_length_extrapolation_partial_run_leaves_the_published_report(monkeypatch, options,
                                                                       partial):
    """The documented smoke run (`--encodings tape rope --max-steps 20`) used to train into
    the experiment's run directories and overwrite docs/results.md and its plot."""
    bench = _length_extrapolation(monkeypatch)
    exp = {"encodings": ["tape", "rope"], "run_root": "runs/x", "out_dir": "docs/results"}
    args = argparse.Namespace(**{"encodings": None, "max_steps": None, "eval_max_tokens": None,
                                 "run_root": None, "out_dir": None, "results": None,
                                 **options})
    encodings = args.encodings or exp["encodings"]
    run_root, out_dir, results = bench.output_paths(args, exp, encodings)
    published = (ROOT / "docs" / "results.md", ROOT / "docs" / "results")
    if not partial:
        assert (results, out_dir) == published
        assert run_root == ROOT / "runs" / "x"
        return
    assert results != published[0] and out_dir != published[1]
    assert results.parent == out_dir == run_root / "report"
    partial_runs = ROOT / "runs" / "x-partial"
    assert run_root == (partial_runs if "max_steps" in options else ROOT / "runs" / "x")
    # Named places still win.
    args.run_root, args.out_dir, args.results = "r", "o", "o/res.md"
    assert bench.output_paths(args, exp, encodings) == (ROOT / "r", ROOT / "o",
                                                        ROOT / "o" / "res.md")


@pytest.mark.parametrize("budgets_differ", [False, True])
def test_length_extrapolation_report_says_what_was_not_measured(tmp_path, monkeypatch,
                                                                budgets_differ):
    """A length no held-out document reached (perplexity null, `measured: false`) used to read
    `inf` (and its ratio `inf`); runs of different token budgets were called 'one budget'."""
    bench = _length_extrapolation(monkeypatch)

    def result(protocol, length, ppl, few=False):
        return {"protocol": protocol, "length": length, "perplexity": ppl,
                "measured": ppl is not None, "few_tokens": few or ppl is None}

    report = {"models": [{"label": f"{pe}-seed1", "results": [
        result("nonoverlap", 64, 10.0 + i), result("nonoverlap", 128, 11.0 + i, few=i == 1),
        result("nonoverlap", 256, None)]} for i, pe in enumerate(("tape", "rope"))]}
    exp = {"recipe": "configs/train/demo.yaml", "train_overrides": {"train.seq_len": 64},
           "eval": {"lengths": [64, 128, 256], "protocols": ["nonoverlap"],
                    "max_tokens": 1000}}
    summaries = {"tape-seed1": {"steps": 10, "tokens": 640, "loss": 5.0},
                 "rope-seed1": {"steps": 20 if budgets_differ else 10,
                                "tokens": 1280 if budgets_differ else 640, "loss": 5.0}}
    md = tmp_path / "results.md"
    bench.write_results(exp, bench.aggregate(report), summaries, tmp_path, md,
                        few=bench.few_token_cells(report), config="exp.yaml")
    text = md.read_text()
    assert "inf" not in text and "overrides in `exp.yaml`" in text
    assert "| tape | 10.00 | 11.00 | n/a | n/a |" in text
    # tape-eval's † (few tokens at full length) is kept, for the cell it marks only.
    assert "| rope | 11.00 | 12.00 † | n/a | n/a |" in text
    assert "†: rests on fewer than 1000 predictions" in text
    assert "n/a: no held-out document reaches this length" in text
    assert ("DIFFERENT token budgets (640, 1,280 tokens" in text) == budgets_differ
    assert ("under one token budget" in text) != budgets_differ
    assert (tmp_path / "ppl_vs_length.png").stat().st_size > 0
    assert "(at most 1000 scored tokens per length and protocol)" in text
    exp["eval"]["max_tokens"] = None     # the whole held-out set (read "at most None")
    bench.write_results(exp, bench.aggregate(report), summaries, tmp_path, md,
                        held_out="data config exp.yaml (0.1 of the documents of web)")
    text = md.read_text()
    assert "(every held-out prediction per length and protocol)" in text
    # What tape-eval scored, not "the held-out demo corpus" whatever the config.
    assert "evaluated on data config exp.yaml (0.1 of the documents of web) (" in text
    assert "demo corpus" not in text


def test_length_extrapolation_plot_reads_like_tape_evals(tmp_path, monkeypatch):
    """The results plot labelled lengths 2^8..2^12 and perplexities 3.465 x 10^2, and drew a
    legend inside each panel, over the curves of seven encodings."""
    from matplotlib.axes import Axes
    from matplotlib.ticker import ScalarFormatter

    bench = _length_extrapolation(monkeypatch)
    legends, axes = [], []
    legend = Axes.legend

    def record(ax, *args, **kwargs):
        legends.append(kwargs)
        axes.append(ax)
        return legend(ax, *args, **kwargs)

    monkeypatch.setattr(Axes, "legend", record)
    table = {pe: {(p, n): [300.0 + i + n / 1000] for p in ("nonoverlap", "sliding")
                  for n in (64, 128, 256)} for i, pe in enumerate(("tape", "rope"))}
    bench.plot(table, [64, 128, 256], ["nonoverlap", "sliding"], 64, tmp_path / "p.png")
    assert len(legends) == 1 and legends[0].get("bbox_to_anchor") == (1.02, 1)
    ax = axes[0]
    assert list(ax.get_xticks()) == [64, 128, 256]
    assert isinstance(ax.xaxis.get_major_formatter(), ScalarFormatter)
    assert ax.yaxis.get_minor_formatter()(300.0) == "300"
