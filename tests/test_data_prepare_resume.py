"""An interrupted `tape-data prepare` resumes from its last checkpoint; its output is then
byte-identical to an uninterrupted run's. The real CLI runs in a subprocess and is SIGKILLed at
exact points (the KILL_ENV hook of prepare_scratch.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tape_train.data.prepare_scratch import KILL_ENV, RESUME_PREFIX
from tape_train.data.testing import real_text_documents, write_jsonl

REPO = Path(__file__).resolve().parents[1]
# ~0.6 MB of training text in buffers of 40 kB: about 15 checkpoints.
OPTIONS = ["--num-shards", "3", "--eval-fraction", "0.1", "--shuffle-bytes", "40000"]


def _corpus(directory: Path) -> Path:
    texts = real_text_documents(300)
    write_jsonl(directory / "a.jsonl", texts[:150] + texts[:10])  # 10 duplicates
    write_jsonl(directory / "b.jsonl", texts[150:])
    return directory


def _env() -> dict[str, str]:
    """The environment of a child tape-data: this checkout first on the path, and whatever the
    path held (packages installed with --target, as on the GPU image) after it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop(KILL_ENV, None)
    return env


def _prepare(out: Path, *args: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = _env()
    if kill_at:
        env[KILL_ENV] = kill_at
    return subprocess.run([sys.executable, "-m", "tape_train.data.cli", "prepare", *args,
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)


def _files(directory: Path) -> dict[str, bytes]:
    """Every file of a prepared directory, by name (hidden scratch included)."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _killed(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stderr[-2000:])


def _finished(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """An uninterrupted run's files."""
    out = tmp_path_factory.mktemp("ref") / "out"
    _finished(_prepare(out, "--input", str(corpus), *OPTIONS))
    return _files(out)


@pytest.mark.parametrize("kill_at", ["checkpoint-1", "data-4", "checkpoint-9", "moved"])
def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, corpus, reference, kill_at):
    """SIGKILL after a checkpoint's state, between its data and its state (the data runs past
    the state and is cut back), or while shards move into place: the same command goes on
    from there and writes exactly what an uninterrupted run writes, leaving no scratch."""
    out = tmp_path / "out"
    args = ["--input", str(corpus), *OPTIONS]
    _killed(_prepare(out, *args, kill_at=kill_at))
    assert not (out / "manifest.json").exists()
    log = _finished(_prepare(out, *args))
    if kill_at == "moved":
        assert "its shards are complete" in log
    else:
        checkpoint = int(kill_at.split("-")[1]) - (kill_at.startswith("data"))
        assert "resuming prepare from " in log and f"checkpoint {checkpoint}\n" in log, log
        assert "starting over" not in log
    assert _files(out) == reference


def test_a_prepare_killed_twice_and_on_two_workers_with_tokens_resumes(tmp_path, corpus, tok):
    """--tokenize --workers 2, killed at checkpoint 2 and again (resumed) at 6, then finished
    on one worker: text and token shards and the manifest equal an uninterrupted run's."""
    args = ["--input", str(corpus), *OPTIONS, "--tokenize", "--tokenizer", tok.path]
    _finished(_prepare(tmp_path / "ref", *args, "--workers", "2"))
    out = tmp_path / "out"
    _killed(_prepare(out, *args, "--workers", "2", kill_at="checkpoint-2"))
    _killed(_prepare(out, *args, "--workers", "2", kill_at="data-6"))
    log = _finished(_prepare(out, *args, "--workers", "1"))
    assert "checkpoint 5\n" in log
    reference = _files(tmp_path / "ref")
    assert any(name.endswith(".tokens") for name in reference)
    assert _files(out) == reference


def test_changed_input_starts_over_and_other_options_wait_for_fresh(tmp_path, corpus):
    """Negative controls: an input file modified since the interruption, or --fresh: the run
    starts over (saying why) and writes what a fresh run writes; other options are refused
    until --fresh."""
    data = tmp_path / "in"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (data / name).write_bytes((corpus / name).read_bytes())
    out = tmp_path / "out"
    args = ["--input", str(data), *OPTIONS]
    _killed(_prepare(out, *args, kill_at="checkpoint-3"))
    lines = (data / "b.jsonl").read_text().splitlines(keepends=True)
    (data / "b.jsonl").write_text("".join(lines[:-20]))  # 20 documents fewer
    log = _finished(_prepare(out, *args))
    assert "starting over" in log and f"{data / 'b.jsonl'} changed (size" in log
    assert "resuming prepare" not in log
    _finished(_prepare(tmp_path / "fresh", *args))
    assert _files(out) == _files(tmp_path / "fresh")

    # Other options: the interrupted work is not thrown away by a mere re-run (refused, naming
    # what differs, nothing touched); --fresh discards it and writes what a fresh run writes.
    other = ["--input", str(data), *OPTIONS[:-1], "30000"]  # another shuffle buffer
    _killed(_prepare(tmp_path / "o", *args, kill_at="checkpoint-2"))
    left = list((tmp_path / "o").glob(f"{RESUME_PREFIX}*"))
    assert len(left) == 1
    before = _files(tmp_path / "o")
    refused = _prepare(tmp_path / "o", *other)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert ("holds an interrupted prepare with other options (shuffle_bytes 40000 -> 30000) "
            "that got to checkpoint 2") in refused.stderr
    assert "--fresh" in refused.stderr and "Traceback" not in refused.stderr
    assert _files(tmp_path / "o") == before
    log = _finished(_prepare(tmp_path / "o", *other, "--fresh"))
    assert f"removed {left[0]}, left by an interrupted prepare with other options (--fresh)" in log
    assert "resuming prepare" not in log
    _finished(_prepare(tmp_path / "o-fresh", *other))
    assert _files(tmp_path / "o") == _files(tmp_path / "o-fresh")
    # Killed before its first checkpoint: nothing to keep, removed without asking.
    _killed(_prepare(tmp_path / "e", *args, kill_at="data-1"))
    assert list((tmp_path / "e").glob(f"{RESUME_PREFIX}*"))
    log = _finished(_prepare(tmp_path / "e", *other))
    assert "left by an interrupted prepare with other options before its first checkpoint" in log
    assert _files(tmp_path / "e") == _files(tmp_path / "o-fresh")

    _killed(_prepare(tmp_path / "f", *args, kill_at="checkpoint-2"))
    log = _finished(_prepare(tmp_path / "f", *args, "--fresh"))
    assert "starting over" in log and ": --fresh" in log and "resuming prepare" not in log
    assert _files(tmp_path / "f") == _files(tmp_path / "fresh")


def test_a_prepare_stopped_by_an_error_resumes_past_it(tmp_path, corpus):
    """A bad record after a few checkpoints stops the run with its one-line error and keeps
    the checkpoint; re-run with --skip-bad-records it resumes instead of starting over."""
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl").write_bytes((corpus / "a.jsonl").read_bytes())
    (data / "b.jsonl").write_bytes((corpus / "b.jsonl").read_bytes() + b"{not json\n")
    run = _prepare(tmp_path / "out", "--input", str(data), *OPTIONS)
    assert run.returncode == 1
    assert "b.jsonl:151: malformed JSON" in run.stderr
    assert "the same command resumes from checkpoint" in run.stderr
    log = _finished(_prepare(tmp_path / "out", "--input", str(data), *OPTIONS,
                             "--skip-bad-records"))
    assert "resuming prepare from" in log
    reference = _prepare(tmp_path / "ref", "--input", str(data), *OPTIONS, "--skip-bad-records")
    _finished(reference)
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_a_running_prepare_is_not_joined_by_a_second(tmp_path, corpus):
    """The scratch of a live prepare with the same options is refused, not shared; an owner
    whose pid now names another process (pid reuse, e.g. after a reboot) does not block."""
    import json

    from tape_train.data.prepare_scratch import OWNER_NAME
    from tape_train.files import process_start

    out = tmp_path / "out"
    _killed(_prepare(out, "--input", str(corpus), *OPTIONS, kill_at="checkpoint-1"))
    scratch, = out.glob(f"{RESUME_PREFIX}*")
    owner = json.loads((scratch / OWNER_NAME).read_text())
    assert owner["pid_start"]
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (scratch / OWNER_NAME).write_text(json.dumps(
            {**owner, "pid": alive.pid, "pid_start": process_start(alive.pid)}))
        run = _prepare(out, "--input", str(corpus), *OPTIONS)
        assert run.returncode == 1
        assert ("is being written by another tape-data prepare with the same options (pid "
                f"{alive.pid}") in run.stderr
        # The same live pid, recorded with another process's start: the owner is gone.
        (scratch / OWNER_NAME).write_text(json.dumps(
            {**owner, "pid": alive.pid, "pid_start": "another-boot:1"}))
        assert "resuming prepare" in _finished(_prepare(out, "--input", str(corpus), *OPTIONS))
    finally:
        alive.kill()
        alive.wait()


# Runs tape-data with its claim of the scratch slowed down: it sleeps in the middle of it (after
# the look for a live owner, before writing its own), and just after it waits for the file
# <claiming>.go (the test writes it once the second prepare has ended, however slowly that one
# started on a busy machine: the first cannot finish and leave a complete output meanwhile).
_SLOW_CLAIM = """
import sys, time
from pathlib import Path
from tape_train.data import cli, prepare_scratch
truncate, digests = prepare_scratch.PrepareScratch._truncate, prepare_scratch.DigestLog.__init__
def slow_truncate(self, state):
    Path(sys.argv[1]).touch()
    time.sleep(2)
    return truncate(self, state)
def slow_digests(self, *args):
    go, deadline = Path(sys.argv[1] + ".go"), time.monotonic() + 600
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    digests(self, *args)
prepare_scratch.PrepareScratch._truncate = slow_truncate
prepare_scratch.DigestLog.__init__ = slow_digests
sys.exit(cli.main(sys.argv[2:]))
"""


def test_two_prepares_started_at_once_do_not_both_resume(tmp_path, corpus, reference):
    """Two resumes started together (a job submitted twice): the second waits for the first to
    claim the scratch, then is refused; without that, both found no live owner while the first
    was still cutting its files back, and both resumed into the same files."""
    import time

    out = tmp_path / "out"
    args = ["prepare", "--input", str(corpus), *OPTIONS, "--out", str(out)]
    _killed(_prepare(out, "--input", str(corpus), *OPTIONS, kill_at="checkpoint-2"))
    claiming = tmp_path / "claiming"
    first = subprocess.Popen([sys.executable, "-c", _SLOW_CLAIM, str(claiming), *args], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not claiming.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        second = _prepare(out, "--input", str(corpus), *OPTIONS)
        (tmp_path / "claiming.go").touch()
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"is being written by another tape-data prepare with the same options (pid " \
               f"{first.pid}" in second.stderr
        assert first.wait(timeout=120) == 0, first.stderr.read()[-2000:]
    finally:
        (tmp_path / "claiming.go").touch()
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _files(out) == reference


def test_a_killed_hub_prepare_resumes_skipping_whole_files(tmp_path):
    """--hub (a `datasets` parquet builder over local files stands in for the Hub): resumed
    from a later file, the files before it are not streamed again; same bytes as unbroken."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = real_text_documents(240)
    (tmp_path / "pq").mkdir()
    for s in range(4):
        part = texts[s * 60:(s + 1) * 60]
        pq.write_table(pa.table({"text": part}), tmp_path / "pq" / f"part-{s}.parquet",
                       row_group_size=25)
    args = ["--hub", "parquet", "--data-files", str(tmp_path / "pq" / "*.parquet"),
            "--progress", "off", *OPTIONS]
    _finished(_prepare(tmp_path / "ref", *args))
    _killed(_prepare(tmp_path / "out", *args, kill_at="checkpoint-9"))
    log = _finished(_prepare(tmp_path / "out", *args))
    assert "resuming prepare from" in log
    resumed_at = next(line for line in log.splitlines() if "streaming parquet" in line)
    assert re.search(r"from record \d+ of file [234]$", resumed_at), resumed_at
    assert "file 1/4 of parquet done" not in log  # skipped, not streamed
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_scratch_left_after_the_manifest_is_removed_by_the_next_run(tmp_path, corpus,
                                                                     reference):
    """Killed between writing the manifest and removing its scratch: the directory is complete,
    and the next run (which finds it so) removes the leftover."""
    out = tmp_path / "out"
    _killed(_prepare(out, "--input", str(corpus), *OPTIONS, kill_at="manifest"))
    assert list(out.glob(f"{RESUME_PREFIX}*"))
    run = _prepare(out, "--input", str(corpus), *OPTIONS)
    assert "already complete" in run.stdout and "left by a prepare that completed" in run.stderr
    assert _files(out) == reference


def test_force_rebuilds_even_where_a_completed_prepare_left_its_scratch(tmp_path, corpus,
                                                                          reference):
    """Killed between the manifest and removing the scratch, then a shard damaged: --force
    rebuilds it instead of taking the finished scratch's word and re-writing the old manifest
    over the damaged shard."""
    out = tmp_path / "out"
    _killed(_prepare(out, "--input", str(corpus), *OPTIONS, kill_at="manifest"))
    shard = out / "train-00001-of-00003.jsonl.zst"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    log = _finished(_prepare(out, "--input", str(corpus), *OPTIONS, "--force"))
    assert "left by a prepare that completed" in log and "its shards are complete" not in log
    assert _files(out) == reference


def test_an_interrupted_force_rebuild_is_named_and_resumed_by_force(tmp_path, corpus,
                                                                     reference):
    """A --force rebuild of a complete directory killed after a checkpoint: the old manifest
    still stands, so a plain re-run says "already complete" — and says that the interrupted
    rebuild's scratch is there and how to resume or drop it; --force resumes it."""
    out = tmp_path / "out"
    _finished(_prepare(out, "--input", str(corpus), *OPTIONS))
    _killed(_prepare(out, "--input", str(corpus), *OPTIONS, "--force", kill_at="checkpoint-2"))
    plain = _finished(_prepare(out, "--input", str(corpus), *OPTIONS))
    assert "holds an interrupted rebuild of it (checkpoint 2" in plain
    assert "--force resumes it" in plain
    rebuilt = _finished(_prepare(out, "--input", str(corpus), *OPTIONS, "--force"))
    assert "resuming prepare from" in rebuilt and "interrupted rebuild" not in rebuilt
    assert _files(out) == reference
    # Negative control: nothing interrupted, nothing said.
    assert "interrupted rebuild" not in _finished(_prepare(out, "--input", str(corpus), *OPTIONS))


def test_demo_documents_resume_at_a_package_and_document(tmp_path, monkeypatch):
    """The demo source's position is [package, documents of it]: resuming yields exactly the
    rest, and packages before the position are not unpacked."""
    from tape_train.data import demo_corpus

    unpacked = []

    def run(cmd, cwd=None):
        unpacked.append(Path(cmd[2]).name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(demo_corpus, "_run", run)
    monkeypatch.setattr(demo_corpus, "extractor_for", lambda package: lambda root: (
        (f"{package}-{i}", f"text {package} {i}") for i in range(3)))
    debs = {name: (tmp_path / f"{name}.deb", "1.0") for name in ("p", "q", "r")}
    everything = list(demo_corpus.iter_demo_documents(debs))
    assert [pos for _, pos in everything][:4] == [[0, 1], [0, 2], [0, 3], [1, 1]]
    for k in (0, 2, 3, 7):
        unpacked.clear()
        rest = list(demo_corpus.iter_demo_documents(debs, everything[k][1]))
        assert rest == everything[k + 1:]
        assert unpacked == ["p.deb", "q.deb", "r.deb"][everything[k][1][0]:]


def test_ctrl_c_ends_with_one_line_and_the_same_command_resumes(tmp_path, corpus, reference,
                                                                  monkeypatch, capsys, caplog):
    """Ctrl-C after the first checkpoint: exit 130, one line (no traceback), the log names the
    checkpoint a re-run resumes from, and the re-run's output is the uninterrupted one's."""
    import logging

    from tape_train.data import cli, prepare_scratch

    def interrupt(name: str) -> None:
        if name == "checkpoint-1":
            raise KeyboardInterrupt

    argv = ["prepare", "--input", str(corpus), *OPTIONS, "--out", str(tmp_path / "out")]
    monkeypatch.setattr(prepare_scratch, "kill_point", interrupt)
    with caplog.at_level(logging.INFO, logger="tape_train.data"):
        assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "tape-data: interrupted" in err and "Traceback" not in err
    assert "the same command resumes from checkpoint 1" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tape_train.data"):
        assert cli.main(argv) == 0
    assert "resuming prepare from" in caplog.text
    assert _files(tmp_path / "out") == reference


def test_sigterm_stops_like_ctrl_c_and_a_second_one_is_ignored(tmp_path, corpus, reference,
                                                               monkeypatch, capsys, caplog):
    """SIGTERM (Slurm's time limit, preemption, scancel; prepare.sbatch's stop) after the first
    checkpoint: the Ctrl-C path (exit 130, the checkpoint named), not a death mid-write; a
    second SIGTERM (Slurm signals every process, the batch script once more) is ignored."""
    import logging

    from tape_train.data import cli, prepare_scratch

    def terminate(name: str) -> None:
        if name == "checkpoint-1":
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    argv = ["prepare", "--input", str(corpus), *OPTIONS, "--out", str(tmp_path / "out")]
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(prepare_scratch, "kill_point", terminate)
    try:
        with caplog.at_level(logging.INFO, logger="tape_train.data"):
            assert cli.main(argv) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert "tape-data: interrupted" in err and "Traceback" not in err
    assert "got SIGTERM; stopping as on Ctrl-C" in caplog.text
    assert "the same command resumes from checkpoint 1" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tape_train.data"):
        assert cli.main(argv) == 0
    assert "resuming prepare from" in caplog.text and "checkpoint 1" in caplog.text
    assert _files(tmp_path / "out") == reference
    assert signal.getsignal(signal.SIGTERM) == previous  # a run that was not stopped restores it


@pytest.mark.parametrize("failing", [1, 3])
def test_a_checkpoint_that_fails_to_save_is_not_named_as_the_one_to_resume(
        tmp_path, corpus, reference, monkeypatch, capsys, caplog, failing):
    """The disk fills while checkpoint k is written: the log names k-1 (the last whose state
    was written) as where the same command resumes, or, for the first, keeps no scratch."""
    import errno
    import logging

    from tape_train.data import cli, prepare_scratch

    def disk_full(name: str) -> None:
        if name == f"data-{failing}":
            raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "out"
    argv = ["prepare", "--input", str(corpus), *OPTIONS, "--out", str(out)]
    monkeypatch.setattr(prepare_scratch, "kill_point", disk_full)
    with caplog.at_level(logging.INFO, logger="tape_train.data"):
        assert cli.main(argv) == 1
    assert "no space left on device" in capsys.readouterr().err
    if failing == 1:
        assert "resumes from checkpoint" not in caplog.text
        assert not list(out.glob(f"{RESUME_PREFIX}*"))
    else:
        assert f"the same command resumes from checkpoint {failing - 1} (" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tape_train.data"):
        assert cli.main(argv) == 0
    assert ("starting over" not in caplog.text
            and ("resuming prepare from" in caplog.text) == (failing > 1)), caplog.text
    if failing > 1:
        assert f"checkpoint {failing - 1}\n" in caplog.text + "\n"
    assert _files(out) == reference


def test_training_on_an_unfinished_prepare_names_it(tmp_path, corpus, tok):
    """A directory whose prepare was killed (or is still running) is refused as a corpus, in
    both formats, with what is going on in it — not only "holds no supported files"."""
    import json

    from tape_train.data import DataConfig, DataError, build_train_loader
    from tape_train.data.prepare_scratch import OWNER_NAME
    from tape_train.data.tokens import read_token_manifest
    from tape_train.files import process_start

    out = tmp_path / "out"
    _killed(_prepare(out, "--input", str(corpus), *OPTIONS, kill_at="checkpoint-1"))
    scratch, = out.glob(f"{RESUME_PREFIX}*")
    note = (rf"it holds the scratch of an unfinished `tape-data prepare` \({scratch.name}, "
            rf"interrupted at checkpoint 1: re-running it with its options resumes it\)")
    with pytest.raises(DataError, match=rf"holds no supported files .*; {note}"):
        build_train_loader(DataConfig(sources=[str(out)], prefetch=0), tok, 32, 2)
    with pytest.raises(DataError, match=rf"not a complete prepared directory .*; {note}"):
        read_token_manifest(out, "data.sources[0].path")
    owner = json.loads((scratch / OWNER_NAME).read_text())
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (scratch / OWNER_NAME).write_text(json.dumps(
            {**owner, "pid": alive.pid, "pid_start": process_start(alive.pid)}))
        with pytest.raises(DataError, match=rf"still running \(pid {alive.pid}\)"):
            build_train_loader(DataConfig(sources=[str(out)], prefetch=0), tok, 32, 2)
    finally:
        alive.kill()
        alive.wait()
    # negative control: finished, the directory is a corpus
    _finished(_prepare(out, "--input", str(corpus), *OPTIONS))
    assert next(build_train_loader(DataConfig(sources=[str(out)], prefetch=0), tok, 32, 2))
