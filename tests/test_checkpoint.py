"""Checkpoint layout rules without DeepSpeed: completeness, rotation, failures, discovery.

A stand-in engine writes shard files the way DeepSpeed does (into ``<root>/<tag>/``); the
rules under test (marker written last, keep-k rotation, skip partial/corrupt tags, a failed
save leaves the previous checkpoint as the one to resume) live in
``tape_train.train.checkpoint``. The end-to-end versions with the real engine and SIGKILL are
in test_train_resume.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from tape_train.train import checkpoint as ckpt


class FakeEngine:
    """Writes two shard files per save; can fail half-way like a full disk."""

    def __init__(self) -> None:
        self.fail_with: OSError | None = None

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # `latest` is ours, written after the marker
        tag_dir = ckpt.Path(save_dir) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"m" * 64)
        if self.fail_with is not None:
            (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 10)
            raise self.fail_with
        (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o" * 128)


def _save(engine, run_dir, step, keep=2):
    return ckpt.save_checkpoint(engine, run_dir, step, rank=0,
                                meta={"step": step, "world_size": 1, "config": {}},
                                rank_state={"rng": ckpt.capture_rng_state(), "loader": None},
                                keep=keep)


def test_marker_lists_every_file_and_latest_is_written_last(tmp_path):
    tag = _save(FakeEngine(), tmp_path, 3)
    marker = json.loads((tag / ckpt.MARKER).read_text())
    assert set(marker["files"]) == {"zero_pp_rank_0_mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    ckpt.rank_state_name(0)}
    assert (tmp_path / "checkpoints" / ckpt.LATEST).read_text() == "step_00000003"
    assert ckpt.find_latest_complete(tmp_path) == tag
    assert ckpt.find_latest_complete(tmp_path / "checkpoints") == tag


def test_keep_k_rotation_deletes_only_older_complete_checkpoints(tmp_path):
    engine = FakeEngine()
    for step in (1, 2, 3, 4):
        _save(engine, tmp_path, step, keep=3)
    names = [p.name for p in ckpt.list_tags(tmp_path / "checkpoints")]
    assert names == ["step_00000002", "step_00000003", "step_00000004"]
    _save(engine, tmp_path, 5, keep=2)
    names = [p.name for p in ckpt.list_tags(tmp_path / "checkpoints")]
    assert names == ["step_00000004", "step_00000005"]


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path, caplog):
    engine = FakeEngine()
    good, no_marker, truncated, garbled = (_save(engine, tmp_path, s, keep=10)
                                           for s in (10, 20, 30, 40))
    (no_marker / ckpt.MARKER).unlink()                      # killed before the marker
    shard = truncated / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:7])               # size differs from the marker
    (garbled / ckpt.MARKER).write_text("{not json")
    with caplog.at_level("WARNING", logger="tape_train.train"):
        assert ckpt.find_latest_complete(tmp_path) == good
    text = caplog.text
    assert "step_00000040: unreadable" in text and "step_00000030: file" in text
    assert "step_00000020: no COMPLETE.json" in text
    with pytest.raises(ckpt.CheckpointError, match="not complete"):
        ckpt.resolve_checkpoint(no_marker)
    # The readers that never substitute an older step (tape-export, tape-eval) skip the save
    # that never finished (no marker or a garbled one) but refuse a finished one cut short,
    # as they refuse flipped bytes, naming the file and the older intact tag.
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_checkpoint(tmp_path)
    assert str(err.value).startswith(
        f"checkpoint {truncated}: file zero_pp_rank_0_mp_rank_00_optim_states.pt has 7 bytes")
    assert f"refusing to use it; an older complete checkpoint: {good}" in str(err.value)
    assert ckpt.resolve_checkpoint(tmp_path, verify=False) == good  # what a resume uses
    shutil.rmtree(truncated)
    assert ckpt.resolve_checkpoint(tmp_path) == good  # control: the unfinished are skipped
    # The next complete save garbage-collects the incomplete tags older than itself.
    _save(engine, tmp_path, 50, keep=2)
    assert [p.name for p in ckpt.list_tags(tmp_path / "checkpoints")] == [
        "step_00000010", "step_00000050"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   PermissionError(errno.EACCES, "Permission denied")])
def test_failed_save_keeps_previous_checkpoint_for_resume(tmp_path, error):
    engine = FakeEngine()
    previous = _save(engine, tmp_path, 5)
    engine.fail_with = error
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 6)
    msg = str(err.value)
    assert error.strerror in msg and str(previous) in msg
    assert not (tmp_path / "checkpoints" / "step_00000006").exists()  # partial removed
    assert ckpt.find_latest_complete(tmp_path) == previous
    assert (tmp_path / "checkpoints" / ckpt.LATEST).read_text() == "step_00000005"
    assert ckpt.why_incomplete(previous) is None  # untouched


@pytest.mark.parametrize("kind", ["file", "dangling symlink"])
def test_a_file_where_the_tag_goes_is_named_and_left_alone(tmp_path, kind):
    """A regular file (or a link to nothing) named like the tag being saved: the save said
    only "File exists". Now it names the path and what to do, deletes nothing, and the
    previous checkpoint stays the one to resume from."""
    engine = FakeEngine()
    previous = _save(engine, tmp_path, 5)
    stray = tmp_path / "checkpoints" / "step_00000006"
    stray.write_text("mine") if kind == "file" else stray.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 6)
    what = "a file" if kind == "file" else "a symbolic link"
    assert str(err.value) == (
        f"cannot save checkpoint {stray}: {what} of that name is there, not a checkpoint "
        f"directory, and the save of step 6 writes a directory there: move it away (it is not "
        f"deleted); previous complete checkpoint: {previous} (a re-run resumes from it)")
    assert os.path.lexists(stray) and not stray.is_dir()
    assert ckpt.find_latest_complete(tmp_path) == previous
    stray.unlink()
    assert ckpt.why_incomplete(_save(engine, tmp_path, 6)) is None  # control


def test_leftover_partial_tag_is_replaced_and_complete_tag_not_rewritten(tmp_path):
    engine = FakeEngine()
    tag = tmp_path / "checkpoints" / "step_00000007"
    tag.mkdir(parents=True)
    (tag / "junk").write_text("from a killed save")
    _save(engine, tmp_path, 7)
    assert not (tag / "junk").exists() and ckpt.why_incomplete(tag) is None
    before = (tag / ckpt.MARKER).read_text()
    engine.fail_with = OSError(errno.EIO, "should not be called")
    _save(engine, tmp_path, 7)  # already complete: nothing is written
    assert (tag / ckpt.MARKER).read_text() == before



def test_a_rewind_moves_the_newer_tags_aside_so_the_new_trajectory_writes_its_own(tmp_path,
                                                                                 monkeypatch):
    engine = FakeEngine()
    for step in (2, 4, 6, 8):
        _save(engine, tmp_path, step, keep=5)
    root = tmp_path / "checkpoints"
    damaged = root / "step_00000008"  # skipped at resume for its checksums: rewritten in place
    old_marker = (root / "step_00000004" / ckpt.MARKER).read_text()
    monkeypatch.setattr(ckpt.time, "strftime", lambda *a: "20260101T000000Z")
    moved, dest = ckpt.set_aside_newer(root, 2, damaged={damaged.name})
    assert [t.name for t in moved] == ["step_00000004", "step_00000006"]
    assert dest == root / "superseded" / "20260101T000000Z"
    assert [t.name for t in ckpt.list_tags(root)] == ["step_00000002", "step_00000008"]
    assert (root / ckpt.LATEST).read_text() == "step_00000008"
    # Nothing lost: each moved tag is complete where it went and loadable by its path.
    for name in ("step_00000004", "step_00000006"):
        assert ckpt.why_incomplete(dest / name) is None
        assert ckpt.resolve_checkpoint(dest / name) == dest / name
    # The replay writes its own step 4 (before, the old one was kept as "already complete"),
    # and rotation never reaches the tags set aside.
    _save(engine, tmp_path, 4, keep=2)
    assert (root / "step_00000004" / ckpt.MARKER).read_text() != old_marker
    _save(engine, tmp_path, 10, keep=3)
    assert [t.name for t in ckpt.list_tags(root)] == ["step_00000004", "step_00000008",
                                                       "step_00000010"]
    assert sorted(p.name for p in dest.iterdir()) == ["step_00000004", "step_00000006"]
    # A second rewind in the same second gets its own directory; nothing newer: no-op.
    shutil.rmtree(damaged)
    moved, second = ckpt.set_aside_newer(root, 4)
    assert [t.name for t in moved] == ["step_00000010"] and second.name == "20260101T000000Z-2"
    assert (root / ckpt.LATEST).read_text() == "step_00000004"
    assert ckpt.set_aside_newer(root, 4) == ([], None)


def _rotate_away(tag) -> None:
    """What rotation by a training run on the same run dir does to a tag: marker first."""
    (tag / ckpt.MARKER).unlink()
    shutil.rmtree(tag)


def test_a_checkpoint_deleted_while_a_reader_reads_it_is_named_as_such(tmp_path, monkeypatch):
    from tape_train import checkpoint_layout, loading

    tag = _save(FakeEngine(), tmp_path, 3)
    checksum = checkpoint_layout.file_checksum

    def rotated_mid_check(path):  # deleted while its checksums are being read
        if tag.exists():
            _rotate_away(tag)
        return checksum(path)

    monkeypatch.setattr(checkpoint_layout, "file_checksum", rotated_mid_check)
    with pytest.raises(ckpt.CheckpointError, match="was deleted while it was being read") as err:
        loading.load_model_from_checkpoint(tmp_path)
    assert str(tag) in str(err.value) and "checkpoint.keep" in str(err.value)
    assert "damaged" not in str(err.value)
    monkeypatch.setattr(checkpoint_layout, "file_checksum", checksum)

    tag = _save(FakeEngine(), tmp_path, 4)
    resolve = loading.resolve_checkpoint

    def rotated_after_check(path, verify=True):  # deleted between the check and the load
        found = resolve(path, verify=verify)
        _rotate_away(found)
        return found

    monkeypatch.setattr(loading, "resolve_checkpoint", rotated_after_check)
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {tag} was deleted while"):
        loading.load_model_from_checkpoint(tmp_path)
    # Negative control: a tag still in place that cannot be read is not called deleted.
    monkeypatch.setattr(loading, "resolve_checkpoint", resolve)
    tag = _save(FakeEngine(), tmp_path, 5)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 128)
    with pytest.raises(ckpt.CheckpointError) as err:
        loading.load_model_from_checkpoint(tag)
    assert "damaged" in str(err.value) and "was deleted while" not in str(err.value)


def test_a_held_checkpoint_stays_readable_after_its_run_deletes_it(tmp_path, monkeypatch):
    """``held_checkpoint``: the block reads a mirror of the tag whose files were opened on
    entry, so rotation (``_rotate_away``) takes nothing from it; on exit the files are closed
    and the mirror is gone. It yields the tag itself where it cannot hold it: too few file
    descriptors, or a tensor-parallel tag without its universal form (converted in the tag)."""
    import json
    import os

    from tape_train import loading

    tag = _save(FakeEngine(), tmp_path, 3)
    files = sorted(str(p.relative_to(tag)) for p in tag.rglob("*") if p.is_file())
    contents = {name: (tag / name).read_bytes() for name in files}
    fds_before = len(os.listdir("/proc/self/fd"))
    with loading.held_checkpoint(tag) as held:
        assert held != tag and held.name == tag.name
        _rotate_away(tag)
        assert sorted(str(p.relative_to(held)) for p in held.rglob("*") if p.is_file()) == files
        assert {name: (held / name).read_bytes() for name in files} == contents
        assert ckpt.resolve_checkpoint(held, verify=True) == held  # checksums hold too
    assert not held.exists() and len(os.listdir("/proc/self/fd")) == fds_before

    tag = _save(FakeEngine(), tmp_path, 4)
    monkeypatch.setattr(loading, "_fd_room", lambda n, fd_dir: False)
    with loading.held_checkpoint(tag) as held:
        assert held == tag
    monkeypatch.undo()
    marker = json.loads((tag / ckpt.MARKER).read_text())
    marker["layout"] = {"dp": 1, "sp": 1, "tp": 2}
    (tag / ckpt.MARKER).write_text(json.dumps(marker))
    assert loading.saved_layout(marker)["tp"] == 2
    with loading.held_checkpoint(tag) as held:
        assert held == tag
    (tag / ckpt.UNIVERSAL).mkdir()  # converted already: held like any other
    with loading.held_checkpoint(tag) as held:
        assert held != tag


def test_a_reader_names_the_run_that_may_be_writing_a_tag_without_its_marker(tmp_path, caplog):
    older = _save(FakeEngine(), tmp_path, 2)
    (tmp_path / "checkpoints" / "step_00000004").mkdir()   # a save under way (or abandoned)
    caplog.set_level("WARNING")
    assert ckpt.resolve_checkpoint(tmp_path) == older
    assert "no COMPLETE.json (the save was interrupted or failed)" in caplog.text  # no run
    caplog.clear()
    (tmp_path / "RUN.lock").write_text("{}")                # a run holds the directory
    assert ckpt.resolve_checkpoint(tmp_path) == older
    assert f"being written by the run that holds {tmp_path / 'RUN.lock'}" in caplog.text

def test_no_checkpoint_at_all(tmp_path):
    assert ckpt.find_latest_complete(tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_checkpoint(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.resolve_checkpoint(tmp_path / "missing")


GARBLED_MARKERS = {
    "a list": lambda m: [m],
    "files null": lambda m: {**m, "files": None},
    "files a list": lambda m: {**m, "files": list(m["files"])},
    "a size as text": lambda m: {**m, "files": {k: str(v) for k, v in m["files"].items()}},
    "checksums a list": lambda m: {**m, "checksums": list(m["checksums"])},
    "config a string": lambda m: {**m, "config": "model: tiny"},
}


@pytest.mark.parametrize("garble", list(GARBLED_MARKERS))
def test_a_marker_that_parses_but_is_garbled_is_skipped_and_refused(tmp_path, caplog, garble):
    """Valid JSON of the wrong shape (edited by hand, damaged on disk) is skipped like a marker
    that does not parse, naming what is wrong, instead of an AttributeError in whichever
    reader meets it first (resume, tape-export, tape-eval)."""
    engine = FakeEngine()
    older, newer = _save(engine, tmp_path, 1, keep=3), _save(engine, tmp_path, 2, keep=3)
    assert ckpt.find_latest_intact(tmp_path) == newer  # negative control: the marker as saved
    marker = ckpt.read_marker(newer)
    (newer / ckpt.MARKER).write_text(json.dumps(GARBLED_MARKERS[garble](marker)))
    with caplog.at_level("WARNING", logger="tape_train.train"):
        assert ckpt.find_latest_intact(tmp_path) == older
        assert ckpt.find_latest_complete(tmp_path) == older
    assert f"skipping checkpoint {newer}: unreadable {ckpt.MARKER} (" in caplog.text
    with pytest.raises(ckpt.CheckpointError, match="is not complete: unreadable COMPLETE.json"):
        ckpt.resolve_checkpoint(newer)
    assert ckpt.resolve_checkpoint(tmp_path) == older


def test_a_marker_without_a_model_config_is_named_when_loading(tmp_path):
    tag = _save(FakeEngine(), tmp_path, 3)  # meta's config is {}: no model section
    with pytest.raises(ckpt.CheckpointError, match="records no model config") as err:
        ckpt.load_model_from_checkpoint(tmp_path)
    assert str(tag / ckpt.MARKER) in str(err.value)


def test_a_file_given_as_a_checkpoint_is_named_as_a_file(tmp_path):
    _save(FakeEngine(), tmp_path / "run", 3)
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\n")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_checkpoint(config)
    assert f"checkpoint path {config} is a file, not a directory" in str(err.value)
    assert "no complete checkpoint under" not in str(err.value)  # not "under run.yaml/..."
    assert ckpt.resolve_checkpoint(tmp_path / "run").name == "step_00000003"  # control


def test_an_export_given_as_a_checkpoint_is_named_as_an_export(tmp_path):
    from tape_train.model.pretrained import PROVENANCE

    export = tmp_path / "export"
    export.mkdir()
    (export / PROVENANCE).write_text(json.dumps({"source": "runs/demo", "step": 3}))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_checkpoint(export)
    assert f"{export} is a model export (it holds export.json), not a training checkpoint" in \
        str(err.value)
    # Negative control: a run directory is still searched for its checkpoints.
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint under"):
        ckpt.resolve_checkpoint(tmp_path)


def test_rng_state_round_trip():
    import random

    import numpy as np
    import torch

    state = ckpt.capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


# ----------------------------------------------------------------------------------------------
# Fault injection: flipped bytes, full disk, a save that is not the lock holder's
# ----------------------------------------------------------------------------------------------


def _flip_byte(path, offset=17):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))  # same size: the size check cannot see it


def test_marker_records_a_checksum_for_every_file(tmp_path):
    tag = _save(FakeEngine(), tmp_path, 3)
    marker = ckpt.read_marker(tag)
    assert marker["checksum"] == "xxh3_64" and set(marker["checksums"]) == set(marker["files"])
    for name, digest in marker["checksums"].items():
        assert ckpt.file_checksum(tag / name) == digest
    assert ckpt.verify_files(tag) is None


def test_flipped_bytes_skip_the_checkpoint_and_tools_refuse_it(tmp_path, caplog):
    engine = FakeEngine()
    older, newer = _save(engine, tmp_path, 1, keep=3), _save(engine, tmp_path, 2, keep=3)
    shard = newer / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    _flip_byte(shard)
    assert shard.stat().st_size == size and ckpt.why_incomplete(newer) is None
    # The training resume skips it with one line naming the file, and takes the older one.
    with caplog.at_level("WARNING", logger="tape_train.train"):
        assert ckpt.find_latest_intact(tmp_path) == older
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(shard) in lines[0] and "damaged" in lines[0]
    # Export/eval refuse it, explicitly or as the latest of the run dir, and name the file.
    for path in (newer, tmp_path):
        with pytest.raises(ckpt.CheckpointError, match="damaged") as err:
            ckpt.resolve_checkpoint(path)
        assert str(shard) in str(err.value) and str(older) in str(err.value)
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.load_model_from_checkpoint(tmp_path)
    # Negative control: the same byte flipped back makes it intact again.
    _flip_byte(shard)
    assert ckpt.find_latest_intact(tmp_path) == newer
    assert ckpt.resolve_checkpoint(tmp_path) == newer


def test_a_damaged_newer_tag_never_takes_the_place_of_an_intact_one(tmp_path):
    """keep=2, the newest tag damaged (its sizes still right): the resume takes the older one
    and records the damaged one; the next save keeps two intact checkpoints besides it, where
    it used to count the damaged tag among the two and delete the older intact one."""
    def scenario(run_dir, known: bool) -> list[str]:
        engine = FakeEngine()
        _save(engine, run_dir, 3), _save(engine, run_dir, 4)
        _flip_byte(run_dir / "checkpoints" / "step_00000004" /
                   "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        damaged: set[str] = set()
        assert ckpt.find_latest_intact(run_dir, warn=False, damaged=damaged).name == \
            "step_00000003"
        assert damaged == {"step_00000004"}
        ckpt.save_checkpoint(engine, run_dir, 5, rank=0, meta={"step": 5, "config": {}},
                             rank_state={}, keep=2, damaged=damaged if known else set())
        return [t.name for t in ckpt.list_tags(run_dir / "checkpoints")]

    assert scenario(tmp_path / "a", known=True) == ["step_00000003", "step_00000004",
                                                    "step_00000005"]
    # Negative control: rotation without the knowledge keeps one intact checkpoint of two.
    assert scenario(tmp_path / "b", known=False) == ["step_00000004", "step_00000005"]
    # Later saves delete the damaged tag once it is older than the oldest kept intact one.
    engine, damaged = FakeEngine(), {"step_00000004"}
    ckpt.save_checkpoint(engine, tmp_path / "a", 10, rank=0, meta={"step": 10}, rank_state={},
                         keep=2, damaged=damaged)
    assert [t.name for t in ckpt.list_tags(tmp_path / "a" / "checkpoints")] == [
        "step_00000005", "step_00000010"]


def test_a_damaged_tag_rewritten_by_the_replay_counts_again(tmp_path):
    engine = FakeEngine()
    _save(engine, tmp_path, 3), _save(engine, tmp_path, 4)
    tag4 = tmp_path / "checkpoints" / "step_00000004"
    _flip_byte(tag4 / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    damaged: set[str] = set()
    ckpt.find_latest_intact(tmp_path, warn=False, damaged=damaged)
    ckpt.save_checkpoint(engine, tmp_path, 4, rank=0, meta={"step": 4}, rank_state={}, keep=2,
                         damaged=damaged)  # the replay reaches the damaged step: rewritten
    assert ckpt.verify_files(tag4) is None
    assert [t.name for t in ckpt.list_tags(tmp_path / "checkpoints")] == [
        "step_00000003", "step_00000004"]


def test_a_marker_without_checksums_still_loads(tmp_path):
    """Checkpoints written before checksums existed: sizes are all there is to check."""
    tag = _save(FakeEngine(), tmp_path, 4)
    marker = ckpt.read_marker(tag)
    del marker["checksums"], marker["checksum"]
    (tag / ckpt.MARKER).write_text(json.dumps(marker))
    assert ckpt.resolve_checkpoint(tmp_path) == tag and ckpt.find_latest_intact(tmp_path) == tag


def test_disk_full_during_a_save_says_so_with_bytes_needed_and_free(tmp_path, monkeypatch):
    engine = FakeEngine()
    previous = _save(engine, tmp_path, 5)
    needed = sum(ckpt.read_marker(previous)["files"].values())
    # What torch.save really raises on a full disk: no errno, no "space" in the text.
    engine.fail_with = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                                    "4096 vs 4030")
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 123)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 6)
    msg = str(err.value)
    assert "no space left on device" in msg and str(tmp_path / "checkpoints") in msg
    assert f"({needed} bytes)" in msg and "(123 bytes) free" in msg and str(previous) in msg
    assert ckpt.find_latest_complete(tmp_path) == previous and ckpt.verify_files(previous) is None
    # Negative control: the same failure with plenty of space is not called a full disk.
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 10**12)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 6)
    assert "no space left" not in str(err.value) and "unexpected pos" in str(err.value)


class TorchSaveLikeEngine(FakeEngine):
    """Like DeepSpeed: the tag directory is made elsewhere (or not), and torch.save into a
    directory that does not exist says only "Parent directory ... does not exist"."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        tag_dir = ckpt.Path(save_dir) / tag
        if not tag_dir.is_dir():
            raise RuntimeError(f"Parent directory {tag_dir} does not exist.")
        return super().save_checkpoint(save_dir, tag, client_state, save_latest)


def test_an_unwritable_checkpoint_directory_is_named_with_its_error(tmp_path, monkeypatch):
    """A checkpoints directory that became read-only (root ignores permissions: the mkdir is
    made to fail as on a read-only mount): the error names the tag and the OS's reason, not
    torch's "Parent directory ... does not exist", and what a re-run resumes from."""
    engine = TorchSaveLikeEngine()
    previous = _save(engine, tmp_path, 4)  # negative control: saves as usual
    real_mkdir = ckpt.Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name.startswith("step_"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(ckpt.Path, "mkdir", read_only)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 5)
    tag = tmp_path / "checkpoints" / "step_00000005"
    assert f"cannot create checkpoint {tag}: {tag}: Read-only file system" in str(err.value)
    assert f"previous complete checkpoint: {previous} (a re-run resumes from it)" in str(err.value)
    assert "does not exist" not in str(err.value)
    assert ckpt.find_latest_intact(tmp_path) == previous


def test_a_failed_first_save_says_a_rerun_starts_at_step_0_and_needs_at_least(tmp_path,
                                                                             monkeypatch):
    engine = FakeEngine()
    engine.fail_with = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 5)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 1)
    msg = str(err.value)
    # What the failed save had written (64 + 10 bytes) is only a lower bound of its size.
    assert "a checkpoint needs at least 74 B (74 bytes), 5 B (5 bytes) free" in msg
    assert msg.endswith("no previous complete checkpoint (a re-run starts at step 0)"), msg
    assert "none (a re-run resumes from it)" not in msg


def test_a_file_size_limit_is_named_with_the_limit(tmp_path, monkeypatch):
    import resource

    engine = FakeEngine()
    _save(engine, tmp_path, 1)
    engine.fail_with = OSError(errno.EFBIG, "File too large")
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (2048, hard) if which == resource.RLIMIT_FSIZE else (-1, -1)))
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 2)
    assert ("reached this process's file-size limit of 2.0 KiB (2048 bytes; `ulimit -f`)"
            in str(err.value))
    # Negative control: without a limit, the same error is only the OS's.
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 2)
    assert "file-size limit" not in str(err.value) and "File too large" in str(err.value)


def test_enospc_from_the_marker_write_names_the_path(tmp_path, monkeypatch):
    from tape_train import files

    def full(fd, *args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError) as err:
        files.write_atomic(tmp_path / "report.json", b"x" * 1000)
    msg = str(err.value)
    assert f"no space left on device writing {tmp_path / 'report.json'}" in msg
    assert "(1000 bytes)" in msg and "free" in msg
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left behind


def test_a_failed_marker_write_removes_its_tag_and_says_what_a_rerun_starts_from(tmp_path,
                                                                                 monkeypatch):
    """The marker could not be written (a disk full by then): the error said "the previous
    complete checkpoint is untouched" also when there was none, and left the tag without its
    marker holding the space of a whole checkpoint on the full disk."""
    engine = FakeEngine()
    write_atomic = ckpt.write_atomic

    def full(path, data):
        if ckpt.Path(path).name == ckpt.MARKER:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_atomic(path, data)

    monkeypatch.setattr(ckpt, "write_atomic", full)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 2)
    assert "the partial checkpoint was removed; no previous complete checkpoint (a re-run " \
           "starts at step 0)" in str(err.value), err.value
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()
    monkeypatch.setattr(ckpt, "write_atomic", write_atomic)
    _save(engine, tmp_path, 2)  # control: with room, the same save is complete
    monkeypatch.setattr(ckpt, "write_atomic", full)
    with pytest.raises(ckpt.CheckpointError) as err:
        _save(engine, tmp_path, 4)
    assert f"previous complete checkpoint: {tmp_path / 'checkpoints' / 'step_00000002'}" in \
        str(err.value)
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()
    assert ckpt.find_latest_complete(tmp_path / "checkpoints").name == "step_00000002"


class _Owner:
    def __init__(self, held):
        self.held = held

    def verify(self):
        if not self.held:
            raise RuntimeError("the lock RUN.lock is no longer held by this run")


def test_a_save_never_deletes_a_tag_when_the_run_lost_its_lock(tmp_path):
    engine = FakeEngine()
    other = tmp_path / "checkpoints" / "step_00000007"
    other.mkdir(parents=True)
    (other / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"being written")
    with pytest.raises(ckpt.CheckpointError, match="no longer held"):
        ckpt.save_checkpoint(engine, tmp_path, 7, rank=0, meta={"step": 7}, keep=2,
                             rank_state={"rng": None, "loader": None}, owner=_Owner(False))
    assert (other / "zero_pp_rank_0_mp_rank_00_model_states.pt").read_bytes() == b"being written"
    # Negative control: the lock holder replaces a leftover partial tag.
    ckpt.save_checkpoint(engine, tmp_path, 7, rank=0, meta={"step": 7}, keep=2,
                         rank_state={"rng": None, "loader": None}, owner=_Owner(True))
    assert ckpt.why_incomplete(other) is None
