"""The first mistakes of a new user get one line that says what is wrong and what to do, and
fail before any heavy start-up: an unknown model size, a missing corpus, a missing checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tape_train.data.config import DataError, SourceConfig
from tape_train.data.formats import resolve_local_shards


def test_tape_model_info_names_an_unknown_size_in_one_line(capsys):
    from tape_train.model.cli import main

    assert main(["info", "tiny", "--pe", "rope"]) == 0  # positive control
    assert "tiny pe=rope" in capsys.readouterr().out
    assert main(["info", "huge"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tape-model: error: model config 'huge' not found")
    assert "named model configs: 125m" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["info", "tiny", "--seq-len", "0"])
    assert exc.value.code == 2
    assert "--seq-len: expected a positive number of tokens, got '0'" in capsys.readouterr().err
    for flag in ("--pe", "--seq-len"):  # given without a value: it printed nothing, exit 0
        with pytest.raises(SystemExit) as exc:
            main(["info", "tiny", flag])
        assert exc.value.code == 2
        assert f"argument {flag}: expected at least one argument" in capsys.readouterr().err


def test_tape_model_info_counts_fire_per_micro_batch(capsys):
    """FIRE's MLP is shared by a micro-batch: its line names the micro-batch, and a larger one
    costs less per token; RoPE's line has no micro-batch (negative control); 0 is refused."""
    from tape_train.model.cli import main

    def per_token(*argv):
        assert main(["info", "tiny", "--pe", "fire", "rope", *argv]) == 0
        lines = capsys.readouterr().out.splitlines()
        return {line.split()[1]: (line, float(line.split()[-2])) for line in lines}

    one, eight = per_token(), per_token("--micro-batch", "8")
    assert "@N=1024, b=1:" in one["pe=fire"][0] and "@N=1024, b=8:" in eight["pe=fire"][0]
    assert eight["pe=fire"][1] < one["pe=fire"][1]
    assert "@N=1024:" in one["pe=rope"][0] and one["pe=rope"] == eight["pe=rope"]
    with pytest.raises(SystemExit) as exc:
        main(["info", "tiny", "--micro-batch", "0"])
    assert exc.value.code == 2
    assert "--micro-batch: expected a positive number of sequences, got '0'" in (
        capsys.readouterr().err)


def test_tape_model_info_takes_a_yaml_file_without_yaml_in_its_name(tmp_path, monkeypatch,
                                                                    capsys):
    """An existing file named without `.yaml` was looked up as a shipped name only: `model
    config 'mymodel' not found` about a file that is right there. Now it is read (a shipped
    name still comes first); what is not a model config says why, naming the file."""
    from tape_train.model.cli import main
    from tape_train.resources import resource_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").write_text((resource_dir("configs/model") / "tiny.yaml").read_text())
    for given in ("mymodel", "./mymodel", str(tmp_path / "mymodel")):
        assert main(["info", given, "--pe", "rope"]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("mymodel pe=rope   params      7.26M")
    # A shipped name wins over a file of that name here (the meaning it always had).
    (tmp_path / "tiny").write_text("vocab_size: 8\n")
    assert main(["info", "tiny", "--pe", "rope"]) == 0
    assert "tiny pe=rope   params      7.26M" in capsys.readouterr().out
    (tmp_path / "notes").write_text("just some text\n")
    assert main(["info", "notes"]) == 1
    assert capsys.readouterr().err == ("tape-model: error: notes: expected a mapping of keys, "
                                       "got str\n")
    (tmp_path / "adir").mkdir()
    assert main(["info", "adir"]) == 1
    assert "model config 'adir' is a directory, not a YAML file" in capsys.readouterr().err
    assert main(["info", "/dev/null"]) == 1  # it said "not found"
    assert "model config '/dev/null' is not a regular file" in capsys.readouterr().err
    assert main(["info", ""]) == 1
    assert "model config '' is empty" in capsys.readouterr().err


def test_tape_model_info_names_the_file_and_encoding_a_shape_error_is_about(tmp_path,
                                                                          monkeypatch, capsys):
    """A model YAML the config refuses (GQA with TAPE, a hidden size no head count divides)
    said what was wrong but not in which file, nor that the encoding was the default one."""
    from tape_train.model.cli import main

    monkeypatch.chdir(tmp_path)
    shape = "vocab_size: 97\nhidden_size: 64\nnum_layers: 2\nintermediate_size: 96\n"
    (tmp_path / "gqa.yaml").write_text(shape + "num_heads: 4\nnum_kv_heads: 2\n")
    assert main(["info", "gqa.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tape-model: error: gqa.yaml with pe=tape: model.num_kv_heads=2 (GQA)")
    assert err.endswith("(pe=tape is one of the defaults: name the encodings to compare with "
                        "--pe)\n")
    assert main(["info", "gqa.yaml", "--pe", "rope", "fire"]) == 0  # control: encodings with GQA
    assert "gqa pe=fire" in capsys.readouterr().out
    (tmp_path / "odd.yaml").write_text(shape + "num_heads: 3\n")
    assert main(["info", "odd.yaml", "--pe", "rope"]) == 1
    assert capsys.readouterr().err == ("tape-model: error: odd.yaml with pe=rope: "
                                       "model.hidden_size (64) must be divisible by "
                                       "model.num_heads (3)\n")


def test_tape_model_info_names_the_closest_size_and_lists_them_all(tmp_path, monkeypatch,
                                                                    capsys):
    from tape_train.model.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["info", "tiy"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tape-model: error: model config 'tiy' not found (did you mean "
                          "'tiny'?): looked for ")
    assert "tiy.yaml and the file tiy; named model configs: 125m, 1b, 350m, 7b, tiny\n" in err
    assert main(["info", "nosuch.yaml"]) == 1  # a path: no named config looked for
    assert capsys.readouterr().err == ("tape-model: error: model config 'nosuch.yaml' not found: "
                                       "looked for nosuch.yaml; named model configs: 125m, 1b, "
                                       "350m, 7b, tiny\n")


def test_a_missing_demo_corpus_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as exc:
        resolve_local_shards(SourceConfig(path="data/demo", key="data.sources[0]"))
    msg = str(exc.value)
    assert msg.startswith("data.sources[0].path: no such file or directory 'data/demo' "
                          f"(relative to the working directory {tmp_path})")
    assert "`tape-data prepare --demo --out data/demo`" in msg
    # another relative path: where it was looked for, no demo recipe
    with pytest.raises(DataError) as exc:
        resolve_local_shards(SourceConfig(path="corpus", key="data.sources[1]"))
    assert str(exc.value).endswith(f"'corpus' (relative to the working directory {tmp_path})")
    # an absolute path says it all
    with pytest.raises(DataError) as exc:
        resolve_local_shards(SourceConfig(path=str(tmp_path / "x"), key="data.sources[0]"))
    assert str(exc.value) == f"data.sources[0].path: no such file or directory '{tmp_path / 'x'}'"


def test_tape_eval_refuses_a_missing_checkpoint_before_start_up(tmp_path, monkeypatch, capsys):
    from tape_train.eval import cli
    from tape_train.eval.config import EvalConfig

    def start_up(*_):
        raise AssertionError("start-up ran before the checkpoint was checked")

    monkeypatch.setattr(cli, "_init_distributed", start_up)
    missing = tmp_path / "runs" / "demo"
    assert cli.main(["--checkpoint", str(missing), "--no-progress"]) == 1
    assert capsys.readouterr().err == (f"tape-eval: error: checkpoint path {missing} "
                                       f"does not exist\n")
    # positive control: inputs that resolve and read get past the checks to the start-up
    monkeypatch.setattr("tape_train.loading.resolve_checkpoint", lambda p: Path(p))
    monkeypatch.setattr(cli, "_read_checkpoints", lambda *_: (EvalConfig(), []))
    monkeypatch.setattr(cli, "_held_out", lambda *_: ([], "no documents"))
    with pytest.raises(AssertionError, match="start-up ran"):
        cli.main(["--checkpoint", str(missing), "--no-progress"])


@pytest.mark.parametrize("module, argv, example", [
    ("tape_train.train.cli", [], "e.g. tape-train --config demo"),
    ("tape_train.eval.cli", [], "e.g. tape-eval --checkpoint runs/demo"),
    ("tape_train.inference.export", [], "e.g. tape-export runs/demo --out exports/demo"),
    ("tape_train.inference.generate", ["exports/demo"], "e.g. tape-generate exports/demo --prompt"),
    ("tape_train.cluster.submit", [], "e.g. tape-submit --config configs/train/demo.yaml"),
    ("tape_train.data.cli", [], "e.g. tape-data prepare --demo --out data/demo"),
    ("tape_train.data.cli", ["info"], "e.g. tape-data info data/demo"),
    ("tape_train.data.tokenizer_cli", ["train", "--input", "x"], "e.g. tape-tokenizer train"),
])
def test_a_missing_argument_shows_a_command_that_works(module, argv, example, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: the following arguments are required" in err
    assert f"\n  {example}" in err and "--help lists every option" in err
    # the example itself parses (where the parser can be built without running the command)
    mod = importlib.import_module(module)
    line = err.split("e.g. ", 1)[1].split("\n")[0].split("   (")[0]
    if hasattr(mod, "build_parser"):
        import shlex

        mod.build_parser().parse_args(shlex.split(line)[1:])


def test_other_usage_errors_keep_argparse_s_message(capsys):
    from tape_train.train.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", "demo", "--world-size", "two"])
    err = capsys.readouterr().err
    assert "argument --world-size: invalid int value: 'two'" in err and "e.g." not in err


@pytest.mark.parametrize("module, argv", [
    ("tape_train.train.cli", ["--config", "{missing}.yaml", "--dry-run"]),
    ("tape_train.eval.cli", ["--checkpoint", "{missing}", "--no-progress"]),
    ("tape_train.inference.export", ["{missing}", "--out", "{tmp}/out"]),
    ("tape_train.inference.generate", ["{missing}", "--prompt", "x"]),
    ("tape_train.model.cli", ["info", "{missing}.yaml"]),
    ("tape_train.cluster.submit", ["--config", "{missing}.yaml", "--dry-run"]),
    ("tape_train.data.cli", ["info", "{missing}"]),
    ("tape_train.data.tokenizer_cli", ["train", "--input", "{missing}", "--spec", "demo",
                                       "--out", "{tmp}/tok"]),
])
def test_every_command_exits_1_for_a_missing_input_and_2_for_a_bad_option(module, argv,
                                                                           tmp_path, capsys):
    """One rule (tape_train/cli.py): 2 is argparse's, for a command line it cannot parse; a
    path that does not exist is an error of its own, exit 1, as every other. tape-eval said 1
    and tape-export, tape-generate, tape-model and tape-submit said 2 for the same missing
    path."""
    import importlib

    main = importlib.import_module(module).main
    missing = tmp_path / "no-such"
    assert main([a.format(missing=missing, tmp=tmp_path) for a in argv]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert " error: " in line and str(missing) in line, line
    with pytest.raises(SystemExit) as exc:  # the other half of the rule
        main([*argv[:1], "--no-such-option"])
    assert exc.value.code == 2


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], "--top-p must be in (0, 1] (1 = off), got 0.0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--top-k", "-2"], "--top-k must be >= 0 (0 = off), got -2"),
    (["--seed", str(2**64)], f"--seed must be in [0, 4294967295] (2**32 - 1), got {2**64}"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295] (2**32 - 1), got -1"),
    (["--tokenizer", "nope.model"], "tokenizer nope.model: no such file"),
])
def test_tape_generate_refuses_bad_options_before_loading(flags, message, tmp_path, capsys):
    from tape_train.inference.generate import main

    # the model path does not exist either: the options are checked first, in one line
    assert main([str(tmp_path / "nowhere"), "--prompt", "x", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tape-generate: error: {message}") and err.count("\n") == 1


def test_sampling_settings_that_cannot_sample_are_refused():
    import torch

    from tape_train.model.generate import check_sampling, sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0]])
    # what top_p=0 did before: every token dropped, multinomial over NaNs
    with pytest.raises(RuntimeError):
        sample_next(logits, 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling(4, 1.0, None, 0.0)
    check_sampling(4, 0.0, 0, 1.0)  # greedy, no limits: fine


@pytest.mark.parametrize("handled", [True, False])
def test_a_closed_stdout_ends_a_command_without_a_traceback(handled):
    import os
    import subprocess
    import sys

    # `tape-model info ... | head -1`: the reader is gone before the second line is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    entry = ("from tape_train.cli import model_main as main" if handled else
             "from tape_train.model.cli import main")   # negative control: no handler
    code = (f"import sys; sys.argv = ['tape-model', 'info', 'tiny', '--seq-len', '64', '128']; "
            f"{entry}; sys.exit(main())")
    try:
        proc = subprocess.run([sys.executable, "-c", code], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    if handled:
        assert (proc.returncode, proc.stderr) == (141, "")
    else:
        assert proc.returncode != 0 and "BrokenPipeError" in proc.stderr


def test_ctrl_c_in_a_command_without_its_own_handler_is_one_line(monkeypatch, capsys):
    import importlib
    import types

    from tape_train import cli

    def interrupted():
        raise KeyboardInterrupt

    real = importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: types.SimpleNamespace(main=interrupted)
                        if name == "tape_train.inference.export" else real(name))
    monkeypatch.setattr("sys.argv", ["tape-export", "runs/demo", "--out", "exports/demo"])
    with pytest.raises(SystemExit) as stopped:
        cli.export_main()
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "tape-export: interrupted (Ctrl-C)\n"
    # Negative control: the command's own main lets it through (the traceback Python prints).
    with pytest.raises(KeyboardInterrupt):
        cli.importlib.import_module("tape_train.inference.export").main()


@pytest.mark.parametrize("local_rank", [None, "0", "1", "x"])
def test_a_config_error_is_said_once_per_node_not_once_per_rank(monkeypatch, capsys,
                                                                local_rank):
    """Under torchrun every rank loads the config and meets the same error: only LOCAL_RANK 0
    (or a lone process, or one whose LOCAL_RANK is malformed) prints it, like the preflight's
    problems; every rank exits 1."""
    from tape_train.train import cli

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert cli.main(["--config", "demo", "parallel.tp=3"]) == 1
    err = capsys.readouterr().err
    if local_rank == "1":
        assert err == ""
    else:
        assert err.count("tape-train: config error: ") == 1
        assert "is not divisible by parallel.tp × parallel.sp = 3 × 1 = 3" in err
