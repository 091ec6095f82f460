"""One progress convention: bars only on a terminal, plain lines in redirected logs."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from tape_train.eval.cli import main as eval_main
from tape_train.progress import ByteProgress, library_bars, progress_bar, show_progress
from test_eval_reports_cli import make_checkpoint


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_draws_only_on_a_terminal():
    assert show_progress("auto", _Terminal()) and not show_progress("auto", io.StringIO())
    assert show_progress("on", io.StringIO()) and show_progress(True, io.StringIO())
    assert not show_progress("off", _Terminal()) and not show_progress(False, _Terminal())
    assert progress_bar(10, stream=io.StringIO()) is None
    term = _Terminal()
    bar = progress_bar(10, stream=term)
    bar.update(5)
    bar.close()
    assert "\r" in term.getvalue()
    with pytest.raises(ValueError, match="progress mode 'sometimes'"):
        show_progress("sometimes")


def test_byte_progress_logs_done_rate_and_time_left_at_most_every_few_seconds(caplog):
    now = [100.0]
    logger = logging.getLogger("test.byte_progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        progress = ByteProgress(4 << 30, what="verify", logger=logger, every_s=5.0,
                                clock=lambda: now[0], stream=io.StringIO())
        progress.add(1 << 30)
        now[0] += 4.0
        progress.tick()  # 4 s: too soon for a line
        now[0] += 1.0
        progress.tick()
        progress.add(1 << 30)
        progress.tick()  # 0 s since the last line
        progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        "verify: 1.0 GiB of 4.0 GiB (25 %), 204.8 MiB/s, 15 s left"]
    assert progress.done == 2 << 30
    term = _Terminal()  # a terminal: a bar in bytes instead, and no log line
    with caplog.at_level(logging.INFO, logger=logger.name):
        caplog.clear()
        progress = ByteProgress(4 << 30, what="verify", logger=logger, stream=term, every_s=0)
        progress.add(3 << 30)
        progress.tick()
        progress.close()
    assert caplog.records == [] and "3.00G/4.00G" in term.getvalue()


@pytest.mark.parametrize("flag, bars", [([], False), (["--progress", "on"], True)])
def test_tape_eval_writes_no_carriage_returns_into_a_redirected_log(tmp_path, capsys, flag,
                                                                    bars):
    make_checkpoint(tmp_path / "run", "tape", seed=1)
    rc = eval_main(["--checkpoint", str(tmp_path / "run"), "--lengths", "8", "--max-tokens",
                    "40", "--batch-size", "3", "--out", str(tmp_path / "report"), *flag])
    assert rc == 0
    captured = capsys.readouterr()
    assert ("\r" in captured.err + captured.out) is bars


def test_deepspeed_s_own_bar_follows_the_convention():
    """`tape-eval`/`tape-export` of a ZeRO checkpoint: zero_to_fp32's "Loading checkpoint
    shards" bar is drawn on a terminal only."""
    from deepspeed.utils import zero_to_fp32

    def drawn(stream):
        out = io.StringIO()
        with library_bars(zero_to_fp32, stream=stream):
            for _ in zero_to_fp32.tqdm(range(3), desc="Loading checkpoint shards", file=out):
                pass
        return out.getvalue()

    assert drawn(io.StringIO()) == ""                          # a redirected log: no bar
    assert "Loading checkpoint shards" in drawn(_Terminal())   # a terminal: the bar
    assert "\r" in drawn(_Terminal())
    assert zero_to_fp32.tqdm.__module__.startswith("tqdm")     # restored after the block


def test_cli_logging_prints_a_library_line_once():
    """huggingface_hub and datasets attach their own stderr handler and also propagate: under
    the commands' logging each of their lines came out twice. A library logger that only
    propagates (the negative control) is still printed, in the commands' format."""
    code = (
        "import logging, sys\n"
        "from tape_train.progress import setup_cli_logging\n"
        "setup_cli_logging()\n"
        "lib = logging.getLogger('somelib')\n"  # what huggingface_hub does at import
        "lib.addHandler(logging.StreamHandler(sys.stderr))\n"
        "logging.getLogger('somelib.http').warning('retrying in 1s')\n"
        "logging.getLogger('otherlib').warning('plain library line')\n"
        "logging.getLogger('tape_train.data').info('our line')\n"
        # urllib3 and requests: a NullHandler only, which prints nothing (their retries)
        "logging.getLogger('nulllib').addHandler(logging.NullHandler())\n"
        "logging.getLogger('nulllib.pool').warning('Retrying after connection broken')\n"
        # a library handler that only prints errors does not print this warning
        "quiet = logging.StreamHandler(sys.stderr); quiet.setLevel(logging.ERROR)\n"
        "logging.getLogger('quietlib').addHandler(quiet)\n"
        "logging.getLogger('quietlib').warning('quiet library warning')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stderr.splitlines()
    assert sum("retrying in 1s" in line for line in err) == 1, err
    assert [line for line in err if "plain library line" in line][0].endswith(
        "WARNING otherlib: plain library line")
    assert any(line.endswith("INFO tape_train.data: our line") for line in err)
    assert [line for line in err if "Retrying" in line] == [
        line for line in err if line.endswith("WARNING nulllib.pool: Retrying after connection "
                                              "broken")] != []
    assert sum("quiet library warning" in line for line in err) == 1, err


# A stand-in for DeepSpeed's converter: its stage lines on stdout, a tqdm-style bar (carriage
# returns) on stderr, files written into --output_folder, then the exit status in argv[1].
_CONVERTER = r"""
import os, sys, time
out = sys.argv[sys.argv.index("--output_folder") + 1]
os.makedirs(os.path.join(out, "zero", "embed"))
print("args = Namespace(...)")
print("*** 1. Extracting ZeRO fragments")
for i in range(4):
    sys.stderr.write(f"\r {25 * i}%|##  | {i}/4 [00:0{i}<00:01]")
    sys.stderr.flush()
    with open(os.path.join(out, "zero", "embed", f"fragment{i}"), "wb") as fh:
        fh.write(b"x" * 2048)
    time.sleep(0.4)
sys.stderr.write("\r100%|####| 4/4 [00:02<00:00]\n")
print("*** 2. Merging slices .....")
open(os.path.join(out, "zero", "embed", "fp32.pt"), "wb").close()
time.sleep(0.4)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("work", ["compute", "sleep"])
def test_a_child_that_computes_without_a_word_moves_and_one_that_sleeps_does_not(tmp_path, work):
    """A converter importing torch and DeepSpeed prints and writes nothing for seconds (over
    10 s on a busy 2-core machine, where a resume under train.startup_timeout_s=20 was ended
    as stuck): its CPU time says it moves. The same silence asleep is no progress (the
    negative control: a stalled converter must still be found)."""
    from tape_train.progress import run_with_progress

    body = ("import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n"
            "    sum(range(10000))\n" if work == "compute" else "import time\ntime.sleep(3)\n")
    ticks = []
    code, _ = run_with_progress([sys.executable, "-c", body], what="child",
                                output_dir=tmp_path / "out", logger=logging.getLogger("t"),
                                tick=ticks.append, tick_s=0.3)
    assert code == 0 and len(ticks) >= 6, ticks
    later = ticks[3:]  # past the interpreter's own start-up, which computes
    if work == "compute":
        assert sum(later) >= len(later) - 1, ticks
    else:
        assert not any(later), ticks


@pytest.mark.parametrize("status", [0, 3])
def test_a_conversion_reports_progress_in_lines_and_its_last_output_when_it_fails(
        tmp_path, monkeypatch, caplog, status):
    """`ensure_universal` (resume on another layout, tape-export, tape-eval): DeepSpeed's stage
    lines and a line at least every LOG_EVERY_S with the time, files and bytes written and the
    bar's position, never a carriage return; `tick` hears that it moved; a failure carries the
    converter's last lines (the bar as its final state) and leaves no partial output."""
    import json
    import logging

    from tape_train import loading, progress

    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps({"files": {}, "zero_stage": 1}))
    script = tmp_path / "converter.py"
    script.write_text(_CONVERTER)
    # -u as converter_command's own: a piped child's print() is block-buffered, and without
    # it the stage lines arrived only at its exit wherever PYTHONUNBUFFERED is unset (a plain
    # shell's `make test`; .ci/run sets it)
    monkeypatch.setattr(loading, "converter_command", lambda tag_dir, out: [
        sys.executable, "-u", str(script), str(status), "--output_folder", str(out)])
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.5)
    ticks = []
    caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
    if status == 0:
        assert loading.ensure_universal(tag, tick=ticks.append, tick_s=0.2) == tag / "universal"
        assert (tag / "universal" / "zero" / "embed" / "fragment3").is_file()
    else:
        with pytest.raises(loading.CheckpointError) as failed:
            loading.ensure_universal(tag, tick=ticks.append, tick_s=0.2)
        message = str(failed.value)
        assert "failed (exit 3); the checkpoint itself is untouched" in message
        assert message.endswith("Last output:\nargs = Namespace(...)\n*** 1. Extracting ZeRO "
                                "fragments\n100%|####| 4/4 [00:02<00:00]\n*** 2. Merging "
                                "slices .....")
        assert not (tag / "universal").exists() and not list(tag.glob(".universal.tmp*"))
    lines = [r.getMessage() for r in caplog.records]
    assert not any("\r" in line for line in lines)
    # The time so far when the child printed it: its start-up alone can take a second when busy.
    assert any(re.fullmatch(r"universal conversion of step_00000004: 1\. Extracting ZeRO "
                            r"fragments \(\d+ s so far\)", line) for line in lines), lines
    assert any(line.startswith("universal conversion of step_00000004: 2. Merging slices (")
               for line in lines)
    periodic = [line for line in lines if " so far, " in line]
    assert periodic and any(" files (" in line and "KiB) written; 1. Extracting ZeRO "
                            "fragments, " in line for line in periodic), lines
    assert True in ticks and len(ticks) >= 5


@pytest.mark.parametrize("hf", [False, True])
def test_tape_export_says_what_it_reads_and_writes_before_each_long_stage(tmp_path, caplog, hf):
    """The checksum pass over the whole checkpoint and the write of the export take minutes at
    tens of GiB and printed nothing: each starts with one line saying what and how much."""
    import logging

    from tape_train.inference.export import main as export_main

    make_checkpoint(tmp_path / "run", "rope", seed=1)
    caplog.set_level(logging.INFO)
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                        *(["--hf"] if hf else [])]) == 0
    lines = [r.getMessage() for r in caplog.records]
    tag = tmp_path / "run" / "checkpoints" / "step_00000005"
    assert any(re.fullmatch(rf"checking {re.escape(str(tag))} against its checksums "
                            rf"\(\d+ files, [\d.]+ (B|KiB|MiB)\)", line) for line in lines), lines
    writing = [i for i, line in enumerate(lines)
               if line.startswith(f"writing {tmp_path / 'out'} (")]
    exported = [i for i, line in enumerate(lines) if line.startswith("exported rope")]
    assert writing and exported and writing[0] < exported[0], lines
    assert ("Hugging Face" if hf else "save_pretrained") in lines[writing[0]]


def test_a_child_printing_megabytes_without_a_newline_costs_neither_memory_nor_time(tmp_path):
    """16 MB of output with no line end (binary garbage, a huge repr) and then a last line:
    read in linear time, and the error's last lines stay short (the run's log and the
    CheckpointError would otherwise carry the whole 16 MB line, after minutes of re-splitting
    the growing pending text at every read)."""
    import logging
    import time

    from tape_train.progress import LINE_CHARS, run_with_progress

    child = ("import sys\nfor _ in range(256): sys.stdout.buffer.write(b'x' * 65536)\n"
             "print('\\nlast words')\nsys.exit(2)")
    started = time.monotonic()
    code, tail = run_with_progress([sys.executable, "-c", child], what="chatty child",
                                   output_dir=tmp_path / "none", logger=logging.getLogger("t"),
                                   tick_s=0.5)
    assert code == 2 and tail[-1] == "last words"
    assert all(len(line) <= LINE_CHARS + 2 for line in tail), [len(line) for line in tail]
    assert tail[-2].startswith("xxx") and tail[-2].endswith(" …")
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("converter", ["pass", "import os, sys; os.makedirs(sys.argv[1])"])
def test_a_converter_that_exits_0_without_parameters_has_failed(tmp_path, monkeypatch, converter):
    """Exit 0 with nothing written (or an empty folder): an error with its last output, and no
    `universal` cached that every later resume or export would take for the conversion."""
    import json

    from tape_train import loading

    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps({"files": {}, "zero_stage": 1}))
    monkeypatch.setattr(loading, "converter_command", lambda tag_dir, out: [
        sys.executable, "-c", f"print('all done'); {converter}", str(out)])
    with pytest.raises(loading.CheckpointError) as failed:
        loading.ensure_universal(tag, tick_s=0.2)
    assert "failed (exit 0 without writing zero/*/fp32.pt); the checkpoint itself is " \
           "untouched. Last output:\nall done" in str(failed.value)
    assert not (tag / "universal").exists() and not list(tag.glob(".universal.tmp*"))


# A converter that counts its runs and keeps writing until the test lets it finish.
_HELD_CONVERTER = r"""
import os, sys, time
count, release = sys.argv[1], sys.argv[2]
out = sys.argv[sys.argv.index("--output_folder") + 1]
with open(count, "a") as fh:
    fh.write("x")
os.makedirs(os.path.join(out, "zero", "embed"))
i = 0
while not os.path.exists(release):
    i += 1
    with open(os.path.join(out, "zero", "embed", f"part{i % 20}"), "wb") as fh:
        fh.write(b"x" * i)
    time.sleep(0.1)
open(os.path.join(out, "zero", "embed", "fp32.pt"), "wb").close()
"""


def _held_conversion(tmp_path, monkeypatch):
    """A complete ZeRO-1 tag, and ensure_universal's converter replaced by _HELD_CONVERTER.
    Returns (tag dir, file counting the conversions, file that lets them finish)."""
    import json

    from tape_train import loading

    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps({"files": {}, "zero_stage": 1}))
    script, count, release = (tmp_path / n for n in ("converter.py", "count", "release"))
    script.write_text(_HELD_CONVERTER)
    monkeypatch.setattr(loading, "converter_command", lambda tag_dir, out: [
        sys.executable, str(script), str(count), str(release), "--output_folder", str(out)])
    return tag, count, release


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("locking", [True, False])
def test_processes_needing_one_conversion_at_once_take_turns(tmp_path, monkeypatch, caplog,
                                                               locking):
    """The ranks of a multi-GPU tape-eval (or an eval job next to an export) convert the same
    tensor-parallel checkpoint at once: one converts, the other waits, saying so and hearing
    through `tick` that the conversion moves, then uses the result; nothing is left beside it.
    Before, each deleted the other's temporary output as "stale" and the first to finish broke
    the other. Negative control, no lock (a filesystem without flock): both convert, and both
    still get the universal checkpoint."""
    import contextlib
    import logging
    import threading

    from tape_train import loading

    tag, count, release = _held_conversion(tmp_path, monkeypatch)
    if not locking:
        monkeypatch.setattr(loading, "_conversion_lock",
                            contextlib.contextmanager(lambda target, **_: (yield False)))
    caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
    results, ticks = {}, []

    def convert(name, **kwargs):
        try:
            results[name] = loading.ensure_universal(tag, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results[name] = exc

    first = threading.Thread(target=convert, args=("first",))
    first.start()
    _wait_for(lambda: count.exists(), "the first conversion to start")
    second = threading.Thread(target=convert, args=("second",),
                              kwargs=dict(tick=ticks.append, tick_s=0.2))
    second.start()
    if locking:
        _wait_for(lambda: any(r.getMessage().startswith("waiting for ") for r in caplog.records),
                  "the second caller to wait")
        _wait_for(lambda: True in ticks, "a tick saying the conversion moves")
        assert count.read_text() == "x"
    else:
        _wait_for(lambda: count.read_text() == "xx", "the second conversion to start")
    release.touch()
    first.join(30)
    second.join(30)
    assert results == {"first": tag / "universal", "second": tag / "universal"}, results
    assert (tag / "universal" / "zero" / "embed" / "fp32.pt").is_file()
    assert sorted(p.name for p in tag.iterdir()) == ["COMPLETE.json", "universal"]
    assert count.read_text() == ("x" if locking else "xx")
    if locking:
        lines = [r.getMessage() for r in caplog.records]
        assert any(line.startswith("waiting for ") and " pid " in line
                   and "converting step_00000004 to the universal format" in line
                   for line in lines), lines
        assert f"universal checkpoint converted by another process: {tag / 'universal'}" in lines


def test_a_dead_converters_lock_and_leftovers_go_to_the_next(tmp_path, monkeypatch, caplog):
    """A converter killed mid-way: the kernel frees its lock; the process waiting for it
    converts, removing the dead one's partial output (but not while the lock was held)."""
    import logging
    import threading

    from tape_train import loading

    tag, count, release = _held_conversion(tmp_path, monkeypatch)
    release.touch()
    leftover = tag / ".universal.tmp4242"
    (leftover / "zero").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)"),
        str(tag / ".universal.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
        result = {}
        waiter = threading.Thread(target=lambda: result.update(
            path=loading.ensure_universal(tag, tick_s=0.2)))
        waiter.start()
        _wait_for(lambda: any(r.getMessage().startswith("waiting for ")
                              for r in caplog.records), "the waiting line")
        assert leftover.is_dir() and not count.exists()
    finally:
        holder.kill()
        holder.wait()
    waiter.join(30)
    assert result == {"path": tag / "universal"} and count.read_text() == "x"
    assert sorted(p.name for p in tag.iterdir()) == ["COMPLETE.json", "universal"]


def test_locks_lost_while_waiting_for_a_conversion_mean_converting_unlocked(
        tmp_path, monkeypatch, caplog):
    """A process waiting for another's conversion whose locks stop working (an NFS lock
    manager lost: ENOLCK) converts on its own, as on a filesystem without flock, with the
    same warning; before, the OSError ended it with a traceback."""
    import errno
    import fcntl
    import logging
    import threading

    from tape_train import loading

    tag, count, release = _held_conversion(tmp_path, monkeypatch)
    release.touch()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)"),
        str(tag / ".universal.lock")], stdout=subprocess.PIPE, text=True)
    real_flock, lost = fcntl.flock, threading.Event()

    def flock(fd, op):
        if lost.is_set():
            raise OSError(errno.ENOLCK, "No locks available")
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        assert holder.stdout.readline().strip() == "locked"
        caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
        result = {}

        def convert():
            try:
                result["path"] = loading.ensure_universal(tag, tick_s=0.2)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                result["path"] = exc

        waiter = threading.Thread(target=convert)
        waiter.start()
        _wait_for(lambda: any(r.getMessage().startswith("waiting for ")
                              for r in caplog.records), "the waiting line")
        lost.set()
        waiter.join(30)
    finally:
        holder.kill()
        holder.wait()
    assert result == {"path": tag / "universal"}, result
    assert count.read_text() == "x"
    assert any(r.levelname == "WARNING" and "cannot lock" in r.getMessage()
               and "No locks available" in r.getMessage() for r in caplog.records)


def test_readers_of_a_read_only_checkpoint_share_one_conversion_and_the_last_removes_it(
        tmp_path, monkeypatch, caplog):
    """Ranks of a multi-GPU tape-eval reading a tensor-parallel checkpoint in a directory they
    cannot write: one conversion into a scratch directory they share (not one per process: N
    copies of a large model's optimizer state), read by both, removed by the last reader."""
    import logging
    import threading

    import torch

    from tape_train import loading

    tag, count, release, scratch_root = _read_only_tag(tmp_path, monkeypatch)
    caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
    results = {}

    def read(name):
        try:
            results[name] = loading._read_universal_weights_of(tag)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results[name] = exc

    readers = [threading.Thread(target=read, args=(name,)) for name in ("first", "second")]
    readers[0].start()
    _wait_for(lambda: count.exists() or results, "the first conversion to start")
    assert not results, results
    readers[1].start()
    _wait_for(lambda: any(r.getMessage().startswith("waiting for ") for r in caplog.records),
              "the second reader to wait")
    release.touch()
    for reader in readers:
        reader.join(60)
    for name in ("first", "second"):
        assert isinstance(results.get(name), dict), results
        assert torch.equal(results[name]["embed"], torch.arange(3.0))
    assert count.read_text() == "x"  # converted once
    assert list(scratch_root.iterdir()) == [] and not (tag / "universal").exists()


def _read_only_tag(tmp_path, monkeypatch):
    """A complete tag that this process may not write (so it is read through a scratch
    conversion in the temp dir, here ``tmp_path/tmp``), converted by _HELD_CONVERTER writing
    the parameter ``embed`` = arange(3). Returns (tag, count, release, temp dir)."""
    import os
    import tempfile
    from pathlib import Path

    from tape_train import loading

    tag, count, release = _held_conversion(tmp_path, monkeypatch)
    (tmp_path / "converter.py").write_text(_HELD_CONVERTER.replace(
        'open(os.path.join(out, "zero", "embed", "fp32.pt"), "wb").close()',
        'import torch; torch.save({"param": torch.arange(3.0)}, '
        'os.path.join(out, "zero", "embed", "fp32.pt"))'))
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(scratch_root))
    real_access = os.access
    monkeypatch.setattr(loading.os, "access", lambda path, mode: False if Path(path) == tag
                        else real_access(path, mode))
    return tag, count, release, scratch_root


def _read_only_tag_with_a_real_converter(tmp_path, monkeypatch):
    """``_read_only_tag`` with its converter released: (tag, count, temp dir)."""
    tag, count, release, scratch_root = _read_only_tag(tmp_path, monkeypatch)
    release.touch()
    return tag, count, scratch_root


def _plant_universal(directory, value: float) -> None:
    import torch

    (directory / "universal" / "zero" / "embed").mkdir(parents=True)
    torch.save({"param": torch.full((3,), value)},
               directory / "universal" / "zero" / "embed" / "fp32.pt")


def test_a_temp_dir_without_flock_gives_each_reader_its_own_scratch(tmp_path, monkeypatch,
                                                                     caplog):
    """TMPDIR on NFS without locks (ENOLCK): the reader converts into a private directory,
    says why in one line, and removes it; before, the OSError ended tape-eval."""
    import errno
    import fcntl
    import logging

    import torch

    from tape_train import loading

    tag, count, scratch_root = _read_only_tag_with_a_real_converter(tmp_path, monkeypatch)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
    state = loading._read_universal_weights_of(tag)
    assert torch.equal(state["embed"], torch.arange(3.0)) and count.read_text() == "x"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(line.startswith(f"not sharing the universal conversion of {tag} in ")
               and "(cannot lock it: No locks available)" in line for line in lines), lines
    assert list(scratch_root.iterdir()) == []


@pytest.mark.parametrize("planted", ["open to all", "symlink"])
def test_a_scratch_dir_that_is_not_the_users_own_is_not_read(tmp_path, monkeypatch, caplog,
                                                              planted):
    """The shared scratch's name in a shared /tmp can be foreseen: a directory someone else
    made there (writable by others, or a link to theirs) is neither read nor removed; the
    reader converts into a private one. Before, its weights were loaded (torch.load, pickle)."""
    import logging

    import torch

    from tape_train import loading

    tag, count, scratch_root = _read_only_tag_with_a_real_converter(tmp_path, monkeypatch)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    _plant_universal(theirs, 99.0)
    if planted == "symlink":
        theirs.chmod(0o700)
        loading._scratch_path(tag).symlink_to(theirs)
    else:
        theirs.rename(loading._scratch_path(tag))
        theirs = loading._scratch_path(tag)
    caplog.set_level(logging.INFO, logger="tape_train.checkpoint")
    state = loading._read_universal_weights_of(tag)
    assert torch.equal(state["embed"], torch.arange(3.0)) and count.read_text() == "x"
    assert any("(it is not this user's own private directory)" in r.getMessage()
               for r in caplog.records), caplog.records
    assert (theirs / "universal" / "zero" / "embed" / "fp32.pt").is_file()
    assert [p.name for p in scratch_root.iterdir()] == [loading._scratch_path(tag).name]


def test_a_checkpoint_rewritten_in_place_is_not_read_from_an_old_scratch(tmp_path, monkeypatch):
    """A scratch conversion left by a killed reader is reused by the next reader of the same
    checkpoint (negative control), but not once the checkpoint was rewritten at the same path,
    also where the new marker kept the old one's mtime (a coarse clock, a copy keeping times)."""
    import json
    import os

    import torch

    from tape_train import loading

    tag, count, scratch_root = _read_only_tag_with_a_real_converter(tmp_path, monkeypatch)
    left = loading._scratch_path(tag)
    left.mkdir(mode=0o700)
    _plant_universal(left, 7.0)
    state = loading._read_universal_weights_of(tag)
    assert torch.equal(state["embed"], torch.full((3,), 7.0)) and not count.exists()
    assert list(scratch_root.iterdir()) == []  # the last reader removed it

    left.mkdir(mode=0o700)
    _plant_universal(left, 7.0)
    marker = tag / "COMPLETE.json"
    before = marker.stat()
    marker.write_text(json.dumps({"files": {}, "zero_stage": 1, "step": 8}))
    os.utime(marker, ns=(before.st_atime_ns, before.st_mtime_ns))
    state = loading._read_universal_weights_of(tag)
    assert torch.equal(state["embed"], torch.arange(3.0)) and count.read_text() == "x"


_LEAVING_READER = r"""
import fcntl, os, sys, tempfile, time
from pathlib import Path
tmp, tag, gate = sys.argv[1:4]
tempfile.gettempdir = lambda: tmp
def meet(stage):
    Path(gate, f"{stage}-{os.getpid()}").touch()
    while len([n for n in os.listdir(gate) if n.startswith(stage)]) < 2:
        time.sleep(0.01)
def flock(fd, op):  # as NFS emulates flock: POSIX locks, whose upgrade is atomic
    if op != fcntl.LOCK_EX | fcntl.LOCK_NB:
        return fcntl.lockf(fd, op)
    meet("leave")  # both readers try at once, neither one closing before the other tried
    try:
        fcntl.lockf(fd, op)
    finally:
        meet("tried")
fcntl.flock = flock
from tape_train import loading
with loading._shared_scratch(Path(tag)) as scratch:
    assert scratch.name.startswith("tape-universal-"), scratch
"""


def test_two_readers_leaving_at_once_remove_the_scratch_also_with_posix_locks(tmp_path):
    """flock emulated with POSIX locks (NFS), where a shared lock's upgrade is atomic: two
    readers leaving at the same moment each failed to upgrade, kept their shared lock, and
    neither removed the scratch conversion (a large model's fp32 state left in /tmp)."""
    import json
    import os

    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps({"files": {}, "zero_stage": 1}))
    scratch_root, gate = tmp_path / "tmp", tmp_path / "gate"
    scratch_root.mkdir()
    gate.mkdir()
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    readers = [subprocess.Popen([sys.executable, "-c", _LEAVING_READER, str(scratch_root),
                                 str(tag), str(gate)], env=env) for _ in range(2)]
    assert [reader.wait(60) for reader in readers] == [0, 0]
    assert len(list(gate.iterdir())) == 4  # both came to leave at the same time
    assert list(scratch_root.iterdir()) == []
