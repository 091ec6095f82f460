"""`tape-eval` measures as the checkpoint's run did: every setting not given as an option comes
from the run config's `eval:` section stored in the checkpoint (tape_train/eval/settings.py).

Checkpoints are the tiny synthetic-data runs of test_eval_reports_cli.py; their held-out
documents are the trainer's own, so the numbers can be compared with its scheduled
evaluation's.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from tape_train.eval.cli import main
from tape_train.eval.config import EvalConfig
from tape_train.eval.perplexity import evaluate_schedule
from tape_train.eval.settings import merge_settings
from test_eval_reports_cli import make_checkpoint

RUN_EVAL = {"interval": 2, "lengths": [8, 16], "protocols": ["nonoverlap"], "max_tokens": 24,
            "batch_size": 2}


def _evaluate(tmp_path, *runs, args=()):
    out = tmp_path / "report"
    code = main(["--checkpoint", *(str(tmp_path / r) for r in runs), "--dtype", "fp32",
                 "--no-progress", "--out", str(out), *args])
    payload = json.loads((out / "eval.json").read_text()) if code == 0 else None
    return code, payload


def _measured(payload, model=0):
    return [(r["protocol"], r["length"], r["tokens"]) for r in payload["models"][model]["results"]]


def test_without_options_the_run_s_eval_section_decides_and_gives_its_logged_numbers(
        tmp_path, caplog):
    """Negative control built in: tape-eval's own defaults (before it read the run's section)
    were L..8L of train.seq_len = 8, both protocols and 32768 tokens: other lengths, other
    protocols, other tokens."""
    from tape_train.config import RunConfig
    from tape_train.train.loop import Trainer

    model = make_checkpoint(tmp_path / "run", "tape", seed=3, eval_section=RUN_EVAL)
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):
        code, payload = _evaluate(tmp_path, "run")
    assert code == 0
    assert _measured(payload) == [("nonoverlap", 8, 24), ("nonoverlap", 16, 24)]
    assert payload["settings"]["max_tokens"] == 24 and payload["settings"]["batch_size"] == 2
    assert payload["settings"]["protocols"] == ["nonoverlap"]
    for line in ("lengths 8 16 (from the run's eval: section)",
                 "protocols nonoverlap (from the run's eval: section)",
                 "max tokens 24 (from the run's eval: section)",
                 "batch size 2 (from the run's eval: section)"):
        assert line in caplog.text
    assert "sliding stride" not in caplog.text  # the default: no line
    # The numbers the run's scheduled evaluation logged (its settings, its held-out documents).
    run_cfg = RunConfig.from_dict({"model": model.cfg.to_dict(), "eval": RUN_EVAL,
                                   "train": {"seq_len": 8, "seed": 7, "synthetic_data": True}})
    docs = list(Trainer._eval_document_source(SimpleNamespace(cfg=run_cfg,
                                                              eval_documents_fn=None)))
    logged = evaluate_schedule(model.float(), docs, run_cfg.eval, train_seq_len=8)
    got = payload["models"][0]["results"]
    assert [r["nll_sum"] for r in got] == pytest.approx([r["nll_sum"] for r in logged],
                                                        rel=1e-6)


def test_options_win_over_the_run_s_section(tmp_path, caplog):
    make_checkpoint(tmp_path / "run", "tape", seed=3, eval_section=RUN_EVAL)
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):
        code, payload = _evaluate(tmp_path, "run", args=[
            "--lengths", "4", "8", "--protocols", "sliding", "--stride", "2",
            "--max-tokens", "16", "--batch-size", "3"])
    assert code == 0
    assert _measured(payload) == [("sliding", 4, 16), ("sliding", 8, 16)]
    assert [r["stride"] for r in payload["models"][0]["results"]] == [2, 2]
    assert payload["settings"]["batch_size"] == 3
    assert "lengths 4 8 (from --lengths)" in caplog.text
    assert "sliding stride 2 (from --stride)" in caplog.text
    assert "eval: section" not in caplog.text
    # One option alone: the others still come from the run.
    code, payload = _evaluate(tmp_path, "run", args=["--max-tokens", "all"])
    assert code == 0 and payload["settings"]["max_tokens"] is None
    assert [(p, length) for p, length, _ in _measured(payload)] == [("nonoverlap", 8),
                                                                    ("nonoverlap", 16)]


def test_an_old_checkpoint_without_the_section_or_some_keys_gets_the_defaults(tmp_path):
    default = EvalConfig()
    make_checkpoint(tmp_path / "old", "rope", seed=4)                     # no eval: at all
    make_checkpoint(tmp_path / "partial", "rope", seed=4, eval_section={"interval": 3})
    for run in ("old", "partial"):
        code, payload = _evaluate(tmp_path, run)
        assert code == 0
        settings = payload["settings"]
        assert settings["protocols"] == default.protocols == ["nonoverlap", "sliding"]
        assert settings["max_tokens"] == default.max_tokens
        assert settings["batch_size"] == default.batch_size
        assert settings["sliding_stride"] is None
        assert sorted({length for _, length, _ in _measured(payload)}) == [8, 16, 32, 64]


def test_runs_that_evaluated_differently_need_the_option_that_chooses(tmp_path, capsys):
    make_checkpoint(tmp_path / "a", "tape", seed=1, eval_section=RUN_EVAL)
    make_checkpoint(tmp_path / "b", "rope", seed=2, eval_section={**RUN_EVAL, "max_tokens": 40})
    code, _ = _evaluate(tmp_path, "a", "b")
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tape-eval: error: ")
    a, b = (str(tmp_path / r / "checkpoints" / "step_00000005") for r in "ab")
    assert (f"the checkpoints' runs evaluated with different eval.max_tokens (24 in {a}; 40 in "
            f"{b})") in err
    assert "choose for all with --max-tokens (e.g. --max-tokens 24)" in err
    assert not (tmp_path / "report").exists()
    # The option settles it; every other setting the two runs share is still theirs.
    code, payload = _evaluate(tmp_path, "a", "b", args=["--max-tokens", "40"])
    assert code == 0
    assert _measured(payload, 0) == _measured(payload, 1) == [("nonoverlap", 8, 40),
                                                              ("nonoverlap", 16, 40)]


def test_lengths_null_in_every_run_means_each_run_s_own_multiples(tmp_path):
    make_checkpoint(tmp_path / "short", "tape", seed=1, seq_len=4,
                    eval_section={"protocols": ["nonoverlap"]})
    make_checkpoint(tmp_path / "long", "rope", seed=2, seq_len=8,
                    eval_section={"protocols": ["nonoverlap"]})
    code, payload = _evaluate(tmp_path, "short", "long")
    assert code == 0
    assert [length for _, length, _ in _measured(payload, 0)] == [4, 8, 16, 32]
    assert [length for _, length, _ in _measured(payload, 1)] == [8, 16, 32, 64]


def test_a_null_and_a_set_value_disagree_and_the_example_is_one_an_option_takes(tmp_path,
                                                                                  capsys):
    make_checkpoint(tmp_path / "a", "tape", seed=1, eval_section={"sliding_stride": None})
    make_checkpoint(tmp_path / "b", "rope", seed=2, eval_section={"sliding_stride": 4})
    assert _evaluate(tmp_path, "a", "b")[0] == 1
    err = capsys.readouterr().err
    assert "different eval.sliding_stride (null (L // 2) in" in err and "; 4 in" in err
    assert "(e.g. --stride 4)" in err


def test_auto_chooses_the_null_of_lengths_and_stride_over_runs_that_set_them(tmp_path, capsys,
                                                                             caplog):
    """Runs with explicit lengths and strides that disagree: `--lengths auto --stride auto`
    is their config's null typed on the command line (each run's L..8L, L // 2)."""
    sliding = {"protocols": ["sliding"], "max_tokens": 16}
    make_checkpoint(tmp_path / "a", "tape", seed=1, seq_len=4,
                    eval_section={**sliding, "lengths": [8], "sliding_stride": 2})
    make_checkpoint(tmp_path / "b", "rope", seed=2, seq_len=8,
                    eval_section={**sliding, "lengths": [16], "sliding_stride": 4})
    assert _evaluate(tmp_path, "a", "b")[0] == 1  # negative control: the runs disagree
    assert "choose for all with --lengths (e.g. --lengths 8)" in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):
        code, payload = _evaluate(tmp_path, "a", "b", args=["--lengths", "auto",
                                                            "--stride", "AUTO"])
    assert code == 0
    for model, seq_len in ((0, 4), (1, 8)):
        results = payload["models"][model]["results"]
        assert [r["length"] for r in results] == [seq_len * m for m in (1, 2, 4, 8)]
        assert [r["stride"] for r in results] == [r["length"] // 2 for r in results]
    assert payload["settings"]["sliding_stride"] is None
    # One value per option: `auto` does not mix with lengths; other words are refused.
    for args, message in ((["--lengths", "auto", "8"], "'auto' (L, 2L, 4L, 8L of each "
                           "checkpoint's train.seq_len) stands alone"),
                          (["--stride", "half"], "invalid value 'half': an integer or 'auto'")):
        try:
            code = _evaluate(tmp_path, "a", args=args)[0]
        except SystemExit as exc:  # argparse's own refusal of a value
            code = exc.code
        assert code != 0
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("section, args, message", [
    # the run's stride, the user's lengths: each named as it was given
    ({"sliding_stride": 4}, ["--lengths", "4", "8"],
     "eval.sliding_stride=4 must be smaller than every evaluation length, got length 4"),
    # the user's stride, the run's protocols
    ({"protocols": ["nonoverlap"]}, ["--stride", "2"],
     "--stride is only used by --protocols sliding, which is not asked for (the run's eval: "
     "section: eval.protocols nonoverlap): add sliding (--protocols nonoverlap sliding), or "
     "drop --stride"),
    # a section the trainer would have refused (written by other code)
    ({"max_tokens": 0}, [],
     "{ckpt}: its run config: eval.max_tokens must be a positive integer, got 0"),
    ({"lenghts": [8]}, [], "{ckpt}: its run config: unknown key(s) 'eval.lenghts' (did you "
                           "mean 'eval.lengths'?)"),
])
def test_settings_that_do_not_fit_together_say_where_each_came_from(tmp_path, capsys, section,
                                                                    args, message):
    make_checkpoint(tmp_path / "run", "rope", seed=4, eval_section=section)
    assert _evaluate(tmp_path, "run", args=args)[0] == 1
    err = capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000005"
    assert f"tape-eval: error: {message.format(ckpt=ckpt)}" in err, err
    assert not (tmp_path / "report").exists()


def test_the_run_s_stride_too_large_for_its_own_multiples_names_both_origins(tmp_path, capsys):
    make_checkpoint(tmp_path / "run", "rope", seed=4, seq_len=4,
                    eval_section={"sliding_stride": 4})
    assert _evaluate(tmp_path, "run")[0] == 1
    err = capsys.readouterr().err
    assert "eval.sliding_stride=4 must be smaller than every evaluation length, got length 4" in err
    assert "L, 2L, 4L, 8L of its train.seq_len=4" in err
    assert "sliding_stride from the run's eval: section" in err


def test_merge_settings_keeps_a_shared_value_and_names_every_run_that_differs():
    runs = {"r1": EvalConfig(batch_size=8), "r2": EvalConfig(batch_size=8),
            "r3": EvalConfig(batch_size=2)}
    with pytest.raises(ValueError, match=r"eval\.batch_size \(8 in r1, r2; 2 in r3\)"):
        merge_settings({}, runs)
    chosen = merge_settings({"batch_size": 2}, runs)
    assert chosen.config.batch_size == 2 and chosen.origin["batch_size"] == "--batch-size"
    assert chosen.origin["max_tokens"] == "the eval: sections of the 3 checkpoints' runs"
    assert merge_settings({}, dict(list(runs.items())[:2])).config.batch_size == 8


def _run_demo_sh_with_stubs(tmp_path, *args, training_exit=0, expect=0):
    """launch/demo.sh in a copy of the repo whose local.sh and .venv/bin programs only record
    how they were called (local.sh then exits ``training_exit``): (each call's command line,
    demo.sh's stdout), or with ``expect`` != 0 (demo.sh's exit code), its stderr."""
    import shutil
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "launch").mkdir(parents=True)
    shutil.copy(repo / "launch" / "demo.sh", tmp_path / "launch" / "demo.sh")
    calls = tmp_path / "calls"
    stub = f'#!/bin/bash\necho "$(basename "$0") $*" >> {calls}\n'
    (tmp_path / "launch" / "local.sh").write_text(stub + f"exit {training_exit}\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "tape-data", "tape-tokenizer", "tape-eval"):
        (bin_dir / name).write_text(stub)
        (bin_dir / name).chmod(0o755)
    data = tmp_path / "data" / "demo"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    (data / "tokenizer.model").write_text("")
    proc = subprocess.run(["bash", str(tmp_path / "launch" / "demo.sh"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == expect, proc.stderr
    return calls.read_text().splitlines(), proc.stdout if expect == 0 else proc.stderr


def test_the_demo_s_final_evaluation_follows_the_run_it_trained(tmp_path):
    """launch/demo.sh passes its arguments to training as overrides; its final tape-eval had
    its own lengths and token cap (128..1024, 16384), so `bash launch/demo.sh
    eval.lengths=[64,128]` trained and logged at 64, 128 but reported 128..1024."""
    (train, evaluate), _ = _run_demo_sh_with_stubs(tmp_path, "eval.lengths=[64,128]")
    assert train.startswith("local.sh 1 --config configs/train/demo.yaml") \
        and train.endswith("eval.lengths=[64,128]")
    assert evaluate.startswith("tape-eval --checkpoint runs/demo --out runs/demo/eval")
    assert "--lengths" not in evaluate and "--max-tokens" not in evaluate


def test_the_demo_evaluates_and_reports_the_run_dir_it_was_given(tmp_path):
    """`bash launch/demo.sh train.run_dir=runs/mine` trained into runs/mine (the override
    comes after demo.sh's own train.run_dir=runs/demo, and the last one wins) but evaluated
    runs/demo, another run or none, and its closing lines named runs/demo's files."""
    (train, evaluate), out = _run_demo_sh_with_stubs(
        tmp_path, "train.run_dir=runs/first", "train.max_steps=10", "train.run_dir=runs/mine")
    assert train.endswith("train.run_dir=runs/mine")
    assert evaluate.startswith("tape-eval --checkpoint runs/mine --out runs/mine/eval")
    assert "runs/mine/metrics.jsonl" in out and "runs/mine/eval/ppl_vs_length.png" in out
    assert "runs/demo" not in out and "runs/first" not in evaluate + out
    # without the override: runs/demo, as before (negative control)
    (_, evaluate), out = _run_demo_sh_with_stubs(tmp_path / "plain", "train.max_steps=10")
    assert evaluate.startswith("tape-eval --checkpoint runs/demo --out runs/demo/eval")
    assert "runs/demo/metrics.jsonl" in out


@pytest.mark.parametrize("code", [130, 75])
def test_a_demo_stopped_in_training_says_how_to_continue(tmp_path, code):
    """Ctrl-C stops the demo's training at a step with a checkpoint (exit 130); demo.sh
    ended with make's 'Error 130' and no word that `make demo` continues. Control: a training
    that fails (exit 1) ends demo.sh with its code and no such line, and nothing is evaluated."""
    calls, err = _run_demo_sh_with_stubs(tmp_path, training_exit=code, expect=code)
    assert err.strip().splitlines()[-1] == (
        f"demo.sh: training stopped with a checkpoint (exit {code}); run 'make demo' again to "
        f"continue from it")
    assert not any(c.startswith("tape-eval") for c in calls)
    calls, err = _run_demo_sh_with_stubs(tmp_path / "failed", training_exit=1, expect=1)
    assert "make demo" not in err and not any(c.startswith("tape-eval") for c in calls)


def test_lengths_the_held_out_data_cannot_fill_say_where_they_came_from(tmp_path, capsys):
    """The run's eval.lengths, beyond its held-out documents, were refused as 'shorter
    lengths' with no word that they came from the run (nothing was typed)."""
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=300_000)
    write_jsonl(tmp_path / "heldout.jsonl", real_text_documents(max_documents=3))
    data = {"sources": [{"path": str(tmp_path / "heldout.jsonl")}], "tokenizer": tok.path,
            "eval_sources": [{"path": str(tmp_path / "heldout.jsonl")}]}
    make_checkpoint(tmp_path / "run", "tape", seed=3, vocab_size=tok.vocab_size, data=data,
                    eval_section={**RUN_EVAL, "lengths": [100000]})
    code, _ = _evaluate(tmp_path, "run")
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "step_00000005: cannot evaluate L=100000: no held-out document reaches it" in err
    assert err.rstrip().endswith("or shorter lengths (lengths from the run's eval: section)")
    code, _ = _evaluate(tmp_path, "run", args=["--lengths", "100000"])
    assert code == 1 and capsys.readouterr().err.rstrip().endswith(
        "or shorter lengths (lengths from --lengths)")
