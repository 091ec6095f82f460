"""Bad input through the real entry points: one clear line naming the culprit, an exit code,
no traceback, and nothing of the user's lost. Each case has a positive control."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_eval_reports_cli import make_checkpoint
from tape_train.config import ConfigError, load_run_config
from tape_train.data.testing import train_small_tokenizer


def _base_yaml(tmp_path, extra=""):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\ntrain:\n  seq_len: 16\n" + extra)
    return path


def test_config_file_with_a_repeated_section_or_binary_bytes_is_refused(tmp_path):
    path = _base_yaml(tmp_path, "train:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"run.yaml:4: not valid YAML: key 'train' given twice "
                                          r"\(first on line 2\)$"):
        load_run_config(path)
    path.write_text("model: tiny\ntrain: {seq_len: 16\n")  # the mark names the file, not "<unicode string>"
    with pytest.raises(ConfigError, match=r"run.yaml:3: not valid YAML: .* \(column 1, while "
                                          r"parsing a flow mapping from line 2, column 8\)") as err:
        load_run_config(path)
    assert "<unicode string>" not in str(err.value) and "\n" not in str(err.value)
    path.write_bytes(b"\xffmodel: tiny\n")
    with pytest.raises(ConfigError, match=r"run.yaml: not a UTF-8 text file \(byte 0"):
        load_run_config(path)
    assert load_run_config(_base_yaml(tmp_path)).train.seq_len == 16


@pytest.mark.parametrize("text, message", [
    ("model: tiny\ntrain:\n\tseq_len: 16\n",
     "run.yaml:3: not valid YAML: found character '\\t' that cannot start any token (column 1); "
     "YAML indents with spaces, not tabs"),
    ("model: tiny\ntrain:\n  seq_len: 16\n  seq_len: 32\n",
     "run.yaml:4: not valid YAML: key 'seq_len' given twice (first on line 3)"),
    ("model: tiny\ntrain:\n  seq_len: 16\n lr: 0.1\n",
     "run.yaml:4: not valid YAML: expected <block end>, but found '<block mapping start>' "
     "(column 2, while parsing a block mapping from line 1, column 1); indent this line like "
     "the keys beside it, or under the key it belongs to"),
    ("model: tiny\ntrain:\n  run_dir: runs: x\n",
     "run.yaml:3: not valid YAML: mapping values are not allowed here (column 16); quote a "
     "value that holds ': ', or start a nested mapping on its own line"),
    ("model: tiny\ntrain:\n  run_dir: \"runs/x\n",
     "run.yaml:4: not valid YAML: found unexpected end of stream (column 1, while scanning a "
     "quoted scalar from line 3, column 12); close the quote"),
    # The quote is closed: a backslash in double quotes began an escape (it said "close the
    # quote").
    ("model: tiny\ntrain:\n  run_dir: \"runs\\data\"\n",
     "run.yaml:3: not valid YAML: found unknown escape character 'd' (column 18, while scanning "
     "a double-quoted scalar from column 12); a backslash inside double quotes starts an "
     "escape: double it, or use single quotes"),
    ("model: tiny\ntrain:\n  run_dir: a\x01b\n",
     "run.yaml:3: not valid YAML: unacceptable character #x0001: special characters are not "
     "allowed (column 13)"),
])
def test_invalid_yaml_is_one_line_naming_the_file_line_and_column(tmp_path, capsys, text,
                                                                  message):
    """PyYAML's message is several lines with a copy of the line and a caret (and names the
    text "<unicode string>"); tape-train says it in one line, file:line first, with a hint for
    the usual causes. Control: the same file without the mistake loads."""
    from tape_train.train.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value) == f"{path.parent}/{message}"
    assert main(["--config", str(path), "--dry-run"]) == 1
    err_lines = capsys.readouterr().err.splitlines()
    assert err_lines == [f"tape-train: config error: {path.parent}/{message}"], err_lines
    path.write_text("model: tiny\ntrain:\n  seq_len: 16\n")
    assert load_run_config(path).train.seq_len == 16


def test_yaml_merge_keys_work_with_the_repeated_key_check(tmp_path):
    """`<<: *anchor` (YAML's merge key) failed with "could not determine a constructor for the
    tag 'tag:yaml.org,2002:merge'" once the loader refused repeated keys; a key given after the
    merge overrides it, a key given twice is still refused."""
    path = tmp_path / "run.yaml"
    text = ("model: tiny\ntrain: {seq_len: 16}\n"
            "optim:\n  <<: {eps: 1.0e-6, weight_decay: 0.5}\n  weight_decay: 0.25\n")
    path.write_text(text)
    cfg = load_run_config(path)
    assert (cfg.optim.eps, cfg.optim.weight_decay) == (1e-6, 0.25)
    path.write_text(text + "  weight_decay: 0.125\n")  # control: twice besides the merge
    with pytest.raises(ConfigError, match=r"key 'weight_decay' given twice \(first on line 5\)"):
        load_run_config(path)


@pytest.mark.parametrize("override, message", [
    ("model.attn_backend=triton", "model.attn_backend=triton needs a CUDA device"),
    ("model.attn_backend=flash", "model.attn_backend=flash does not support pe=tape"),
])
def test_dry_run_refuses_a_backend_that_cannot_run_without_a_traceback(tmp_path, capsys,
                                                                        override, message):
    from tape_train.train.cli import main

    path = _base_yaml(tmp_path, f"  run_dir: {tmp_path / 'run'}\n  device: cpu\n"
                                "  synthetic_data: true\n")
    assert main(["--config", str(path), "--dry-run", override]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    # Planned for GPU nodes, the fused kernel is fine (the memory trace runs on meta).
    assert main(["--config", str(path), "--dry-run", "model.attn_backend=triton",
                 "--nodes", "1", "--gpus-per-node", "8"]) == 0
    assert main(["--config", str(path), "--dry-run", "--nodes", "0", "--gpus-per-node",
                 "8"]) == 1
    assert "--nodes must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("model.tie_embeddings='no'", "model.tie_embeddings: expected bool, got 'no'"),
    ("model.norm_eps=true", "model.norm_eps: expected a finite number, got True"),
    ("model.rope_theta=[1]", "model.rope_theta: expected a finite number, got [1]"),
    ("train.startup_timeout_s=1e10", "train.startup_timeout_s must be > 0 and at most "
                                     "31536000 seconds"),
])
def test_dry_run_names_a_mistyped_field_or_a_timeout_beyond_a_year(tmp_path, capsys, override,
                                                                   message):
    """A quoted "no" tied the embeddings (a truthy string), `true` was an epsilon of 1; a
    timeout of 1e10 s overflowed the watchdog's timer at start-up (a traceback)."""
    from tape_train.train.cli import main

    path = _base_yaml(tmp_path, f"  run_dir: {tmp_path / 'run'}\n  device: cpu\n"
                                "  synthetic_data: true\n")
    assert main(["--config", str(path), "--dry-run", override]) == 1
    err = capsys.readouterr().err
    assert f"override '{override}': {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    (["--device-memory-gb", "nan"], "--device-memory-gb must be a finite number > 0, got nan"),
    (["--device-memory-gb", "inf"], "--device-memory-gb must be a finite number > 0, got inf"),
    (["--device-memory-gb", "0"], "--device-memory-gb must be a finite number > 0, got 0.0"),
    (["--nodes", "3", "--gpus-per-node", "2", "--world-size", "7"],
     "--world-size 7 is more ranks than --nodes 3 x --gpus-per-node 2 = 6 GPUs"),
    (["--nodes", "3", "--gpus-per-node", "2", "--world-size", "4"],
     "--world-size 4 ranks do not split evenly over --nodes 3"),
])
def test_dry_run_refuses_planning_flags_it_cannot_plan_for(tmp_path, capsys, flags, message):
    """A NaN or infinite --device-memory-gb ended the dry run with a traceback, zero or a
    negative amount planned against nonsense; a --world-size beyond the GPUs of --nodes x
    --gpus-per-node, or not a whole number of ranks per node, was planned as it came."""
    from tape_train.train.cli import main

    path = _base_yaml(tmp_path, f"  run_dir: {tmp_path / 'run'}\n  device: cpu\n"
                                "  synthetic_data: true\n")
    assert main(["--config", str(path), "--dry-run", *flags]) == 1
    err = capsys.readouterr().err
    assert err == f"tape-train: {message}\n"
    # positive controls: memory given, and fewer ranks than GPUs (4 of each 8-GPU node)
    assert main(["--config", str(path), "--dry-run", "--device-memory-gb", "80", "--nodes", "2",
                 "--gpus-per-node", "8", "--world-size", "8"]) == 0
    assert "rank grid: world=8 " in capsys.readouterr().out


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not: this process was not started by "
                          "torchrun and cannot be 2 ranks alone; launch them with "
                          "`launch/local.sh 2 ...` (torchrun), or unset WORLD_SIZE"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='' in the environment is not an integer >= 1"),
    ({"RANK": "x"}, "RANK='x' in the environment is not an integer >= 0"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not below WORLD_SIZE=2"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' in the environment is not an integer >= 0"),
])
def test_torchrun_variables_that_cannot_be_are_named_before_start_up(tmp_path, capsys,
                                                                      monkeypatch, env, message):
    """A WORLD_SIZE left in the shell (the dry run plans for it) made a plain `tape-train`
    expect ranks that never started (a RankGrid traceback after DeepSpeed's import); a
    mistyped RANK or LOCAL_RANK was int()'s traceback. tape-eval and tape-generate read the
    same variables."""
    from tape_train.eval.cli import main as eval_main
    from tape_train.inference.generate import main as generate_main
    from tape_train.train import loop
    from tape_train.train.cli import main

    class Started(Exception):
        pass

    def trainer(*_args, stop=None, **_kw):
        stop.close()  # give the test process its signal handlers back
        raise Started

    monkeypatch.setattr(loop, "Trainer", trainer)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    path = _base_yaml(tmp_path, f"  run_dir: {tmp_path / 'run'}\n  device: cpu\n"
                                "  synthetic_data: true\n")
    with pytest.raises(Started):  # positive control: a lone process starts
        main(["--config", str(path)])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tape-train: error: {message}") and err.count("\n") == 1
    assert eval_main(["--checkpoint", str(tmp_path / "nowhere"), "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith(f"tape-eval: error: {message}")
    if list(env) == ["LOCAL_RANK"]:  # all tape-generate reads
        assert generate_main([str(tmp_path / "nowhere"), "--prompt", "x"]) == 1
        assert capsys.readouterr().err.startswith(f"tape-generate: error: {message}")


def test_local_launcher_refuses_a_tmpdir_it_cannot_write_the_exit_code_into(tmp_path):
    """launch/local.sh keeps the trainer's exit code (75: stopped for a requeue) in a file
    under TMPDIR; a TMPDIR that does not exist lost it (`line 63: : No such file or directory`,
    the 75 became 1 under torchrun) after the whole run."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "launch" / "local.sh"
    python = tmp_path / "python"  # stands in for the trainer: stopped for a requeue
    python.write_text('#!/bin/bash\necho 75 > "$TAPE_TRAIN_EXIT_FILE"; exit 1\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "TMPDIR": str(tmp_path / "missing")}
    proc = subprocess.run(["bash", str(script), "1", "--config", "x.yaml"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot create a file in {tmp_path / 'missing'} (TMPDIR)" in proc.stderr
    env["TMPDIR"] = str(tmp_path)  # control: the trainer's 75 comes through
    proc = subprocess.run(["bash", str(script), "1", "--config", "x.yaml"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr


def test_local_launcher_without_a_venv_says_how_to_make_one(tmp_path):
    """launch/local.sh in a checkout without .venv falls back to python3; one that cannot import
    tape_train and torch ended in a ModuleNotFoundError traceback, now in one line saying
    `make install`. A python3 that has them (an activated venv) still runs the trainer."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    checkout = tmp_path / "checkout"  # a copy of the launcher: no .venv beside it
    (checkout / "launch").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "launch" / "local.sh",
                checkout / "launch" / "local.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    script = ["bash", str(checkout / "launch" / "local.sh"), "1", "--config", "x.yaml"]
    python3.write_text("#!/bin/bash\nexit 1\n")  # imports nothing
    python3.chmod(0o755)
    proc = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert (f"no virtualenv at {checkout}/.venv, and python3 cannot import tape_train and "
            f"torch: run 'make install' in {checkout}") in proc.stderr
    python3.write_text('#!/bin/bash\n[[ "$1" == -c ]] && exit 0\n'  # control: it has them
                       'echo 75 > "$TAPE_TRAIN_EXIT_FILE"; exit 1\n')
    proc = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr


def test_exponent_floats_are_numbers_in_the_model_and_data_sections(tmp_path, capsys):
    """YAML 1.1 reads `1e-6` as a string: accepted for float fields in every section (it was a
    TypeError traceback in the dry-run's memory trace for model.norm_eps, and a refusal of
    `got '1e-3'` for a source weight)."""
    from tape_train.train.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  base: tiny\n  norm_eps: 1e-6\n  rope_theta: 5e4\n"
                    f"data:\n  sources:\n    - path: a\n      weight: 1e-3\n    - path: b\n"
                    f"  eval_fraction: 1e-2\ntrain:\n  seq_len: 16\n  run_dir: {tmp_path / 'r'}"
                    f"\n  device: cpu\n  synthetic_data: true\n  startup_timeout_s: 1e4\n")
    cfg = load_run_config(path)
    assert (cfg.model.norm_eps, cfg.model.rope_theta) == (1e-6, 5e4)
    assert (cfg.data.sources[0].weight, cfg.data.eval_fraction) == (1e-3, 1e-2)
    assert main(["--config", str(path), "--dry-run"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_run_trained_with_the_fused_kernel_evaluates_on_cpu(tmp_path, capsys):
    """attn_backend=triton was the training machine's choice: tape-eval on a CPU picks its
    own backend instead of failing at the first forward."""
    from tape_train.eval.cli import main

    make_checkpoint(tmp_path / "run", "tape", seed=1, attn_backend="triton", num_layers=2)
    assert main(["--checkpoint", str(tmp_path / "run"), "--lengths", "8", "--max-tokens",
                 "16", "--dtype", "fp32", "--out", str(tmp_path / "eval"),
                 "--no-progress"]) == 0
    assert (tmp_path / "eval" / "eval.json").is_file()


@pytest.fixture(scope="module")
def run_and_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_checkpoint(root / "run", "tape", seed=1, vocab_size=512)
    small = train_small_tokenizer(root / "tok512", vocab_size=512, max_bytes=200_000)
    large = train_small_tokenizer(root / "tok600", vocab_size=600, max_bytes=200_000)
    return root, small.path, large.path


def test_export_keeps_a_directory_that_is_not_an_export(run_and_tokenizers, tmp_path, capsys):
    from tape_train.inference.export import main

    run, tok, _ = run_and_tokenizers
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main([str(run / "run"), "--out", str(out), "--tokenizer", tok]) == 1
    assert "is a non-empty directory that is not an export" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    assert main([str(run / "run"), "--out", str(tmp_path / "file"), "--hf"]) == 1
    assert "exists and is not a directory" in capsys.readouterr().err
    # An earlier export is replaced.
    assert main([str(run / "run"), "--out", str(tmp_path / "exp"), "--tokenizer", tok]) == 0
    assert main([str(run / "run"), "--out", str(tmp_path / "exp"), "--tokenizer", tok]) == 0


@pytest.mark.parametrize("out, cwd, message", [
    ("", "here", "'' is the current directory or holds it"),
    (".", "here", ". is the current directory or holds it"),
    ("..", "here/sub", ".. is the current directory or holds it"),
    ("here/sub/..", ".", "here/sub/..: name the directory itself"),
])
def test_export_refuses_the_current_directory_before_loading(run_and_tokenizers, tmp_path,
                                                             monkeypatch, capsys, out, cwd,
                                                             message):
    """`--out .` (or an empty --out) in an empty directory got through the checks, loaded the
    checkpoint, then failed to rename the current directory: `error: .: Device or resource
    busy`. It is refused first, in words; the directory is left as it was."""
    from tape_train.inference import export

    run, tok, _ = run_and_tokenizers
    (tmp_path / "here" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / cwd)
    monkeypatch.setattr("tape_train.loading.load_model_from_checkpoint",
                        lambda *_: pytest.fail("the checkpoint was loaded"))
    assert export.main([str(run / "run"), "--out", out, "--tokenizer", tok]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tape-export: error: {message}") and err.count("\n") == 1
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["sub"]
    assert not any((tmp_path / "here" / "sub").iterdir())
    monkeypatch.undo()
    # control: a new directory below the current one is written
    monkeypatch.chdir(tmp_path / "here")
    assert export.main([str(run / "run"), "--out", "exp", "--tokenizer", tok]) == 0
    assert (tmp_path / "here" / "exp" / "export.json").is_file()


def test_export_refuses_a_missing_or_too_large_tokenizer(run_and_tokenizers, tmp_path, capsys):
    from tape_train.inference.export import main

    run, _, large = run_and_tokenizers
    assert main([str(run / "run"), "--out", str(tmp_path / "a"), "--tokenizer",
                 str(tmp_path / "nope.model")]) == 1
    assert "--tokenizer: tokenizer" in capsys.readouterr().err
    assert main([str(run / "run"), "--out", str(tmp_path / "b"), "--tokenizer", large]) == 1
    assert "has 600 tokens but the model's vocabulary is 512" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_of_a_tokenizer_without_hugging_face_files(run_and_tokenizers, tmp_path,
                                                          monkeypatch, capsys, caplog):
    """A sentencepiece model the Hugging Face tokenizer files cannot reproduce (here
    remove_extra_whitespaces, as sentencepiece's default nmt_nfkc models have) made the plain
    export fail too, after the checkpoint was consolidated. The plain export now carries the
    tokenizer.model alone (a warning says so); --hf refuses it before reading the checkpoint."""
    from sentencepiece import sentencepiece_model_pb2

    from tape_train import loading
    from tape_train.inference.export import main

    run, tok, _ = run_and_tokenizers
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tok).read_bytes())
    proto.normalizer_spec.remove_extra_whitespaces = True
    odd = tmp_path / "odd.model"
    odd.write_bytes(proto.SerializeToString())
    with monkeypatch.context() as m:
        m.setattr(loading, "load_model_from_checkpoint",
                  lambda *a, **k: pytest.fail("checkpoint read before the tokenizer check"))
        assert main([str(run / "run"), "--out", str(tmp_path / "hf"), "--hf", "--tokenizer",
                     str(odd)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tape-export: error: --tokenizer: tokenizer {odd}: "
                          "remove_extra_whitespaces=true is not supported") and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()
    assert main([str(run / "run"), "--out", str(tmp_path / "plain"), "--tokenizer",
                 str(odd)]) == 0
    assert "without the Hugging Face tokenizer files" in caplog.text
    assert (tmp_path / "plain" / "tokenizer.model").read_bytes() == odd.read_bytes()
    assert not (tmp_path / "plain" / "tokenizer.json").exists()
    # The run's own tokenizer is checked too (after the checkpoint names it).
    make_checkpoint(tmp_path / "run2", "tape", seed=1, vocab_size=512,
                    data={"tokenizer": str(odd)})
    assert main([str(tmp_path / "run2"), "--out", str(tmp_path / "hf2"), "--hf"]) == 1
    assert "export without --hf, or bundle another" in capsys.readouterr().err
    # Negative control: the tokenizer it came from gets the files, with and without --hf.
    for flag in ([], ["--hf"]):
        out = tmp_path / f"good{len(flag)}"
        assert main([str(run / "run"), "--out", str(out), "--tokenizer", tok, *flag]) == 0
        assert (out / "tokenizer.json").is_file()


def test_export_checks_where_it_writes_before_reading_the_checkpoint(run_and_tokenizers,
                                                                    tmp_path, capsys,
                                                                    monkeypatch):
    """An --out under a regular file, or in a directory this process cannot write in, is
    refused before the (possibly long) consolidation, naming the path; it used to fail after
    it with "File exists" or with the errno of a scratch directory."""
    import errno
    import tempfile

    from tape_train import loading
    from tape_train.inference.export import main

    run, tok, _ = run_and_tokenizers
    (tmp_path / "afile").write_text("x")
    real_load, real_tmp = loading.load_model_from_checkpoint, tempfile.NamedTemporaryFile
    loads = []
    monkeypatch.setattr(loading, "load_model_from_checkpoint",
                        lambda *a, **k: loads.append(a) or real_load(*a, **k))
    assert main([str(run / "run"), "--out", str(tmp_path / "afile" / "sub" / "x")]) == 1
    err = capsys.readouterr().err
    assert (f"tape-export: error: {tmp_path / 'afile'} is a file, so --out "
            f"{tmp_path / 'afile' / 'sub' / 'x'} cannot be created under it") in err
    readonly = tmp_path / "readonly"
    readonly.mkdir()

    def unwritable(*args, dir=None, **kwargs):  # root ignores permissions: a read-only mount
        if dir is not None and Path(dir) == readonly:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_tmp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", unwritable)
    assert main([str(run / "run"), "--out", str(readonly / "new" / "x")]) == 1
    err = capsys.readouterr().err
    assert (f"tape-export: error: cannot write in {readonly}, where --out {readonly / 'new' / 'x'}"
            f" goes: Read-only file system") in err
    assert loads == [] and "Traceback" not in err
    assert list(readonly.iterdir()) == []
    # Negative control: a writable place is exported to.
    assert main([str(run / "run"), "--out", str(tmp_path / "ok" / "x"), "--tokenizer", tok]) == 0
    assert len(loads) == 1 and (tmp_path / "ok" / "x" / "model.safetensors").is_file()


def test_export_past_a_file_size_limit_is_one_line_and_leaves_nothing(run_and_tokenizers,
                                                                     tmp_path, capsys):
    """A write that fails inside safetensors (a full disk, a file-size limit: its errors are
    strings) is named like any OSError, with the limit, instead of a SafetensorError
    traceback; the scratch directory is removed."""
    import resource

    from tape_train.inference.export import main

    run, tok, _ = run_and_tokenizers
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))  # Python ignores SIGXFSZ: EFBIG
    try:
        rc = main([str(run / "run"), "--out", str(tmp_path / "x"), "--tokenizer", tok])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    line = next(ln for ln in err.splitlines() if ln.startswith("tape-export: error: "))
    assert f"{tmp_path / 'x'}" in line and "model.safetensors): File too large" in line
    assert "file-size limit, `ulimit -f`, is 48.8 KiB" in line
    assert list(tmp_path.iterdir()) == []
    # Negative control: without the limit the same export is written.
    assert main([str(run / "run"), "--out", str(tmp_path / "x"), "--tokenizer", tok]) == 0


def test_export_names_a_model_config_it_cannot_build_in_one_line(tmp_path, capsys):
    """A checkpoint whose recorded model config this code cannot build (a key of another
    version): one line naming the marker and the key, exit 1, no traceback."""
    import json

    from tape_train.inference.export import main
    from tape_train.train import checkpoint as ckpt

    make_checkpoint(tmp_path / "run", "tape", seed=1)
    tag = ckpt.find_latest_complete(tmp_path / "run")
    assert main([str(tag), "--out", str(tmp_path / "good")]) == 0  # negative control
    marker = ckpt.read_marker(tag)
    marker["config"]["model"]["new_knob"] = 3
    (tag / ckpt.MARKER).write_text(json.dumps(marker))
    capsys.readouterr()
    assert main([str(tag), "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert f"tape-export: error: {tag / ckpt.MARKER} [model]: unknown model key(s) 'new_knob'" in err
    assert "Traceback" not in err and not (tmp_path / "bad").exists()


def test_weights_that_do_not_fit_the_recorded_model_config_are_one_line(tmp_path, capsys):
    """A marker whose model config is not the one its weights were trained with (another
    model's config, a value of the wrong type): tape-export, tape-eval and tape-generate name
    the marker (by the path given, not a private mirror of it) and the first parameters of
    another shape, in one line, exit 1; no export is written. An export whose config.json
    was swapped is refused the same way. Control: the untouched checkpoint exports."""
    import json

    from tape_train.eval.cli import main as evaluate
    from tape_train.inference.export import main as export
    from tape_train.inference.generate import main as generate
    from tape_train.train import checkpoint as ckpt

    make_checkpoint(tmp_path / "run", "tape", seed=1)
    tag = ckpt.find_latest_complete(tmp_path / "run")
    assert export([str(tag), "--out", str(tmp_path / "good")]) == 0  # negative control
    good = json.loads((tag / ckpt.MARKER).read_text())
    marker = json.loads(json.dumps(good))
    marker["config"]["model"]["hidden_size"] = 64  # weights of hidden size 32
    (tag / ckpt.MARKER).write_text(json.dumps(marker))
    shapes = (f"checkpoint {tag}: its weights do not match the model config of its "
              f"COMPLETE.json: ")
    for run in (lambda: export([str(tag), "--out", str(tmp_path / "bad")]),
                lambda: evaluate(["--checkpoint", str(tag), "--lengths", "4", "--max-tokens",
                                  "8", "--out", str(tmp_path / "eval"), "--no-progress"]),
                lambda: generate([str(tag), "--prompt", "a", "--max-new-tokens", "1"])):
        capsys.readouterr()
        assert run() == 1
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
        assert shapes in line and "of another shape (embed.weight [50, 32] where the config " \
            "makes [50, 64]" in line, line
    assert not (tmp_path / "bad").exists() and not (tmp_path / "eval" / "eval.json").exists()
    marker["config"]["model"]["hidden_size"] = "abc"
    (tag / ckpt.MARKER).write_text(json.dumps(marker))
    assert export([str(tag), "--out", str(tmp_path / "bad")]) == 1
    assert (f"tape-export: error: {tag / ckpt.MARKER} [model]: model.hidden_size: expected "
            f"int, got 'abc'") in capsys.readouterr().err
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    (tmp_path / "good" / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    capsys.readouterr()
    assert generate([str(tmp_path / "good"), "--prompt", "a", "--max-new-tokens", "1"]) == 1
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
    assert (f"model.safetensors: weights do not match {tmp_path / 'good' / 'config.json'}: 12 "
            f"of another shape (embed.weight [50, 32] where the config makes [50, 64]") in line


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
])
def test_generate_refuses_bad_sampling_settings(run_and_tokenizers, capsys, args, message):
    from tape_train.inference.generate import main

    run, tok, _ = run_and_tokenizers
    assert main([str(run / "run"), "--prompt", "x", "--tokenizer", tok, *args]) == 1
    assert message in capsys.readouterr().err


def test_generate_names_a_bad_tokenizer(run_and_tokenizers, tmp_path, capsys):
    from tape_train.inference.generate import main

    run, tok, large = run_and_tokenizers
    assert main([str(run / "run"), "--prompt", "x", "--tokenizer", str(tmp_path / "no")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main([str(run / "run"), "--prompt", "x", "--tokenizer", large]) == 1
    assert "has 600 tokens but the model's vocabulary is 512" in capsys.readouterr().err
    assert main([str(run / "run"), "--prompt", "x", "--tokenizer", tok, "--max-new-tokens",
                 "2", "--top-p", "1", "--top-k", "0"]) == 0


def test_generate_samples_only_the_tokenizers_pieces(run_and_tokenizers, tmp_path, capsys):
    """A model whose vocabulary is larger than its tokenizer's (the dry run only warns) sampled
    ids no piece has: an IndexError traceback from sentencepiece's decode."""
    from tape_train.inference.generate import main

    run, _, _ = run_and_tokenizers
    smaller = train_small_tokenizer(tmp_path / "tok400", vocab_size=400, max_bytes=200_000)
    assert main([str(run / "run"), "--prompt", "The", "--tokenizer", smaller.path,
                 "--max-new-tokens", "40", "--temperature", "2", "--top-p", "1",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The") and len(out) > len("The\n")


def test_generate_device_is_checked_before_loading_and_cpu_is_the_auto_choice_here(
        run_and_tokenizers, capsys, monkeypatch):
    import torch

    import tape_train.inference.loading as loading
    from tape_train.inference.generate import main

    run, tok, _ = run_and_tokenizers
    loads = []
    real_load = loading.load_for_inference
    monkeypatch.setattr(loading, "load_for_inference",
                        lambda *a, **k: loads.append(a) or real_load(*a, **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([str(run / "run"), "--prompt", "x", "--tokenizer", tok, "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device here" in err and "Traceback" not in err
    assert loads == []  # refused before the model was read
    greedy = ["--prompt", "The", "--tokenizer", tok, "--max-new-tokens", "6",
              "--temperature", "0"]
    texts = []
    for device in ("auto", "cpu"):
        assert main([str(run / "run"), *greedy, "--device", device]) == 0
        texts.append(capsys.readouterr().out)
    assert len(loads) == 2
    assert texts[0] == texts[1] and len(texts[0]) > len("The\n")


def test_tape_eval_checks_out_and_device_before_evaluating(run_and_tokenizers, tmp_path,
                                                           capsys, monkeypatch):
    import torch

    import tape_train.loading as loading
    from tape_train.eval.cli import main

    run, _, _ = run_and_tokenizers
    (tmp_path / "file").write_text("x")
    assert main(["--checkpoint", str(run / "run"), "--out", str(tmp_path / "file" / "o")]) == 1
    assert "exists and is not a directory" in capsys.readouterr().err
    resolved = []
    real_resolve = loading.resolve_checkpoint
    monkeypatch.setattr(loading, "resolve_checkpoint",
                        lambda *a, **k: resolved.append(a) or real_resolve(*a, **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--checkpoint", str(run / "run"), "--device", "cuda",
                 "--out", str(tmp_path / "o")]) == 1
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err
    assert resolved == []  # refused before the checkpoint's checksums are read (minutes)


def test_tape_submit_checks_eval_lengths_before_submitting(tmp_path, capsys):
    from tape_train.cluster.submit import main

    path = _base_yaml(tmp_path)
    assert main(["--config", str(path), "--dry-run", "--eval-after", "--eval-lengths", "0"]) == 1
    assert ("--eval-lengths/--eval-arg: tape-eval --lengths 0: --lengths (value 1) must be a "
            "positive integer") in capsys.readouterr().err
    assert main(["--config", str(path), "--dry-run", "--no-preflight", "--eval-after",
                 "--eval-lengths", "16", "32"]) == 0


def test_tape_submit_refuses_an_empty_log_dir(tmp_path, capsys):
    """An empty --log-dir (an unset shell variable) put the batch scripts and Slurm's logs
    into the working directory. Control: a named one passes."""
    from tape_train.cluster.submit import main

    path = _base_yaml(tmp_path)
    assert main(["--config", str(path), "--dry-run", "--no-preflight", "--log-dir", ""]) == 1
    err = capsys.readouterr().err
    assert "tape-submit: error: --log-dir '' is empty (an unset shell variable?)" in err
    assert main(["--config", str(path), "--dry-run", "--no-preflight", "--log-dir",
                 str(tmp_path / "logs")]) == 0


@pytest.mark.parametrize("name", ["train.jsonl", "corpus.jsonl.gz", "part-0.parquet"])
def test_a_corpus_file_given_as_the_data_config_is_named_as_such(tmp_path, capsys, name):
    """`tape-eval --data train.jsonl` said "not valid YAML" at the first record's brace (or
    read a text line as a string): the corpus is named as one, with where it belongs. A JSON
    or YAML config file is still a config (the positive control)."""
    from tape_train.data import DataError, load_data_config
    from tape_train.eval.cli import main as eval_main

    corpus = tmp_path / name
    corpus.write_text('{"text": "a document"}\n')
    with pytest.raises(DataError, match=rf"data config '{corpus}': a \.\S+ file is a corpus, "
                                        rf"not a data config \(YAML\); name it in a data "
                                        rf"config's sources"):
        load_data_config(str(corpus))
    assert eval_main(["--checkpoint", str(tmp_path), "--data", str(corpus), "--no-progress"]) == 1
    assert "is a corpus, not a data config" in capsys.readouterr().err
    config = tmp_path / "data.json"
    config.write_text('{"sources": [{"path": "%s"}], "tokenizer": "t.model"}' % corpus)
    assert load_data_config(str(config)).sources[0].path == str(corpus)


@pytest.mark.parametrize("label", ["", "  ", "a|b", "two\nlines"])
def test_tape_eval_refuses_a_label_that_cannot_name_a_row(tmp_path, capsys, label):
    """A blank --label (an unset shell variable) made a nameless row and legend entry; one
    with '|' broke the Markdown table. Refused before any checkpoint is read; a plain one is
    not (the checkpoint that does not exist is the next error: the positive control)."""
    from tape_train.eval.cli import main as eval_main

    missing = str(tmp_path / "nowhere")
    assert eval_main(["--checkpoint", missing, "--label", label, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tape-eval: error: --label {label!r}: a name must be one line"), err
    assert eval_main(["--checkpoint", missing, "--label", "TAPE 1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "--label" not in err and "nowhere" in err, err


@pytest.mark.parametrize("args, message", [
    (["--eval-after", "--eval-arg=--max-tokens=-5"],
     "tape-eval --max-tokens=-5: --max-tokens must be a positive integer or 'all'"),
    (["--eval-after", "--eval-arg=--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["--eval-after", "--eval-arg=--device=tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--eval-after", "--eval-lengths", "16", "--eval-arg=--stride=16"],
     "--stride=16 must be smaller than every evaluation length"),
    (["--eval-after", "--eval-time", "0"], "--eval-time '0' is zero"),
    (["--eval-arg=--max-tokens=64", "--eval-time", "10"],
     "--eval-time, --eval-arg: only used by the evaluation job of --eval-after, which is not "
     "given"),
])
def test_tape_submit_checks_the_evaluation_job_before_submitting(tmp_path, capsys, args,
                                                                 message):
    """tape-eval's arguments are checked with tape-eval's own parser and settings: they failed
    only when the evaluation job started, after the training job; without --eval-after they
    were dropped without a word."""
    from tape_train.cluster.submit import main

    path = _base_yaml(tmp_path)
    assert main(["--config", str(path), "--dry-run", *args]) == 1
    err = capsys.readouterr().err
    assert f"tape-submit: error: " in err and message in err
    assert main(["--config", str(path), "--dry-run", "--no-preflight", "--eval-after",
                 "--eval-time", "10", "--eval-arg=--max-tokens=64",
                 "--eval-arg=--device=cpu"]) == 0
    assert "--max-tokens=64 --device=cpu" in capsys.readouterr().out


def test_tape_submit_checks_the_evaluation_against_the_run_s_eval_section(tmp_path, capsys):
    """tape-eval takes the settings not given from the run's eval: section: a --stride its
    protocols leave unused, or its stride not below a --lengths, was accepted here and refused
    by the evaluation job after the training."""
    from tape_train.cluster.submit import main

    path = _base_yaml(tmp_path, "eval:\n  protocols: [nonoverlap]\n  sliding_stride: 8\n")
    base = ["--config", str(path), "--dry-run", "--no-preflight", "--eval-after"]
    assert main([*base, "--eval-arg=--stride=4"]) == 1
    assert ("tape-eval --stride=4: --stride is only used by --protocols sliding, which is not "
            "asked for (the run's eval: section: eval.protocols nonoverlap)"
            in capsys.readouterr().err)
    assert main([*base, "--eval-lengths", "8", "--eval-arg=--protocols=sliding"]) == 1
    assert ("eval.sliding_stride=8 must be smaller than every evaluation length, got length 8"
            in capsys.readouterr().err)
    # control: the same with lengths the stride fits, or a stride of its own
    assert main([*base, "--eval-lengths", "16", "--eval-arg=--protocols=sliding"]) == 0
    assert main([*base, "--eval-lengths", "8", "--eval-arg=--protocols=sliding",
                 "--eval-arg=--stride=4"]) == 0


def test_prepare_and_tokenizer_onto_a_file_say_so(tmp_path, capsys):
    from tape_train.data.cli import main as data_main
    from tape_train.data.testing import real_text_documents, write_jsonl
    from tape_train.data.tokenizer_cli import main as tok_main

    write_jsonl(tmp_path / "in.jsonl", real_text_documents(max_documents=4))
    (tmp_path / "file").write_text("x")
    assert data_main(["prepare", "--input", str(tmp_path / "in.jsonl"), "--out",
                      str(tmp_path / "file")]) == 1
    assert "tape-data: error:" in capsys.readouterr().err
    assert tok_main(["train", "--input", str(tmp_path / "in.jsonl"), "--vocab-size", "300",
                     "--out", str(tmp_path / "file" / "tok")]) == 1
    assert "tape-tokenizer: error:" in capsys.readouterr().err


@pytest.mark.parametrize("command, args, message", [
    # Path("") is the current directory: the shards, or tokenizer files named ".model",
    # landed there.
    ("data", ["prepare", "--input", "{d}/in.jsonl", "--out", ""],
     "tape-data: error: --out '' is empty (an unset shell variable?): name the output "
     "directory, e.g. --out data/mine (--out . for this one)"),
    ("tokenizer", ["train", "--input", "{d}/in.jsonl", "--vocab-size", "400", "--out", " "],
     "tape-tokenizer: error: --out ' ' is empty (an unset shell variable?): name the output "
     "prefix"),
    # These were tracebacks from NumPy and sentencepiece (the thread count after the read).
    ("data", ["prepare", "--input", "{d}/in.jsonl", "--out", "{d}/out", "--seed", "-1"],
     "tape-data: error: --seed must be in [0, 4294967295] (2**32 - 1), got -1"),
    ("tokenizer", ["train", "--input", "{d}/in.jsonl", "--vocab-size", "400", "--out",
                   "{d}/tok", "--seed", "-5"],
     "tape-tokenizer: error: tokenizer seed must be in [0, 4294967295] (2**32 - 1), got -5"),
    ("tokenizer", ["train", "--input", "{d}/in.jsonl", "--vocab-size", "400", "--out",
                   "{d}/tok", "--num-threads", "2000"],
     "tape-tokenizer: error: tokenizer num_threads must be an integer from 0 (all cores) to "
     "1024 (sentencepiece's limit), got 2000"),
    ("tokenizer", ["info", "{tok}", "--text", "ab\udcffc"],
     "tape-tokenizer: error: --text is not valid UTF-8 text (byte 0xff at character 2); pass "
     "UTF-8"),
])
def test_data_and_tokenizer_options_that_cannot_be_are_one_line(run_and_tokenizers, tmp_path,
                                                                 capsys, monkeypatch, command,
                                                                 args, message):
    """Each is refused in one line, exit 1, before anything is read or written: the working
    directory stays empty. Control: the same commands with a named --out and good values."""
    from tape_train.data.cli import main as data_main
    from tape_train.data.testing import real_text_documents, write_jsonl
    from tape_train.data.tokenizer_cli import main as tok_main

    _, tok, _ = run_and_tokenizers
    write_jsonl(tmp_path / "in.jsonl", real_text_documents(max_documents=200))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    main = data_main if command == "data" else tok_main
    argv = [a.format(d=tmp_path, tok=tok) for a in args]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert list(work.iterdir()) == [] and not (tmp_path / "out").exists()
    good = {"-1": "7", "-5": "7", "2000": "1", "ab\udcffc": "abc", "": "out", " ": "tok"}
    assert main([good.get(a, a) for a in argv]) == 0


def test_generate_streams_characters_spelled_in_byte_pieces(run_and_tokenizers, capsys,
                                                            monkeypatch):
    """A continuation with a character the tokenizer spells as byte-fallback pieces printed
    U+FFFD for its first byte; the decode then never started with what was printed, so
    nothing more was printed: 'a 世界 b' came out as 'a ��'."""
    import torch

    import tape_train.model.generate as model_generate
    from tape_train.data import load_tokenizer
    from tape_train.inference.generate import main

    run, tok, _ = run_and_tokenizers
    tokenizer = load_tokenizer(tok)
    for text in ("a 世界 b ä", "a 世"):
        ids = tokenizer.encode(text)
        if text == "a 世":
            ids = ids[:-1]  # ends inside the character: its bytes still come out at the end
        assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # byte pieces, or no test
        expected = tokenizer.decode(tokenizer.encode("P") + ids)[1:]  # " a 世界 b ä"

        def fake_generate(model, input_ids, max_new_tokens, *, on_token, **kwargs):
            for i in ids:
                on_token(torch.tensor([i]))
            return input_ids

        monkeypatch.setattr(model_generate, "generate", fake_generate)
        assert main([str(run / "run"), "--prompt", "P", "--tokenizer", tok,
                     "--device", "cpu"]) == 0
        assert capsys.readouterr().out == f"P{expected}\n"
        assert expected.startswith(" a ")


def test_generate_keeps_the_space_that_starts_the_continuation(run_and_tokenizers, tmp_path,
                                                              capsys, monkeypatch):
    """"Hello" continued by the pieces of " world" (``▁w or ld``) printed "Helloworld" and
    wrote the completion "world": the continuation was decoded as a text of its own, whose
    first "▁" is the dummy prefix sentencepiece drops."""
    import json

    import torch

    import tape_train.model.generate as model_generate
    from tape_train.data import load_tokenizer
    from tape_train.inference.generate import main

    run, tok, _ = run_and_tokenizers
    tokenizer = load_tokenizer(tok)
    prompt, whole = "Hello", "Hello world  and\n more"
    new = tokenizer.encode(whole)[len(tokenizer.encode(prompt)):]
    assert tokenizer.encode(whole)[:len(tokenizer.encode(prompt))] == tokenizer.encode(prompt)
    assert tokenizer.id_to_piece(new[0]).startswith("▁")  # or no test

    def fake_generate(model, input_ids, max_new_tokens, *, on_token=None, **kwargs):
        for i in new:
            if on_token is not None:
                on_token(torch.tensor([i]))
        return torch.cat([input_ids, torch.tensor([new])], dim=1)

    monkeypatch.setattr(model_generate, "generate", fake_generate)
    assert main([str(run / "run"), "--prompt", prompt, "--tokenizer", tok,
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == whole + "\n"
    inp = _write_prompts(tmp_path / "in.jsonl", [{"prompt": prompt}, {"prompt": ""}])
    assert main([*_sampling(run_and_tokenizers, "--max-new-tokens", str(len(new))),
                 "--prompts", str(inp), "--out", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["prompt"] + rows[0]["completion"] == whole
    assert rows[1]["completion"] == tokenizer.decode(new) == whole[len(prompt) + 1:]


def test_generate_names_a_prompt_that_is_not_utf8_and_an_hf_export(run_and_tokenizers,
                                                                    tmp_path, capsys):
    """A prompt with bytes of another encoding (argv decodes them to surrogates) was
    sentencepiece's RuntimeError traceback; a `tape-export --hf` directory was refused with a
    list of a dozen 'unknown model key(s)' from its config.json."""
    from tape_train.inference.export import main as export_main
    from tape_train.inference.generate import main

    run, tok, _ = run_and_tokenizers
    base = [str(run / "run"), "--tokenizer", tok, "--max-new-tokens", "1", "--device", "cpu"]
    assert main([*base, "--prompt", "ab\udcff"]) == 1
    err = capsys.readouterr().err
    assert "--prompt is not valid UTF-8 text (byte 0xff at character 2)" in err
    assert "Traceback" not in err
    assert main([*base, "--prompt", "abé"]) == 0  # control: UTF-8 text
    capsys.readouterr()
    assert export_main([str(run / "run"), "--out", str(tmp_path / "hf"), "--hf",
                        "--tokenizer", tok]) == 0
    assert export_main([str(run / "run"), "--out", str(tmp_path / "plain"),
                        "--tokenizer", tok]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "hf"), "--prompt", "x", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "a Hugging Face export (`tape-export --hf`)" in err and "unknown model key" not in err
    assert main([str(tmp_path / "plain"), "--prompt", "x", "--max-new-tokens", "1"]) == 0


# ----------------------------------------------------------------------------------------------
# tape-generate --prompt-file / --prompts
# ----------------------------------------------------------------------------------------------

def _sampling(run_and_tokenizers, *more):
    run, tok, _ = run_and_tokenizers
    return [str(run / "run"), "--tokenizer", tok, "--device", "cpu", "--max-new-tokens", "6",
            "--temperature", "1", "--top-p", "1", *more]


def _write_prompts(path, records, blank_after_first=False):
    import json

    lines = [json.dumps(record) for record in records]
    if blank_after_first:
        lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_generate_prompt_file_and_stdin_continue_as_the_same_prompt(run_and_tokenizers,
                                                                    tmp_path, capsys,
                                                                    monkeypatch):
    """--prompt-file PATH (and - for standard input) is --prompt with the file's text: the
    same stream, byte for byte; the whole file is the prompt, a final newline included."""
    import io

    from tape_train.inference.generate import main

    base = _sampling(run_and_tokenizers, "--seed", "7")
    text = "The cat\nsat on é世"
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode("utf-8"))
    assert main([*base, "--prompt", text]) == 0
    expected = capsys.readouterr().out
    assert expected.startswith(text) and len(expected) > len(text) + 1
    assert main([*base, "--prompt-file", str(path)]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8"))))
    assert main([*base, "--prompt-file", "-"]) == 0
    assert capsys.readouterr().out == expected
    path.write_bytes((text + "\n").encode("utf-8"))  # control: the final newline is the prompt's
    assert main([*base, "--prompt-file", str(path)]) == 0
    assert capsys.readouterr().out.startswith(text + "\n")


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: one of --prompt, --prompt-file, --prompts"),
    (["--prompt", "x", "--prompt-file", "p.txt"],
     "argument --prompt-file: not allowed with argument --prompt"),
    (["--prompt-file", "p.txt", "--prompts", "p.jsonl", "--out", "o.jsonl"],
     "argument --prompts: not allowed with argument --prompt-file"),
    (["--prompts", "p.jsonl"], "--prompts needs --out PATH.jsonl (or --out - for standard output)"),
    (["--prompt", "x", "--out", "o.jsonl"], "--out is for --prompts"),
    (["--prompt-file", "p.txt", "--num-samples", "2"], "--num-samples is for --prompts"),
])
def test_generate_takes_exactly_one_kind_of_prompt(args, message, tmp_path, capsys):
    from tape_train.inference.generate import main

    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "nowhere"), *args])
    assert exc.value.code == 2
    assert f"tape-generate: error: {message}" in capsys.readouterr().err


def _json_error(line: str) -> str:
    """What the running Python's json module says of ``line`` (its wording changes between
    versions: 3.13 says `Illegal trailing comma before end of object` where 3.11 says
    `Expecting property name enclosed in double quotes`), as tape-generate words it."""
    import json

    try:
        json.loads(line)
    except json.JSONDecodeError as exc:
        return f"{exc.msg} at column {exc.colno}"
    raise AssertionError(f"{line!r} is valid JSON")


@pytest.mark.parametrize("flag, content, extra, message", [
    ("--prompt-file", None, [], "--prompt-file {path}: cannot read: No such file or directory"),
    ("--prompt-file", "dir", [], "--prompt-file {path}: cannot read: Is a directory"),
    ("--prompt-file", b"", [], "--prompt-file {path}: empty (the prompt is the whole file)"),
    ("--prompt-file", b"ok\nline two \xff\xfe\n", [],
     "{path}:2: not valid UTF-8 (byte offset 12 of the file: b'\\xff\\xfe\\n')"),
    ("--prompts", None, ["--out", "{tmp}/o.jsonl"],
     "--prompts {path}: cannot read: No such file or directory"),
    ("--prompts", b"\n \n", ["--out", "{tmp}/o.jsonl"], "--prompts {path}: no prompts in it"),
    ("--prompts", b'{"prompt": "a"}\n\n{"prompt": "b\xff"}\n', ["--out", "{tmp}/o.jsonl"],
     "{path}:3: not valid UTF-8 (byte offset 13 of the line: b'\\xff\"}')"),
    ("--prompts", b'{"prompt": "a"}\n{"prompt": "b",}\n', ["--out", "{tmp}/o.jsonl"],
     "{path}:2: not valid JSON (" + _json_error('{"prompt": "b",}') + ")"),
    ("--prompts", b'["a"]\n', ["--out", "{tmp}/o.jsonl"],
     '{path}:1: a JSON array, not an object with a "prompt" string'),
    ("--prompts", b'{"prompts": "a", "id": 3}\n', ["--out", "{tmp}/o.jsonl"],
     "{path}:1: no \"prompt\" key (the object has 'prompts', 'id') (did you mean 'prompts'?)"),
    ("--prompts", b'{"prompt": 5}\n', ["--out", "{tmp}/o.jsonl"],
     '{path}:1: "prompt" is a JSON number, not a string'),
    ("--prompts", b'{"prompt": "a\\ud800"}\n', ["--out", "{tmp}/o.jsonl"],
     "{path}:1: \"prompt\" holds a lone surrogate ('\\ud800') at character 1, which is not text"),
    ("--prompts", b'{"prompt": "a", "id": 1, "id": 2}\n', ["--out", "{tmp}/o.jsonl"],
     "{path}:1: key 'id' given twice"),
    ("--prompts", b'{"prompt": "a", "completion": "old"}\n', ["--out", "{tmp}/o.jsonl"],
     "{path}:1: key 'completion' is one tape-generate writes"),
    ("--prompts", b'{"prompt": "a"}\n', ["--out", "{path}"],
     "--out {path}: is the --prompts file; write the completions to another file"),
    ("--prompts", b'{"prompt": "a"}\n', ["--out", "{tmp}"], "--out {tmp}: is a directory"),
    ("--prompts", b'{"prompt": "a"}\n', ["--out", "/dev/null"],
     "--out /dev/null: is not a regular file (a device or a pipe?)"),
    ("--prompts", b'{"prompt": "a"}\n', ["--out", "{path}/o.jsonl"],
     "--out {path}/o.jsonl: {path} exists and is not a directory"),
    ("--prompts", b'{"prompt": "a"}\n', ["--out", "{tmp}/o.jsonl", "--num-samples", "0"],
     "--num-samples must be >= 1, got 0"),
])
def test_generate_names_a_bad_prompt_file_and_line_before_loading(flag, content, extra,
                                                                   message, tmp_path, capsys):
    """Each mistake is one line naming the file (and the line, and the byte where it
    applies); the model path does not exist either: nothing was loaded."""
    from tape_train.inference.generate import main

    path = tmp_path / "prompts"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    def named(text):
        return text.replace("{path}", str(path)).replace("{tmp}", str(tmp_path))

    extra = [named(arg) for arg in extra]
    assert main([str(tmp_path / "nowhere"), flag, str(path), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tape-generate: error: " + named(message))
    assert err.count("\n") == 1 and not (tmp_path / "o.jsonl").exists()


def test_generate_prompt_files_starting_with_a_byte_order_mark_are_read_without_it(tmp_path):
    """Windows editors start a file with a UTF-8 byte-order mark: --prompts refused such a
    file at line 1 (`not valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) ...)`), and
    --prompt-file continued a prompt starting with U+FEFF. The mark starting a later line is no
    encoding mark, and is still refused there."""
    import codecs

    from tape_train.inference.prompts import PromptError, read_prompt_file, read_prompts

    bom = codecs.BOM_UTF8
    (tmp_path / "p.jsonl").write_bytes(bom + b'{"id": 1, "prompt": "The"}\n{"prompt": "A"}\n')
    assert [p.text for p in read_prompts(str(tmp_path / "p.jsonl"))] == ["The", "A"]
    (tmp_path / "p.txt").write_bytes(bom + b"The end\n")
    assert read_prompt_file(str(tmp_path / "p.txt")) == "The end\n"
    (tmp_path / "joined.jsonl").write_bytes(b'{"prompt": "a"}\n' + bom + b'{"prompt": "b"}\n')
    with pytest.raises(PromptError, match=r"joined\.jsonl:2: not valid JSON"):
        read_prompts(str(tmp_path / "joined.jsonl"))


def test_generate_names_an_empty_standard_input(tmp_path, capsys, monkeypatch):
    import io

    from tape_train.inference.generate import main

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert main([str(tmp_path / "nowhere"), "--prompt-file", "-"]) == 1
    assert capsys.readouterr().err == ("tape-generate: error: --prompt-file -: standard input "
                                       "is empty (nothing was piped in)\n")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"prompt": 1}\n')))
    assert main([str(tmp_path / "nowhere"), "--prompts", "-", "--out", "-"]) == 1
    assert capsys.readouterr().err.startswith("tape-generate: error: <stdin>:1: \"prompt\" is")


def test_generate_prompts_writes_a_line_per_prompt_reproducibly_whatever_the_others(
        run_and_tokenizers, tmp_path, capsys):
    """--prompts: a JSON line per prompt, in order, with the input's keys; the same seed gives
    the same file; a prompt's completion does not depend on the other prompts (seeded from
    the seed and its text); a progress line per prompt on stderr, without carriage returns."""
    import json
    import re

    from tape_train.inference.generate import main

    base = _sampling(run_and_tokenizers)
    records = [{"id": 1, "prompt": "The cat"}, {"id": "b", "prompt": "Hello", "meta": {"n": [1]}},
               {"prompt": "é世 sat"}]
    inp = _write_prompts(tmp_path / "in.jsonl", records, blank_after_first=True)
    out = tmp_path / "out.jsonl"
    assert main([*base, "--prompts", str(inp), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3
    for given, row in zip(records, rows):
        assert {key: row[key] for key in given} == given
        assert set(row) == set(given) | {"completion", "new_tokens", "finish"}
        assert row["finish"] in ("eos", "length") and 0 <= row["new_tokens"] <= 6
        assert row["finish"] == "eos" or row["new_tokens"] == 6
    progress = [line for line in err.splitlines() if re.match(r"tape-generate: \d/3 ", line)]
    assert len(progress) == 3 and f" {inp}:3: " in progress[1] and "\r" not in err
    assert f"wrote 3 completions of 3 prompts to {out}" in err
    first = out.read_bytes()
    assert main([*base, "--prompts", str(inp), "--out", str(out)]) == 0
    assert out.read_bytes() == first  # the same seed, the same file
    # Two of the prompts, the other way round, to standard output: the same two lines.
    fewer = _write_prompts(tmp_path / "fewer.jsonl", [records[2], records[0]])
    assert main([*base, "--prompts", str(fewer), "--out", "-"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == \
        [rows[2], rows[0]]
    # control: another seed samples other text
    assert main([*base, "--prompts", str(inp), "--out", "-", "--seed", "1"]) == 0
    other = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["completion"] for row in other] != [row["completion"] for row in rows]


def test_generate_prompts_decodes_as_the_stream_and_samples_k_times(run_and_tokenizers,
                                                                    tmp_path, capsys):
    """A greedy completion is the continuation --prompt streams; --num-samples K writes K
    lines per prompt numbered by "sample", the first the one of a single sample."""
    import json

    from tape_train.inference.generate import main

    base = _sampling(run_and_tokenizers)
    inp = _write_prompts(tmp_path / "in.jsonl", [{"prompt": "The cat"}, {"prompt": "x = 1"}])
    assert main([*base, "--prompts", str(inp), "--out", "-", "--temperature", "0"]) == 0
    greedy = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for row in greedy:
        assert main([*base, "--prompt", row["prompt"], "--temperature", "0"]) == 0
        assert capsys.readouterr().out == row["prompt"] + row["completion"] + "\n"
    assert main([*base, "--prompts", str(inp), "--out", "-"]) == 0
    single = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*base, "--prompts", str(inp), "--out", "-", "--num-samples", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["prompt"], row["sample"]) for row in rows] == \
        [(p, k) for p in ("The cat", "x = 1") for k in range(3)]
    assert [{**rows[0], "sample": None}, {**rows[3], "sample": None}] == \
        [{**row, "sample": None} for row in single]
    assert len({row["completion"] for row in rows[:3]}) > 1  # the samples differ


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_generate_prompts_that_fail_half_way_leave_no_out(run_and_tokenizers, tmp_path, capsys,
                                                          monkeypatch, fault):
    """An error or Ctrl-C after the first prompt leaves --out as it was (absent, or an
    earlier complete file), and no temporary file; control: the run completes."""
    import tape_train.model.generate as model_generate
    from tape_train.inference.generate import main

    base = _sampling(run_and_tokenizers)
    inp = _write_prompts(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"},
                                                 {"prompt": "c"}])
    real, calls = model_generate.generate, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise fault("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(model_generate, "generate", failing)
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    old.write_text("from an earlier run\n")
    for out in (new, old):
        calls.clear()
        if fault is KeyboardInterrupt:
            assert main([*base, "--prompts", str(inp), "--out", str(out)]) == 130
            assert (f"interrupted after 1/3 completions; {out} not written"
                    in capsys.readouterr().err)
        else:
            with pytest.raises(RuntimeError, match="stopped"):
                main([*base, "--prompts", str(inp), "--out", str(out)])
    assert not new.exists() and old.read_text() == "from an earlier run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "old.jsonl"]
    monkeypatch.setattr(model_generate, "generate", real)
    assert main([*base, "--prompts", str(inp), "--out", str(new)]) == 0
    assert len(new.read_text().splitlines()) == 3


def test_generate_prompts_killed_half_way_leaves_only_a_hidden_temporary_file(
        run_and_tokenizers, tmp_path):
    """SIGKILL after the first completion: --out does not exist; what was written is in a
    hidden `.out.jsonl.*.tmp` that no one takes for the output."""
    import os
    import signal
    import subprocess
    import sys

    base = _sampling(run_and_tokenizers)
    inp = _write_prompts(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out.jsonl"
    script = ("import os, signal, sys\n"
              "import tape_train.model.generate as g\n"
              "from tape_train.inference.generate import main\n"
              "real, calls = g.generate, []\n"
              "def dying(*a, **k):\n"
              "    calls.append(1)\n"
              "    if len(calls) == 2:\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return real(*a, **k)\n"
              "g.generate = dying\n"
              "sys.exit(main(sys.argv[1:]))\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo),
                                                                    os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script, *base, "--prompts", str(inp),
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "1/2 " in proc.stderr  # the first completion was written before the kill
    assert not out.exists()
    left = [p for p in tmp_path.iterdir() if p.name != "in.jsonl"]
    assert len(left) == 1 and left[0].name.startswith(".out.jsonl.")
    assert left[0].name.endswith(".tmp") and len(left[0].read_text().splitlines()) == 1


def test_generate_prompts_reports_an_eos_finish(run_and_tokenizers, tmp_path, capsys,
                                                monkeypatch):
    """A completion that ends with the end-of-sequence token says "finish": "eos" and counts
    its tokens without it; one cut at --max-new-tokens says "length"."""
    import json

    import torch

    import tape_train.model.generate as model_generate
    from tape_train.data import load_tokenizer
    from tape_train.inference.generate import main

    _, tok, _ = run_and_tokenizers
    tokenizer = load_tokenizer(tok)
    words = tokenizer.encode("hello world")

    def fake_generate(model, input_ids, max_new_tokens, *, eos_id, **kwargs):
        new = words + [eos_id] if max_new_tokens > len(words) else words[:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new])], dim=1)

    monkeypatch.setattr(model_generate, "generate", fake_generate)
    inp = _write_prompts(tmp_path / "in.jsonl", [{"prompt": "a"}])
    rows = []
    for budget in (len(words) + 5, len(words) - 1):
        args = _sampling(run_and_tokenizers, "--max-new-tokens", str(budget))
        assert main([*args, "--prompts", str(inp), "--out", "-"]) == 0
        rows.append(json.loads(capsys.readouterr().out))
    assert rows[0] == {"prompt": "a", "completion": " hello world", "new_tokens": len(words),
                       "finish": "eos"}
    assert rows[1]["finish"] == "length" and rows[1]["new_tokens"] == len(words) - 1
