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
    assert main(["info", "huge"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tape-model: error: model config 'huge' not found")
    assert "named model configs: 125m" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["info", "tiny", "--seq-len", "0"])
    assert exc.value.code == 2
    assert "--seq-len: expected a positive number of tokens, got '0'" in capsys.readouterr().err


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

    def start_up(*_):
        raise AssertionError("start-up ran before the checkpoint was checked")

    monkeypatch.setattr(cli, "_init_distributed", start_up)
    missing = tmp_path / "runs" / "demo"
    assert cli.main(["--checkpoint", str(missing), "--no-progress"]) == 1
    assert capsys.readouterr().err == (f"tape-eval: error: checkpoint path {missing} "
                                       f"does not exist\n")
    # positive control: a checkpoint that resolves gets past the check to the start-up
    monkeypatch.setattr("tape_train.loading.resolve_checkpoint", lambda p: Path(p))
    with pytest.raises(AssertionError, match="start-up ran"):
        cli.main(["--checkpoint", str(missing), "--no-progress"])
