"""`tape-train --dry-run` and the same checks at the start of a real run and in tape-submit.

Every bad input of the issue is provoked for real (an empty file, garbage bytes, a record
without the text field, a missing tokenizer, a tokenizer larger than the model's vocabulary, a
missing data path, train.seq_len beyond model.max_seq_len, held-out documents shorter than an
evaluation length, a run dir under a regular file, an impossible layout, a resume that changes
the global batch) and must give exit code 1 and one line naming the key, file or value. The
good config passing is the negative control. A stand-in ``deepspeed`` package that fails on
import proves that neither the dry run nor a refused real run reaches DeepSpeed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tape_train.cluster import submit
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl
from tape_train.train import cli

ROOT = Path(__file__).resolve().parents[1]
NO_DEEPSPEED = "deepspeed must not be imported here"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text (jsonl), a 800-token tokenizer, bad files, and a `deepspeed` that fails."""
    d = tmp_path_factory.mktemp("preflight")
    write_jsonl(d / "good.jsonl", real_text_documents(120))
    tok = train_small_tokenizer(d / "tok")
    (d / "empty.jsonl").write_bytes(b"")
    (d / "garbage.jsonl").write_bytes(b'{"text": "fine"}\n\xff\xfe\x00garbage\x81\n')
    (d / "nofield.jsonl").write_text(json.dumps({"body": "no text field here"}) + "\n")
    (d / "afile").write_text("not a directory")
    fake = d / "fake_site" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError({NO_DEEPSPEED!r})\n")
    config = d / "run.yaml"
    config.write_text(f"""\
model: {{base: tiny, vocab_size: 800}}
data:
  sources: [{d / 'good.jsonl'}]
  tokenizer: {tok.path}
  eval_fraction: 0.2
train: {{run_dir: {d / 'run'}, seq_len: 64, micro_batch_size: 2, max_steps: 4, dtype: fp32,
        device: cpu}}
parallel: {{zero_stage: 1}}
eval: {{interval: 2, lengths: [32, 64], protocols: [nonoverlap], max_tokens: 2048}}
logging: {{tensorboard: false, progress_bar: false, peak_tflops: 1.0}}
""")
    return d


def dry_run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(args)
    return rc, out.getvalue(), err.getvalue()


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ": preflight: error: " in ln]


def test_good_config_passes_and_prints_the_plan(corpus):
    rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run"])
    assert rc == 0, err
    assert not error_lines(err)
    for part in ("# resolved config", "rank grid: world=1 dp=1 sp=1 tp=1",
                 "tokenizer: ", "800 tokens", "data.sources[0]: ", "document(s) read and tokenised",
                 "held-out documents with at least L predictions", "L=32: ", "L=64: ",
                 "writable", "checkpoints of ~", "resume: no complete checkpoint",
                 "memory per rank", "AdamW moments", "activations", "TAPE positional state",
                 "total per rank", "GFLOP per token", "s per step", "preflight: ok"):
        assert part in out, part


BAD_INPUTS = {
    "empty file": (["data.sources=[{d}/empty.jsonl]"], "data.sources[0]: no usable documents in "
                   "{d}/empty.jsonl"),
    "garbage bytes": (["data.sources=[{d}/garbage.jsonl]"], "{d}/garbage.jsonl:2: invalid UTF-8"),
    "missing field": (["data.sources=[{d}/nofield.jsonl]"],
                      "{d}/nofield.jsonl:1: missing text field: record has no field 'text'"),
    "missing tokenizer": (["data.tokenizer={d}/none.model"],
                          "data.tokenizer: tokenizer {d}/none.model: no such file"),
    "vocab mismatch": (["model.vocab_size=400"], "has 800 tokens but model.vocab_size is 400"),
    "missing data path": (["data.sources=[{d}/missing.jsonl]"],
                          "data.sources[0].path: no such file or directory '{d}/missing.jsonl'"),
    "seq_len > max_seq_len": (["train.seq_len=100000"],
                              "train.seq_len=100000 exceeds model.max_seq_len=256"),
    "short held-out documents": (["eval.lengths=[64,100000]"],
                                 "eval.lengths: no held-out document is longer than L=100000"),
    "unwritable run dir": (["train.run_dir={d}/afile/run"],
                           "train.run_dir={d}/afile/run: not writable"),
    "Hub source in token format": (["data.sources=[{{hub: some/corpus}}]", "data.format=tokens"],
                                   "data.sources[0]: data.format=tokens needs prepared "
                                   "directories (from `tape-data prepare --tokenize`), got hub "
                                   "'some/corpus'"),
    "block windows beyond RAM": (["data.block_shuffle_window=1000000000000"],
                                 "data.block_shuffle_window=1000000000000: two windows of "
                                 "1000000000000 blocks of 65 tokens hold 242143.87 GiB per rank"),
    "bad layout": (["parallel.tp=2", "--world-size", "3"],
                   "parallel layout: world size 3 is not divisible by parallel.sp × parallel.tp"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_each_bad_input_is_one_line_and_exit_1(corpus, name):
    overrides, expected = BAD_INPUTS[name]
    args = [a.format(d=corpus) for a in overrides]
    rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run", *args])
    assert rc == 1
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert expected.format(d=corpus) in lines[0]
    assert "Traceback" not in err
    assert "nothing was started" in err


@pytest.mark.parametrize("run_dir", ["{d}/afile/run", "{d}/afile"])
def test_a_run_dir_that_cannot_be_a_directory_is_not_also_an_unreadable_lock(corpus, run_dir):
    """A run dir under a regular file, or a regular file itself: the one error says so; it
    was also warned about as a run directory with an unreadable lock (reading RUN.lock inside
    it failed). Control: a real unreadable lock is still warned about."""
    rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run",
                            f"train.run_dir={run_dir.format(d=corpus)}"])
    assert rc == 1 and len(error_lines(err)) == 1, err
    assert "lock" not in err, err
    locked = corpus / "locked_run"
    locked.mkdir(exist_ok=True)
    (locked / "RUN.lock").write_bytes(b"\xff not json")
    rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run",
                            f"train.run_dir={locked}"])
    assert rc == 0 and f"has an unreadable lock {locked / 'RUN.lock'}" in err, err


@pytest.mark.parametrize("name, is_dir, expected", [
    ("metrics.jsonl", True, "is a directory; the run writes to it: move it away"),
    ("tensorboard", False, "is not a directory; the run writes into it: move it away"),
    ("checkpoints", False, "is not a directory; the run writes into it: move it away"),
])
def test_a_file_or_directory_of_the_wrong_kind_in_the_run_dir_is_refused(corpus, tmp_path,
                                                                         name, is_dir, expected):
    """A directory named metrics.jsonl, a file named tensorboard or checkpoints: the trainer
    met them only after DeepSpeed's start-up (a traceback then) or at the first save."""
    run = tmp_path / "run"
    run.mkdir()
    (run / name).mkdir() if is_dir else (run / name).write_text("x")
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", f"train.run_dir={run}",
            "logging.tensorboard=true"]
    rc, out, err = dry_run(args)
    assert rc == 1 and error_lines(err) == [
        f"tape-train: preflight: error: train.run_dir={run}: {run / name} {expected}"], err
    (run / name).rmdir() if is_dir else (run / name).unlink()  # control
    assert dry_run(args)[0] == 0


def test_a_file_named_like_a_checkpoint_tag_is_refused_before_training(corpus, tmp_path):
    """A regular file named step_00000002 in the checkpoints directory (a copy made by hand):
    the save of step 2 met it with "File exists" after the steps' work. Refused up front,
    naming the path; the file is left alone. Controls: one past train.max_steps (a step this
    run never saves) and a name that is no tag (step_2) are no problem."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    stray = run / "checkpoints" / "step_00000002"
    stray.write_text("x")
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", f"train.run_dir={run}",
            "train.max_steps=10"]
    rc, out, err = dry_run(args)
    assert rc == 1 and error_lines(err) == [
        f"tape-train: preflight: error: train.run_dir={run}: {stray}: a file of that name is "
        f"there, not a checkpoint directory, and the save of step 2 writes a directory there: "
        f"move it away (it is not deleted)"], err
    assert stray.read_text() == "x"
    stray.rename(run / "checkpoints" / "step_00000011")
    (run / "checkpoints" / "step_2").write_text("x")
    assert dry_run(args)[0] == 0


def test_a_stray_tag_file_below_the_checkpoint_resumed_is_no_problem(corpus, tmp_path):
    """A resume from the newest complete tag saves only the steps after it: an older tag
    archived elsewhere and left as a link, dangling where the archive is not mounted, was
    refused as if the run would save that step again. Controls: a stray above the newest
    complete tag, and any stray with --resume-from (an older tag may be resumed), are still
    refused."""
    from tape_train.config import load_run_config
    from tape_train.train import preflight

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    tag = root / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps({"step": 4, "files": {}}))
    (root / "step_00000002").symlink_to(tmp_path / "archive" / "step_00000002")  # dangling
    cfg = load_run_config(corpus / "run.yaml", [f"train.run_dir={run_dir}",
                                                "train.max_steps=10"])

    def problems(resume_from=None) -> list[str]:
        report = preflight.run_preflight(cfg, world_size=1, resume_from=resume_from,
                                         check_data=False, check_eval=False,
                                         check_resume=False, check_resume_data=False,
                                         plan=False)
        return report.problems

    assert problems() == []
    [problem] = problems(resume_from=str(tag))
    assert "step_00000002: a symbolic link of that name is there" in problem, problem
    (root / "step_00000006").write_text("x")
    [problem] = problems()
    assert "step_00000006: a file of that name is there" in problem, problem


def test_an_unwritable_checkpoints_directory_is_refused_by_the_dry_run(corpus, tmp_path,
                                                                       monkeypatch):
    """A run dir that is writable but whose checkpoints directory is not (read-only mount,
    permissions) would fail only at the first save, a checkpoint interval later: refused up
    front, naming the directory. Root ignores permissions, so the probe is made to fail as on a
    read-only mount."""
    import errno
    import tempfile

    from tape_train.train import preflight

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", f"train.run_dir={run_dir}"]
    rc, out, err = dry_run(args)
    assert rc == 0, err  # negative control
    real = tempfile.NamedTemporaryFile

    def read_only(*a, dir=None, **k):
        if dir is not None and Path(dir).name == "checkpoints":
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(preflight.tempfile, "NamedTemporaryFile", read_only)
    rc, out, err = dry_run(args)
    assert rc == 1
    assert error_lines(err) == [f"tape-train: preflight: error: train.run_dir={run_dir}: not "
                                f"writable ({run_dir / 'checkpoints'}: Read-only file system)"]



def test_a_file_size_limit_below_a_checkpoint_file_is_refused_up_front(corpus, tmp_path,
                                                                        monkeypatch):
    """`ulimit -f` smaller than a checkpoint's files failed the first save, a checkpoint
    interval after DeepSpeed's start-up: refused by the start-up checks, naming the limit.
    A plan for other machines (--gpus-per-node) does not judge them by this one's limit."""
    import resource

    args = ["--config", str(corpus / "run.yaml"), "--dry-run", f"train.run_dir={tmp_path}"]
    real = resource.getrlimit
    for limit, refused in [(8192, True), (1 << 40, False), (resource.RLIM_INFINITY, False)]:
        monkeypatch.setattr(resource, "getrlimit", lambda which, limit=limit: (
            (limit, resource.RLIM_INFINITY) if which == resource.RLIMIT_FSIZE else real(which)))
        rc, out, err = dry_run(args)
        lines = [line for line in error_lines(err) if "ulimit -f" in line]
        assert (rc, len(lines)) == ((1, 1) if refused else (0, 0)), err
        if refused:
            assert lines[0].startswith("tape-train: preflight: error: this process's file-size "
                                       "limit (`ulimit -f`) is 8.0 KiB (8192 bytes), and a "
                                       "checkpoint file of this run holds at least ~"), lines
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (8192, resource.RLIM_INFINITY) if which == resource.RLIMIT_FSIZE else real(which)))
    rc, out, err = dry_run(args + ["--nodes", "1", "--gpus-per-node", "8"])
    assert "ulimit -f" not in err


def test_the_dry_run_warns_when_another_run_holds_the_run_directory(corpus, tmp_path):
    """A run started now would be refused (RUN.lock); the dry run says so, as a warning (the
    job being planned may be queued behind that run), and is quiet once the holder is gone."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tape_train.train.run_lock import RunLock; "
         "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)",
         str(run_dir)], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", f"train.run_dir={run_dir}"]
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, out, err = dry_run(args)
        # tape-submit's own duplicate check leaves the lock to its preflight: said once.
        submit_err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(submit_err):
            submit_rc = submit.main(["--config", str(corpus / "run.yaml"), "--cpus-per-task",
                                     "1", "--dry-run", "--log-dir", str(tmp_path / "logs"),
                                     f"train.run_dir={run_dir}"])
    finally:
        holder.kill()
        holder.wait()
    assert rc == 0 and "preflight: ok" in out, err
    warned = [ln for ln in err.splitlines() if "in use by another run" in ln]
    assert len(warned) == 1 and f"pid {holder.pid}" in warned[0], err
    assert "preflight: warning: train.run_dir: run directory" in warned[0]
    submit_warned = [ln for ln in submit_err.getvalue().splitlines()
                     if "in use by another run" in ln]
    assert submit_rc == 0 and len(submit_warned) == 1, submit_err.getvalue()
    rc, out, err = dry_run(args)  # the holder is dead: its lock would be taken over
    assert rc == 0 and "in use by another run" not in err, err

def test_ranks_outnumbering_shards_is_a_warning_not_an_error(corpus):
    """One file for 4 data-parallel ranks: they share it, each reading all of it for a quarter
    (documents sharding). The dry run warns, names the fix, and still passes; with one rank
    (the control) and with global sharding there is no such warning."""
    def shared(*args) -> list[str]:
        rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run", *args])
        assert rc == 0 and "preflight: ok" in out, err
        return [ln for ln in err.splitlines()
                if ": preflight: warning: " in ln and "share one shard" in ln]

    (line,) = shared("--world-size", "4")
    for part in ("tape-train: preflight: warning: data.sources[0] (", "1 shard(s) for 4 "
                 "data-parallel ranks", "4x the bytes read", "--num-shards 4",
                 "data.format: tokens"):
        assert part in line, part
    assert shared() == []
    assert shared("--world-size", "4", "data.sharding=global") == []


def test_block_windows_are_counted_for_every_rank_on_the_node(corpus, monkeypatch):
    """Every rank holds two block windows of W x (seq_len + 1) 2-byte ids in host memory: with
    3 GiB of RAM, W = 2**22 at seq_len 64 (1.02 GiB per rank) fits one rank, not four, and
    shuffle: false (no block windows) holds none."""
    from tape_train.train import memory

    monkeypatch.setattr(memory, "device_memory", lambda *a, **k: (3 * 2**30, "RAM (test)"))

    def refused(*args) -> list[str]:
        rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run",
                                "data.block_shuffle_window=4194304", *args])
        return [ln for ln in error_lines(err) if "data.block_shuffle_window=" in ln]

    assert refused() == []
    (line,) = refused("--world-size", "4")
    assert ("1.02 GiB per rank, 4.06 GiB for 4 rank(s) here, more than the 3.00 GiB of RAM "
            "(test); lower it (default 1024)") in line
    assert refused("--world-size", "4", "data.shuffle=false") == []


def test_a_slurm_node_counts_the_block_windows_of_its_own_ranks(corpus, monkeypatch):
    """The start-up check on each CPU node of a 4-node job compares the block windows of its
    own processes with its RAM: one process (1.02 GiB of windows, 3 GiB of RAM) fits; it
    counted all 4 nodes' ranks (4.06 GiB). Control: 4 processes on the node do not fit."""
    from tape_train.cluster import preflight as node_preflight
    from tape_train.train import memory

    monkeypatch.setattr(memory, "device_memory", lambda *a, **k: (3 * 2**30, "RAM (test)"))
    monkeypatch.setenv("SLURM_NNODES", "4")
    args = ["--config", str(corpus / "run.yaml"), "data.block_shuffle_window=4194304",
            "data.sharding=global"]
    assert node_preflight.check_run_inputs(args, gpus_per_node=0, procs_per_node=1).ok
    refused = node_preflight.check_run_inputs(args, gpus_per_node=0, procs_per_node=4)
    assert not refused.ok and "4.06 GiB for 4 rank(s) here" in refused.detail


def _write_marker(run_dir: Path, config: dict, dp: int) -> Path:
    tag = run_dir / "checkpoints" / "step_00000010"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps({
        "step": 10, "tokens_seen": 1280, "world_size": dp, "dp_size": dp,
        "layout": {"dp": dp, "sp": 1, "tp": 1}, "zero_stage": 1, "config": config,
        "files": {}}))
    return tag


def test_resume_that_changes_the_global_batch_is_refused(corpus, tmp_path):
    from tape_train.config import load_run_config

    run_dir = tmp_path / "run"
    overrides = [f"train.run_dir={run_dir}"]
    cfg = load_run_config(corpus / "run.yaml", overrides)
    tag = _write_marker(run_dir, cfg.to_dict(), dp=2)
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", *overrides]
    rc, out, err = dry_run([*args, "--world-size", "2"])  # the saved layout: resumes
    assert rc == 0, err
    assert f"resume: {tag} (step 10" in out
    rc, out, err = dry_run([*args, "--world-size", "1"])
    assert rc == 1
    batch, sharding = error_lines(err)  # dp 2 -> 1: the batch, and documents sharding
    assert f"resume from {tag}: the global batch changes from 4 to 2 sequences" in batch
    assert "set train.grad_accum_steps=2 to keep it" in batch
    assert "data.sharding='documents' ties the token stream" in sharding
    rc, out, err = dry_run([*args, "--world-size", "1", "train.grad_accum_steps=2"])
    assert "global batch" not in err  # dp 2 -> 1 with the batch kept: only the sharding rule
    assert "data.sharding='documents' ties the token stream" in err


def test_resume_may_change_the_zero_stage_among_1_2_3_but_not_into_or_out_of_zero0(
        corpus, tmp_path):
    """ZeRO-1 -> 3 loads through the universal form fitted for ZeRO-3, ZeRO-1 -> 2 directly:
    the dry run names the route the trainer takes, with no error and no flag needed (the
    change is a layout change, like dp). Into ZeRO-0 DeepSpeed has no route: one line naming
    the fix, which --allow-config-change does not turn into a warning."""
    from tape_train.config import load_run_config

    run_dir = tmp_path / "run"
    overrides = [f"train.run_dir={run_dir}", "data.sharding=global"]
    cfg = load_run_config(corpus / "run.yaml", [*overrides, "parallel.zero_stage=1"])
    tag = _write_marker(run_dir, cfg.to_dict(), dp=2)  # saved at ZeRO-1
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", "--world-size", "2", *overrides]
    for stage, route in ((3, "ZeRO-1 -> ZeRO-3, DeepSpeed universal checkpoint"),
                         (2, "same layout, direct load")):
        rc, out, err = dry_run([*args, f"parallel.zero_stage={stage}"])
        assert rc == 0 and not error_lines(err), err
        assert f"resume: {tag} (step 10, 1280 tokens; " in out and f"{route})" in out, out
    for extra in ([], ["--allow-config-change"]):
        rc, out, err = dry_run([*args, "parallel.zero_stage=0", *extra])
        assert rc == 1
        (line,) = error_lines(err)
        assert line.endswith(f"resume from {tag}: parallel.zero_stage changes from 1 to 0: "
                             f"DeepSpeed cannot load a ZeRO-1 checkpoint into a ZeRO-0 engine "
                             f"(universal form included: ZeRO-0 keeps no optimizer shards, "
                             f"and a ZeRO-0 engine has no universal load); resume with "
                             f"parallel.zero_stage=1, 2 or 3")


def test_tape_submit_refuses_a_job_that_cannot_resume_on_its_node_count(corpus, tmp_path,
                                                                        monkeypatch):
    from tape_train.config import load_run_config

    run_dir = tmp_path / "run"
    overrides = [f"train.run_dir={run_dir}", "data.sharding=global"]
    cfg = load_run_config(corpus / "run.yaml", overrides)
    _write_marker(run_dir, cfg.to_dict(), dp=2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/sbatch.calls\necho 4242\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)

    def submit_with(nodes: int) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = submit.main(["--config", str(corpus / "run.yaml"), *overrides,
                              "--nodes", str(nodes), "--cpus-per-task", "1"])
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = submit_with(1)
    assert rc == 1 and out == ""
    assert "tape-submit: preflight: error: resume from" in err
    assert "the global batch changes from 4 to 2 sequences" in err
    assert not (tmp_path / "sbatch.calls").exists()
    rc, out, err = submit_with(2)  # the saved layout: submitted
    assert rc == 0, err
    assert out.strip() == "4242" and (tmp_path / "sbatch.calls").exists()


def test_tape_submit_dry_run_runs_the_preflight_without_sbatch(corpus, tmp_path, monkeypatch):
    """`tape-submit --dry-run` is how a job is checked before queueing it: it runs the same
    preflight as a submit (plan and problems on stderr, exit 1 on a problem) and still prints
    the script on stdout; sbatch is not needed. `--no-preflight` is the negative control."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-sbatch-here"))
    monkeypatch.chdir(tmp_path)
    config = ["--config", str(corpus / "run.yaml"), f"train.run_dir={tmp_path / 'run'}"]

    def dry_run_submit(*extra: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = submit.main([*config, *extra, "--cpus-per-task", "1", "--dry-run"])
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = dry_run_submit()
    assert rc == 0, err
    assert "tape-submit: preflight for 1 node(s) x 1 process(es):" in err
    assert "rank grid: world=1" in err and "error" not in err
    assert out.startswith("#!/bin/bash\n") and "rank grid" not in out  # the plan: stderr
    assert err.endswith(f"to submit the script by hand: mkdir -p {Path.cwd()}/logs/slurm && "
                        f"sbatch <file>\n")
    script = out

    missing = tmp_path / "no-such.model"
    rc, out, err = dry_run_submit(f"data.tokenizer={missing}")
    assert rc == 1
    assert f"tape-submit: preflight: error: data.tokenizer: tokenizer {missing}: no such file" \
        in err
    assert "tape-submit: preflight found 1 problem(s): a submit would refuse this job" in err
    assert "to submit the script by hand" not in err   # said only of a script that may go
    # --help promises the exit code it returns
    help_text = " ".join(submit.build_parser().format_help().split())
    assert f"(exit {rc} if the preflight found a problem)" in help_text
    # The whole script still, the one a submit would queue (here with the override).
    assert out.startswith("#!/bin/bash\n") and len(out.splitlines()) == len(script.splitlines())
    assert f"train.run_dir={tmp_path / 'run'} data.tokenizer={missing})" in out

    rc, out, err = dry_run_submit(f"data.tokenizer={missing}", "--no-preflight")
    assert rc == 0 and "preflight" not in err
    assert "TRAIN_ARGS=(" in out
    assert not (tmp_path / "logs").exists() and not (tmp_path / "run").exists()


def test_slurm_start_up_checks_refuse_a_job_that_cannot_resume_on_its_node_count(
        corpus, tmp_path, monkeypatch):
    # Plain `sbatch train.sbatch` has no tape-submit preflight: the first node's start-up
    # checks must refuse the resume, not the trainer after torchrun (which restarts it once).
    from tape_train.cluster import preflight as node_preflight
    from tape_train.config import load_run_config

    run_dir = tmp_path / "run"
    overrides = [f"train.run_dir={run_dir}", "data.sharding=global"]
    _write_marker(run_dir, load_run_config(corpus / "run.yaml", overrides).to_dict(), dp=2)
    monkeypatch.setenv("SLURMD_NODENAME", "n1")

    def checks(nodes: int, node_id: int, *extra: str) -> tuple[int, str]:
        monkeypatch.setenv("SLURM_NNODES", str(nodes))
        monkeypatch.setenv("SLURM_NODEID", str(node_id))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = node_preflight.main(["--min-free-gb", "0", "--", "--config",
                                      str(corpus / "run.yaml"), *overrides, *extra])
        return rc, err.getvalue()

    rc, err = checks(1, 0)
    assert rc == 1
    assert "[preflight n1] FAILED run inputs: resume from" in err
    assert "the global batch changes from 4 to 2 sequences" in err
    assert checks(2, 0) == (0, "")                             # the saved layout resumes
    assert checks(1, 0, "--allow-config-change")[0] == 0       # as tape-train allows it
    assert checks(1, 1)[0] == 0         # only the first node decides (as for the run lock)


def _run_trainer(corpus: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(corpus / "fake_site"), str(ROOT)])}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "tape_train.train.cli", "--config",
                           str(corpus / "run.yaml"), *overrides], capture_output=True,
                          text=True, env=env, cwd=corpus, timeout=300)


def test_real_run_refuses_bad_input_before_deepspeed(corpus):
    proc = _run_trainer(corpus, [f"data.sources=[{corpus}/garbage.jsonl]"])
    assert proc.returncode == 1
    assert NO_DEEPSPEED not in proc.stderr and "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert f"{corpus}/garbage.jsonl:2: invalid UTF-8" in line
    # Control: with good inputs the same command gets as far as importing DeepSpeed.
    proc = _run_trainer(corpus, [])
    assert proc.returncode != 0 and NO_DEEPSPEED in proc.stderr
    assert not error_lines(proc.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_real_run_asking_for_cuda_where_there_is_none_stops_before_deepspeed(corpus):
    """The dry run plans for the cluster's devices and lets train.device=cuda pass on a
    machine without a GPU; the real run needs the device where it runs."""
    rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run",
                            "train.device=cuda"])
    assert rc == 0, err
    proc = _run_trainer(corpus, ["train.device=cuda"])
    assert proc.returncode == 1
    assert NO_DEEPSPEED not in proc.stderr and "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "train.device cuda: no CUDA device here" in line


def _corpus_copy(corpus: Path, tmp_path: Path) -> Path:
    """A directory source of two files a test may change."""
    docs = real_text_documents(120)
    write_jsonl(tmp_path / "data" / "a.jsonl", docs[:60])
    write_jsonl(tmp_path / "data" / "b.jsonl", docs[60:])
    return tmp_path / "data"


def _checkpoint_with_loader_state(cfg, dp: int = 1) -> Path:
    """A complete tag in cfg's run dir, saved on ``dp`` data-parallel ranks, whose rank-0
    trainer state holds the loader state of a run of ``cfg`` after two batches."""
    import torch

    from tape_train.data import build_train_loader, load_tokenizer

    tag = _write_marker(Path(cfg.train.run_dir), cfg.to_dict(), dp=dp)
    loader = build_train_loader(cfg.data, load_tokenizer(cfg.data.tokenizer), cfg.train.seq_len,
                                cfg.train.micro_batch_size, 0, dp, seed=cfg.train.seed)
    next(loader), next(loader)
    torch.save({"rng": None, "loader": loader.state_dict()}, tag / "trainer_state_rank00000.pt")
    loader.close()
    return tag


def test_a_resume_after_the_corpus_changed_is_refused_by_the_dry_run_naming_the_file(
        corpus, tmp_path):
    from tape_train.config import load_run_config

    data = _corpus_copy(corpus, tmp_path)
    overrides = [f"train.run_dir={tmp_path / 'run'}", f"data.sources=[{data}]"]
    tag = _checkpoint_with_loader_state(load_run_config(corpus / "run.yaml", overrides))
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", *overrides]
    rc, out, err = dry_run(args)  # negative control: the data as it was saved
    assert rc == 0, err
    assert f"resume: the data-loader state of {tag.name} fits the data (fingerprint " in out
    original = (data / "b.jsonl").read_bytes()
    (data / "b.jsonl").write_bytes(original + b'{"text": "one more document"}\n')
    rc, out, err = dry_run(args)
    assert rc == 1
    (line,) = error_lines(err)
    assert f"resume from {tag}: its data-loader state does not fit the data this run would " \
           f"read: data fingerprint differs in sources (data.sources[0] ({data}): " \
           f"b.jsonl changed ({len(original)} -> {len(original) + 30} bytes))" in line
    assert "--allow-config-change" in line
    rc, out, err = dry_run([*args, "--allow-config-change"])
    assert rc == 0 and not error_lines(err)
    assert "b.jsonl changed" in err and "allowed by --allow-config-change" in err
    edited = original.replace(b" the ", b" THE ", 1)  # edited in place: the same size
    assert edited != original and len(edited) == len(original)
    (data / "b.jsonl").write_bytes(edited)
    rc, out, err = dry_run(args)
    assert rc == 1
    (line,) = error_lines(err)
    assert f"data fingerprint differs in sources (data.sources[0] ({data}): b.jsonl changed " \
           f"(same {len(original)} bytes, other content)). Restore the data" in line
    (data / "b.jsonl").write_bytes(original)
    write_jsonl(data / "c.jsonl", ["a document added after the checkpoint"])
    rc, out, err = dry_run(args)
    assert rc == 1 and error_lines(err)[0].endswith(
        "sources (data.sources[0] ({}): c.jsonl added). Restore the data as it was, start a "
        "new run in another train.run_dir, or pass --allow-config-change to resume from the "
        "saved position anyway".format(data))
    (data / "c.jsonl").unlink()
    assert dry_run(args)[0] == 0


def test_a_resume_from_data_moved_elsewhere_is_checked_by_what_it_is(corpus, tmp_path):
    """The corpus and the tokenizer copied to another place (node-local scratch) and named
    there: the dry run and a real run's start-up checks accept it, with one line saying the
    data moved, because the data check finds the same data; moved to a copy that differs,
    the data check refuses it in one line naming the file. A genuinely protected change is
    named alone, with its old and new value, not with the changes a resume may make."""
    import shutil

    from tape_train.config import load_run_config

    data = _corpus_copy(corpus, tmp_path)
    tokenizer = load_run_config(corpus / "run.yaml").data.tokenizer
    overrides = [f"train.run_dir={tmp_path / 'run'}", f"data.sources=[{data}]"]
    tag = _checkpoint_with_loader_state(load_run_config(corpus / "run.yaml", overrides))
    scratch = tmp_path / "scratch"
    shutil.copytree(data, scratch / "data")
    shutil.copy(tokenizer, scratch / "tok.model")
    moved = [f"train.run_dir={tmp_path / 'run'}", f"data.sources=[{scratch / 'data'}]",
             f"data.tokenizer={scratch / 'tok.model'}", "train.max_steps=6"]
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", *moved]
    rc, out, err = dry_run(args)
    assert rc == 0 and not error_lines(err), err
    (line,) = [ln for ln in out.splitlines() if "the data moved" in ln]
    assert f"data.sources[0].path: '{data}' -> '{scratch / 'data'}'" in line
    assert f"data.tokenizer: '{tokenizer}' -> '{scratch / 'tok.model'}'" in line
    assert f"resume: the data-loader state of {tag.name} fits the data" in out
    # A real run's start-up checks pass too (up to importing DeepSpeed).
    proc = _run_trainer(corpus, moved)
    assert NO_DEEPSPEED in proc.stderr and not error_lines(proc.stderr), proc.stderr
    # Negative controls: the copy differs; a protected key changes beside harmless ones.
    (scratch / "data" / "a.jsonl").write_bytes((data / "a.jsonl").read_bytes()[:-100])
    for refused in (dry_run(args)[2], _run_trainer(corpus, moved).stderr):
        (line,) = error_lines(refused)
        assert f"resume from {tag}: its data-loader state does not fit the data" in line
        assert f"(data.sources[0] ({scratch / 'data'}; saved as {data}): a.jsonl changed (" \
            in line
        assert NO_DEEPSPEED not in refused and "Traceback" not in refused
    rc, out, err = dry_run([*args, f"data.sources=[{data}]", "model.num_layers=3"])
    assert rc == 1
    (line,) = error_lines(err)
    assert line.endswith("these config changes would corrupt the run: model.num_layers: 4 -> 3")


@pytest.mark.parametrize("sharding", ["global", "documents"])
def test_the_data_check_of_a_resume_on_another_world_size(corpus, tmp_path, sharding):
    """A state saved on 2 data-parallel ranks fits the unchanged data at 2 ranks, and, in
    ``global`` sharding, at 1 rank; a ``documents`` stream cannot change its dp, which the
    layout check says (once: the data check stays silent about it)."""
    from tape_train.config import load_run_config

    data = _corpus_copy(corpus, tmp_path)
    overrides = [f"train.run_dir={tmp_path / 'run'}", f"data.sources=[{data}]",
                 f"data.sharding={sharding}"]
    tag = _checkpoint_with_loader_state(load_run_config(corpus / "run.yaml", overrides), dp=2)
    args = ["--config", str(corpus / "run.yaml"), "--dry-run", *overrides]
    rc, out, err = dry_run([*args, "--world-size", "2"])
    assert rc == 0, err
    assert f"resume: the data-loader state of {tag.name} fits the data" in out
    rc, out, err = dry_run([*args, "--world-size", "1", "train.grad_accum_steps=2"])
    if sharding == "global":
        assert rc == 0, err
        assert "dp=2 sp=1 tp=1 -> dp=1 sp=1 tp=1" in out
        assert f"resume: the data-loader state of {tag.name} fits the data" in out
        # ... and a real run on 1 rank passes its start-up checks (up to importing DeepSpeed).
        proc = _run_trainer(corpus, [*overrides, "train.grad_accum_steps=2"])
        assert NO_DEEPSPEED in proc.stderr and not error_lines(proc.stderr), proc.stderr
    else:
        assert rc == 1
        (line,) = error_lines(err)
        assert "data.sharding='documents' ties the token stream" in line
    (data / "a.jsonl").unlink()
    rc, out, err = dry_run([*args, "--world-size", "2"])
    assert rc == 1 and "a.jsonl removed" in error_lines(err)[-1]


def test_real_run_refuses_a_changed_corpus_before_deepspeed(corpus, tmp_path):
    from tape_train.config import load_run_config

    data = _corpus_copy(corpus, tmp_path)
    overrides = [f"train.run_dir={tmp_path / 'run'}", f"data.sources=[{data}]"]
    tag = _checkpoint_with_loader_state(load_run_config(corpus / "run.yaml", overrides))
    (data / "a.jsonl").write_bytes((data / "a.jsonl").read_bytes()[:-100])
    proc = _run_trainer(corpus, overrides)
    assert proc.returncode == 1
    assert NO_DEEPSPEED not in proc.stderr and "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert f"resume from {tag}: its data-loader state does not fit the data" in line
    assert f"(data.sources[0] ({data}): a.jsonl changed (" in line
    # Controls: allowed by --allow-config-change, and the data as it was (rewritten), get as
    # far as importing DeepSpeed.
    proc = _run_trainer(corpus, [*overrides, "--allow-config-change"])
    assert proc.returncode != 0 and NO_DEEPSPEED in proc.stderr
    assert not error_lines(proc.stderr)
    _corpus_copy(corpus, tmp_path)
    proc = _run_trainer(corpus, overrides)
    assert proc.returncode != 0 and NO_DEEPSPEED in proc.stderr
    assert not error_lines(proc.stderr)


def test_dry_run_does_not_import_deepspeed(corpus):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(corpus / "fake_site"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "tape_train.train.cli", "--config",
                           str(corpus / "run.yaml"), "--dry-run", "--world-size", "4",
                           "parallel.zero_stage=3"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rank grid: world=4 dp=4" in proc.stdout and "preflight: ok" in proc.stdout


def test_the_plan_sizes_checkpoints_in_the_dtype_auto_resolves_to(corpus):
    from tape_train.config import load_run_config
    from tape_train.files import human_bytes
    from tape_train.train import preflight

    def planned(dtype: str) -> str:   # GPU nodes: auto plans bf16 (no CPU measurement)
        rc, out, err = dry_run(["--config", str(corpus / "run.yaml"), "--dry-run", "--nodes",
                                "1", "--gpus-per-node", "1", "--gpu-name", "H100",
                                f"train.dtype={dtype}"])
        assert rc == 0, err
        return next(ln for ln in out.splitlines() if "(+1 being written)" in ln)

    def size(dtype: str) -> str:
        cfg = load_run_config(corpus / "run.yaml", [f"train.dtype={dtype}"])
        return f"checkpoints of ~{human_bytes(preflight.checkpoint_bytes(cfg))} need"

    assert size("bf16") != size("fp32")
    assert size("bf16") in planned("auto")
    assert size("fp32") in planned("fp32")                 # negative control


def test_disk_check_counts_the_checkpoints_a_resume_already_has(corpus, tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    from tape_train.config import load_run_config
    from tape_train.train import preflight

    run_dir = tmp_path / "run"
    cfg = load_run_config(corpus / "run.yaml", [f"train.run_dir={run_dir}", "checkpoint.keep=2"])
    one = preflight.checkpoint_bytes(cfg)
    usage = namedtuple("usage", "total used free")
    # Room for 1.5 checkpoints: a new run (needs keep + 1 = 3) is refused ...
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(0, 0, int(1.5 * one)))
    report = preflight.Report()
    preflight._check_run_dir(cfg, report)
    [problem] = report.problems
    assert "checkpoint.keep=2 (+1 being written)" in problem and "need " in problem
    # ... a resume whose 2 checkpoints are already on disk needs room for 1 more: it starts.
    for step in (10, 20):
        tag = run_dir / "checkpoints" / f"step_{step:08d}"
        tag.mkdir(parents=True)
        (tag / "COMPLETE.json").write_text(json.dumps({"step": step, "files": {}}))
    report = preflight.Report()
    preflight._check_run_dir(cfg, report)
    assert not report.problems, report.problems
    assert any("2 of them already there, need" in line for line in report.lines), report.lines
    # Negative control: an incomplete tag holds no place.
    (tag / "COMPLETE.json").unlink()
    report = preflight.Report()
    preflight._check_run_dir(cfg, report)
    assert report.problems and "1 of them already there" in report.problems[0]


@pytest.mark.parametrize("layout,per_node,warned", [
    (["parallel.tp=8"], 4, "parallel.tp=8 with 4 ranks per node: tensor-parallel groups span"),
    (["parallel.tp=4"], 6, "parallel.tp=4 with 6 ranks per node"),       # blocks straddle nodes
    (["parallel.sp=4", "parallel.tp=2"], 4, "parallel.sp=4 x tp=2 with 4 ranks per node"),
    (["parallel.tp=8"], 8, None),                                         # controls: one node each
    (["parallel.sp=4", "parallel.tp=2"], 8, None),
    (["parallel.tp=2"], 6, None)])
def test_tensor_or_sequence_parallel_groups_across_nodes_are_a_warning(layout, per_node, warned):
    """Ranks fill nodes in order, so a tp group (a block of tp consecutive ranks) stays on one
    node only when tp divides the GPUs per node: else every layer's all-reduces cross the
    network. A legal layout, so a warning naming the fix, not an error."""
    rc, out, err = dry_run(["--config", "125m", "--dry-run", "--nodes", "2", "--gpus-per-node",
                            str(per_node), "model.num_heads=16", "train.synthetic_data=true",
                            *layout])
    assert rc == 0 and "preflight: ok" in out, err
    lines = [ln for ln in err.splitlines() if "span nodes" in ln]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and warned in lines[0] and "tape-train: preflight: warning: " \
            in lines[0], lines


def test_gpus_per_node_alone_plans_one_full_node():
    """`--gpus-per-node 8` without `--nodes` plans one node of 8 ranks (it planned 1 rank);
    `--nodes 2` doubles it and `--world-size` still wins."""
    def grid(*args):
        rc, out, err = dry_run(["--config", "125m", "--dry-run", "train.synthetic_data=true",
                                "--gpu-name", "H100", *args])   # (125m may not fit this RAM)
        return next(ln for ln in out.splitlines() if ln.startswith("rank grid: "))

    assert grid("--gpus-per-node", "8").startswith("rank grid: world=8 dp=8 ")
    assert grid("--gpus-per-node", "8", "--nodes", "2").startswith("rank grid: world=16 ")
    assert grid("--gpus-per-node", "8", "--world-size", "4").startswith("rank grid: world=4 ")
    assert grid().startswith("rank grid: world=1 ")                       # this machine


@pytest.mark.parametrize("args,hinted", [
    (["--gpus-per-node", "1"], True),                                    # ZeRO-3 (125m's) on 1 rank
    (["--gpus-per-node", "2", "parallel.tp=2"], True),                   # dp×sp is still 1
    (["--gpus-per-node", "1", "parallel.zero_stage=2"], True),
    (["--gpus-per-node", "2"], False),                                   # controls: dp 2,
    (["--gpus-per-node", "1", "parallel.zero_stage=1"], False),          # already ZeRO-1,
    (["--gpus-per-node", "1", "parallel.offload_params=cpu"], False)])   # offload needs ZeRO-3
def test_zero3_over_one_data_parallel_rank_gets_a_hint(args, hinted):
    """ZeRO-3 over dp×sp = 1 shards nothing yet gathers every block's parameters each step:
    the plan says so (a hint among its lines, not a warning: the run is legal)."""
    rc, out, err = dry_run(["--config", "125m", "--dry-run", "train.synthetic_data=true",
                            "--gpu-name", "H100", *args])
    assert rc == 0 and "preflight: ok" in out, err
    hints = [ln for ln in out.splitlines() if ln.startswith("hint: ZeRO-")]
    assert len(hints) == int(hinted) and "warning" not in err, (out, err)
    if hinted:
        assert "parallel.zero_stage=1 needs about the same memory per rank" in hints[0]
        stage2 = "parallel.zero_stage=2" in args  # ZeRO-2 gathers no parameters
        assert ("ZeRO-2's gradient partitioning" if stage2
                else "ZeRO-3's per-block parameter gathers") in hints[0], hints[0]
