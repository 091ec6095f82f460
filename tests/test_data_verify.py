"""`tape-data info DIR --verify`: every file a prepared directory's manifest lists, against its
size and sha256; missing and unlisted shard files; a manifest it cannot read."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tape_train.data import cli as data_cli
from tape_train.data.testing import real_text_documents, write_jsonl
from tape_train.data.verify import verify_corpus

SHARD = "train-00001-of-00003.jsonl.zst"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    write_jsonl(root / "in" / "a.jsonl", [t[:600] for t in real_text_documents(60)])
    return root


@pytest.fixture(scope="module")
def prepared(inputs):
    out = inputs / "text"
    assert data_cli.main(["prepare", "--input", str(inputs / "in"), "--out", str(out),
                          "--num-shards", "3", "--eval-fraction", "0.2"]) == 0
    return out


@pytest.fixture(scope="module")
def tokenised(inputs, tok):
    out = inputs / "tokens"
    assert data_cli.main(["prepare", "--input", str(inputs / "in"), "--out", str(out),
                          "--num-shards", "3", "--eval-fraction", "0.2", "--tokenize",
                          "--tokenizer", tok.path]) == 0
    return out


@pytest.fixture
def copy(prepared, tmp_path):
    """A copy of the prepared corpus, to damage."""
    return shutil.copytree(prepared, tmp_path / "copy")


def verify(directory, capsys, *extra) -> tuple[int, str, list[str]]:
    """(exit status, stdout, the error lines of stderr) of `tape-data info DIR --verify`."""
    capsys.readouterr()
    rc = data_cli.main(["info", str(directory), "--verify", *extra])
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "Traceback" not in err
    return rc, out, [line for line in err.splitlines() if line.startswith("tape-data:")]


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_intact_corpus_verifies(prepared, capsys):
    manifest = json.loads((prepared / "manifest.json").read_text())
    total = sum(shard["file_bytes"] for shard in manifest["shards"])
    rc, out, errors = verify(prepared, capsys)
    assert rc == 0 and errors == []
    assert out.startswith(f"tape-data: {prepared}: verified 4 files (4 text shards), "
                          f"{total:,} bytes (")
    assert out.rstrip().endswith("every size and sha256 matches manifest.json")
    assert len(out.splitlines()) == 1


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize("damage, name, problem", [
    (lambda d: flip_a_byte(d / SHARD), SHARD, "checksum mismatch: sha256 "),
    (lambda d: _truncate(d / SHARD), SHARD, "size mismatch: "),
    (lambda d: (d / "eval-00000-of-00001.jsonl.zst").unlink(), "eval-00000-of-00001.jsonl.zst",
     "missing"),
    (lambda d: (d / "train-00000-of-00008.jsonl.zst").write_bytes(b"x"),
     "train-00000-of-00008.jsonl.zst", "unlisted: named like a shard, but manifest.json does "
                                       "not list it"),
    (lambda d: (d / SHARD).unlink() or (d / SHARD).mkdir(), SHARD, "not a file"),
], ids=["byte flipped", "truncated", "deleted", "extra shard", "a directory"])
@pytest.mark.parametrize("workers", ["1", "3"])
def test_one_damaged_file_is_named_with_what_is_wrong(copy, capsys, damage, name, problem,
                                                      workers):
    assert verify(copy, capsys, "--workers", workers)[0] == 0  # control: the copy is intact
    damage(copy)
    rc, out, errors = verify(copy, capsys, "--workers", workers)
    assert rc == 1 and out == ""
    assert len(errors) == 2, errors  # the file's line, then the final line
    assert errors[0].startswith(f"tape-data: error: {copy / name}: {problem}")
    assert errors[1].startswith(f"tape-data: error: {copy}: verify failed: ")


def test_every_damage_at_once_gets_its_line_and_a_count(copy, capsys):
    shard = copy / SHARD
    size = shard.stat().st_size
    flip_a_byte(copy / "train-00000-of-00003.jsonl.zst")
    _truncate(shard)
    (copy / "eval-00000-of-00001.jsonl.zst").unlink()
    (copy / "train-00000-of-00003.tokens").write_bytes(b"\0\0")
    rc, _, errors = verify(copy, capsys)
    assert rc == 1
    assert errors == [
        f"tape-data: error: {copy / 'train-00000-of-00003.jsonl.zst'}: checksum mismatch: "
        + errors[0].split("checksum mismatch: ")[1],
        f"tape-data: error: {shard}: size mismatch: {size:,} bytes expected, {size - 7:,} "
        f"found (cut short)",
        f"tape-data: error: {copy / 'eval-00000-of-00001.jsonl.zst'}: missing",
        f"tape-data: error: {copy / 'train-00000-of-00003.tokens'}: unlisted: named like a "
        f"shard, but manifest.json does not list it (left from another prepare, or a corpus "
        f"copied over another?)",
        f"tape-data: error: {copy}: verify failed: 3 of 4 listed files bad (1 checksum "
        f"mismatch, 1 size mismatch, 1 missing); 1 shard-named file(s) not listed: copy the "
        f"named files again from where the corpus was prepared (or re-run `tape-data prepare "
        f"--force`); delete the unlisted files (a glob such as train-*.jsonl.zst would read "
        f"them)"]
    # The summary, which only checks sizes, points at --verify.
    assert data_cli.main(["info", str(copy)]) == 1
    assert f"`tape-data info {copy} --verify` names what is wrong" in capsys.readouterr().err


def test_a_read_error_is_named_with_the_bytes_read_before_it(copy, capsys, monkeypatch):
    import errno
    import io

    from tape_train.data import verify as verify_module

    class FailingRead(io.FileIO):
        def readinto(self, buffer):
            if self.tell() > 0:  # the first read succeeds, the second fails (a bad sector)
                raise OSError(errno.EIO, "Input/output error")
            return super().readinto(memoryview(buffer)[:1000])

    def failing_open(path, mode="r", buffering=-1):
        return FailingRead(path, "rb") if str(path).endswith(SHARD) else open(path, mode,
                                                                             buffering)

    monkeypatch.setattr(verify_module, "open", failing_open, raising=False)
    rc, _, errors = verify(copy, capsys)
    assert rc == 1 and len(errors) == 2
    assert errors[0] == (f"tape-data: error: {copy / SHARD}: unreadable: Input/output error, "
                         f"after 1,000 bytes")


def test_a_tokenised_corpus_verifies_its_token_files(tokenised, tmp_path, capsys):
    rc, out, _ = verify(tokenised, capsys)
    assert rc == 0 and "verified 7 files (4 text shards, 3 token shards)" in out
    copy = shutil.copytree(tokenised, tmp_path / "copy")
    flip_a_byte(copy / "train-00002-of-00003.tokens")
    rc, _, errors = verify(copy, capsys)
    assert rc == 1 and len(errors) == 2
    assert errors[0].startswith(f"tape-data: error: {copy / 'train-00002-of-00003.tokens'}: "
                                f"checksum mismatch")


@pytest.mark.parametrize("manifest, message", [
    (None, "manifest.json: no such file: "),
    ("{\"format\": \"tape-data/1\", ", "manifest.json: not valid JSON ("),
    ("[1, 2]", "manifest.json: a JSON list, not an object"),
    ("{\"format\": \"other/2\", \"shards\": []}", "manifest.json: format 'other/2', not "
                                               "'tape-data/1'"),
    ("{\"format\": \"tape-data/1\"}", "manifest.json: shards is missing"),
    ("{\"format\": \"tape-data/1\", \"shards\": [{\"path\": \"../x\", \"file_bytes\": 1, "
     "\"sha256\": \"" + "0" * 64 + "\"}]}", "manifest.json: shards[0]: path '../x' is not a "
                                           "file name in the directory"),
    ("{\"format\": \"tape-data/1\", \"shards\": [{\"path\": \"x\", \"file_bytes\": \"1\", "
     "\"sha256\": \"" + "0" * 64 + "\"}]}", "manifest.json: shards[0] (x): file_bytes '1' is "
                                           "not a size in bytes"),
], ids=["missing", "cut short", "a list", "other format", "no shards", "a path outside",
        "a size as text"])
def test_a_manifest_it_cannot_read_is_one_line(copy, capsys, manifest, message):
    if manifest is None:
        (copy / "manifest.json").unlink()
    else:
        (copy / "manifest.json").write_text(manifest)
    rc, out, errors = verify(copy, capsys)
    assert rc == 1 and out == ""
    assert len(errors) == 1 and errors[0].startswith(f"tape-data: error: {copy / message}")


def test_verify_s_flags_need_it_and_a_positive_thread_count(prepared, capsys):
    assert data_cli.main(["info", str(prepared), "--workers", "2"]) == 1
    assert "--workers goes with --verify" in capsys.readouterr().err
    assert data_cli.main(["info", str(prepared), "--progress", "on"]) == 1
    assert "--progress goes with --verify" in capsys.readouterr().err
    assert data_cli.main(["info", str(prepared), "--verify", "--workers", "0"]) == 1
    assert "--workers must be positive, got 0" in capsys.readouterr().err


def test_progress_off_a_terminal_is_log_lines(prepared, caplog):
    with caplog.at_level(logging.INFO, logger="tape_train.data"):
        report = verify_corpus(prepared, workers=2, progress="auto", every_s=0.0)
    assert report.ok and report.hashed_bytes > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("verify: ")]
    assert lines[0].startswith(f"verify: hashing 4 file(s) of {prepared} (")
    assert any(" (100 %), " in line for line in lines[1:]), lines


def test_a_bad_record_in_a_prepared_shard_points_to_verify(copy, tmp_path):
    """prepare writes valid records only: a malformed one read from its shard (damaged after
    it was written, yet still a valid zstd stream) names `tape-data info DIR --verify`; the
    same line in a raw JSONL file does not (there it is the input's own mistake)."""
    import zstandard

    from tape_train.data import DataError
    from tape_train.data.formats import Shard, SkipLog, read_documents

    shard = copy / SHARD
    lines = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
    lines = lines.splitlines(keepends=True)
    lines[1] = b'{"text": "cut off\n'
    shard.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines)))
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(b"".join(lines))

    def error(path, compression):
        with pytest.raises(DataError) as info:
            list(read_documents(Shard("jsonl", str(path), compression), 0, "text", False,
                                SkipLog()))
        return str(info.value)

    damaged = error(shard, "zst")
    assert f"{shard}:2: malformed JSON" in damaged
    assert f"tape-data info {copy} --verify" in damaged
    plain = error(raw, "")
    assert f"{raw}:2: malformed JSON" in plain and "--verify" not in plain


def test_a_byte_changed_anywhere_in_a_prepared_shard_fails_its_read(copy):
    """Without `--verify`: a shard's zstd frames carry their content's checksum, so a changed
    byte fails the read that meets it, naming the shard. Before, most such bytes decoded to
    other text (or other JSON) without a word and were trained on."""
    from tape_train.data import DataError
    from tape_train.data.formats import Shard, SkipLog, read_documents

    shard = copy / SHARD
    intact = shard.read_bytes()

    def read() -> int:
        return len(list(read_documents(Shard("jsonl", str(shard), "zst"), 0, "text", False,
                                       SkipLog())))

    assert read() > 0  # control: the intact shard reads
    for at in range(16, len(intact) - 4, max(1, (len(intact) - 20) // 16)):
        data = bytearray(intact)
        data[at] ^= 0x01
        shard.write_bytes(bytes(data))
        with pytest.raises(DataError, match=rf"^{shard}:.*--verify"):
            read()
