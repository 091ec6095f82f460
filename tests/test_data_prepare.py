"""`tape-data prepare`: local inputs and the Debian demo corpus; manifest, idempotence."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tape_train.data import DataConfig, build_train_loader, iter_eval_documents
from tape_train.data import cli as data_cli
from tape_train.data import tokenizer_cli
from tape_train.data.config import DataError
from tape_train.data.corpus import read_complete_manifest
from tape_train.data.sources import is_held_out
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl


def _prepare_input(tmp_path, texts, out, *extra):
    return data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--out", str(out),
                          "--num-shards", "4", "--eval-fraction", "0.2", *extra])


def test_prepare_local_inputs(tmp_path, capsys):
    texts = real_text_documents(60)
    write_jsonl(tmp_path / "in" / "a.jsonl", texts[:40] + texts[:5])  # 5 exact duplicates
    for i, t in enumerate(texts[40:]):
        (tmp_path / "in" / f"t{i}.txt").write_text(t)
    out = tmp_path / "out"
    assert _prepare_input(tmp_path, texts, out) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    assert len(train) == 4 and manifest["splits"]["eval"]["shards"] == 1
    assert manifest["dropped"]["duplicates"] == 5
    total = manifest["splits"]["train"]["documents"] + manifest["splits"]["eval"]["documents"]
    assert total == len(set(texts))
    for shard in manifest["shards"]:
        data = (out / shard["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == shard["file_bytes"]
    # The held-out split is exactly the hash rule, and disjoint from training.
    cfg = DataConfig(sources=[str(out)], prefetch=0)
    import zstandard
    eval_lines = zstandard.ZstdDecompressor().stream_reader(
        open(out / "eval-00000-of-00001.jsonl.zst", "rb")).read().decode().splitlines()
    held = {json.loads(line)["text"] for line in eval_lines}
    assert held == {t for t in set(texts) if is_held_out(t, 0.2)} and held
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=500, max_bytes=200_000)
    evals = {tok.decode(ids[1:-1]) for ids, _ in iter_eval_documents(cfg, tok)}
    assert evals == held
    loader = build_train_loader(cfg, tok, 32, 2)
    assert next(loader)["input_ids"].shape == (2, 32)
    # Idempotent: a second run with the same options does nothing.
    mtime = (out / "manifest.json").stat().st_mtime_ns
    capsys.readouterr()
    assert _prepare_input(tmp_path, texts, out) == 0
    assert "already complete" in capsys.readouterr().out
    assert (out / "manifest.json").stat().st_mtime_ns == mtime
    # A damaged directory (a shard missing) is not complete, and a re-run repairs it.
    (out / train[0]["path"]).unlink()
    assert read_complete_manifest(out) is None
    assert _prepare_input(tmp_path, texts, out) == 0
    assert read_complete_manifest(out) is not None


def test_a_small_corpus_is_written_with_a_warning_on_what_it_lacks(tmp_path, capsys):
    # Chosen by the hash rule, not by position: which of the first documents a fraction holds
    # out depends on the Python version's stdlib text. None of the 8 is held out at the
    # default 0.01; at 0.5, 4 are and 4 are not.
    candidates = [t for t in real_text_documents() if not is_held_out(t, 0.01)]
    texts = ([t for t in candidates if is_held_out(t, 0.5)][:4]
             + [t for t in candidates if not is_held_out(t, 0.5)][:4])
    assert len(texts) == 8
    for i, t in enumerate(texts):
        (tmp_path / "in" / f"t{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "in" / f"t{i}.txt").write_text(t)
    assert not any(is_held_out(t, 0.01) for t in texts)  # the default fraction holds none out
    out = tmp_path / "out"
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert (f"tape-data: warning: {out}: no document was held out (8 documents x "
            f"--eval-fraction 0.01)") in err
    assert f"tape-data: warning: {out}: 8 training documents in 16 shards" in err
    assert read_complete_manifest(out) is not None  # written all the same
    # negative control: enough shards' worth and a held-out split, no warning
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--out", str(out),
                          "--num-shards", "2", "--eval-fraction", "0.5"]) == 0
    assert sum(is_held_out(t, 0.5) for t in texts) == 4
    assert "warning" not in capsys.readouterr().err


def test_a_corpus_rebuilt_with_other_options_leaves_none_of_the_old_shards(tmp_path, tok,
                                                                          capsys):
    """Preparing into a complete directory with other options replaces its corpus: the old
    16 shards of which the new manifest lists 4 (and their token shards) stayed beside it,
    and the directory failed its own `tape-data info --verify` (unlisted shards). A file the
    old manifest did not list is not the prepare's to delete."""
    from tape_train.data.verify import verify_corpus

    write_jsonl(tmp_path / "in" / "a.jsonl", real_text_documents(40))
    out = tmp_path / "out"
    model = str(tmp_path / "tok.model")
    shutil.copy(tok.path, model)
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--out", str(out),
                          "--num-shards", "16", "--tokenize", "--tokenizer", model]) == 0
    (out / "notes.txt").write_text("mine")
    assert _prepare_input(tmp_path, None, out) == 0  # 4 shards, no token shards
    listed = {entry["path"] for entry in json.loads((out / "manifest.json").read_text())
              ["shards"]}
    assert {p.name for p in out.iterdir()} == listed | {"manifest.json", "notes.txt"}
    assert verify_corpus(out).ok, verify_corpus(out).problems


def test_partial_output_is_never_taken_as_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00000-of-00004.jsonl.zst").write_bytes(b"partial")
    assert read_complete_manifest(out) is None
    (out / "manifest.json").write_text('{"format": "tape-data/1", "shards": [{"path": '
                                       '"train-00000-of-00004.jsonl.zst", "file_bytes": 999}]}')
    assert read_complete_manifest(out) is None  # size mismatch
    for damaged in ("[]", '{"format": "tape-data/1", "shards": [], "tokens": [1]}'):
        (out / "manifest.json").write_text(damaged)  # valid JSON, not a manifest: no traceback
        assert read_complete_manifest(out) is None


def test_a_prepared_shard_cut_short_is_refused_not_read_in_part(tmp_path):
    """A prepared directory whose shard is not its listed size (a copy cut short) is refused
    where its shards are resolved — training, held-out reading — naming the shard, instead of
    training on what is left of it (an empty or frame-aligned cut reads as valid zstd)."""
    from tape_train.data.config import DataError

    write_jsonl(tmp_path / "in" / "a.jsonl", real_text_documents(60))
    out = tmp_path / "out"
    assert _prepare_input(tmp_path, None, out) == 0
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=500, max_bytes=200_000)
    cfg = DataConfig(sources=[str(out)], prefetch=0)
    # negative control: the directory as written trains and yields its held-out split
    assert next(build_train_loader(cfg, tok, 32, 2))["input_ids"].shape == (2, 32)
    assert next(iter_eval_documents(cfg, tok))
    for name in ("train-00002-of-00004.jsonl.zst", "eval-00000-of-00001.jsonl.zst"):
        shard = out / name
        intact = shard.read_bytes()
        shard.write_bytes(b"")
        pattern = (rf"manifest.json: shard '{name}' is 0 bytes, but the manifest lists "
                   rf"{len(intact)}: the directory is incomplete or damaged")
        with pytest.raises(DataError, match=pattern):
            if name.startswith("train"):
                build_train_loader(cfg, tok, 32, 2)
            else:
                next(iter_eval_documents(cfg, tok))
        shard.write_bytes(intact)


def test_a_prepare_killed_before_its_manifest_is_refused_not_read_as_raw_text(tmp_path,
                                                                               monkeypatch):
    from tape_train.data import corpus
    from tape_train.data.config import DataError

    texts = real_text_documents(40)
    write_jsonl(tmp_path / "in" / "a.jsonl", texts)
    out = tmp_path / "out"

    def killed(path, *args, **kwargs):  # the shards are in place, the manifest never written
        raise KeyboardInterrupt
    monkeypatch.setattr(corpus, "write_atomic", killed)
    assert _prepare_input(tmp_path, texts, out) == 130  # "tape-data: interrupted"
    monkeypatch.undo()
    shards = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert shards[0] == "eval-00000-of-00001.jsonl.zst"
    assert not (out / "manifest.json").exists()
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=500, max_bytes=200_000)
    cfg = DataConfig(sources=[str(out)], prefetch=0)
    with pytest.raises(DataError, match=r"holds shards of `tape-data prepare` \("
                                        r"eval-00000-of-00001.jsonl.zst, ...\) but no "
                                        r"manifest.json: the prepare was interrupted"):
        build_train_loader(cfg, tok, 32, 2)
    # The re-run the message asks for completes it, and the directory is read as prepared.
    assert _prepare_input(tmp_path, texts, out) == 0
    assert next(build_train_loader(cfg, tok, 32, 2))["input_ids"].shape == (2, 32)
    # Negative control: other files in a directory without a manifest are raw text.
    (out / "manifest.json").unlink()
    for shard in out.glob("*.zst"):
        shard.rename(shard.with_name("part-" + shard.name))
    assert next(build_train_loader(cfg, tok, 32, 2))["input_ids"].shape == (2, 32)


def test_prepare_bad_input_is_an_error(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"),
                          "--out", str(tmp_path / "o")]) == 1
    assert "a.jsonl:2: malformed JSON" in capsys.readouterr().err
    assert not (tmp_path / "o" / "manifest.json").exists()
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--skip-bad-records",
                          "--out", str(tmp_path / "o")]) == 0


def test_bad_input_errors_of_the_commands_name_their_flags(tmp_path, capsys):
    """`tape-data prepare` and `tape-tokenizer train` have flags, not config keys: their
    bad-record errors say `--skip-bad-records` / `--text-field`; the training loader's still
    say `data.skip_bad_records` (negative control)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tape_train.data.config import DataError

    bad = tmp_path / "in" / "a.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"text": "a fine document"}\n{"text": "unterminated\n')
    no_column = tmp_path / "p.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_column)
    runs = [(data_cli.main, ["prepare", "--input", str(bad), "--out", str(tmp_path / "o")]),
            (tokenizer_cli.main, ["train", "--input", str(bad), "--out", str(tmp_path / "t")])]
    for main, args in runs:
        capsys.readouterr()
        assert main(args) == 1
        err = capsys.readouterr().err
        assert (f"{bad}:2: malformed JSON: Unterminated string starting at: column 10 (add "
                f"--skip-bad-records to skip and count such records instead)") in err
        assert "data.skip_bad_records" not in err
    assert data_cli.main(["prepare", "--input", str(no_column), "--out",
                          str(tmp_path / "o2")]) == 1
    assert ("Parquet file has no column 'text' (columns: body); pass --text-field NAME"
            in capsys.readouterr().err)
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=500, max_bytes=200_000)
    with pytest.raises(DataError, match=r"a.jsonl:2: malformed JSON: .*\(set "
                                        r"data.skip_bad_records=true to skip"):
        next(build_train_loader(DataConfig(sources=[str(bad)], prefetch=0), tok, 32, 1))
    listed = write_jsonl(tmp_path / "l.jsonl", ["a fine document"])
    with open(listed, "a") as fh:
        fh.write("[1, 2]\n")
    with pytest.raises(DataError, match=r"l.jsonl:2: missing text field: record is a JSON "
                                        r"list, not an object with field 'text'"):
        next(build_train_loader(DataConfig(sources=[str(listed)], prefetch=0), tok, 32, 1))


def test_demo_downloads_go_to_the_project_cache(tmp_path, monkeypatch):
    """`prepare --demo` keeps its .deb files in debian/ of the one tape-train cache directory
    (machine_cache.cache_dir): $TAPE_TRAIN_CACHE_DIR moves them with the measurements; without
    it, $XDG_CACHE_HOME/tape-train (the negative control)."""
    from tape_train.data import demo_corpus
    from tape_train.data.config import DataError

    asked = []

    def fetch(cache_dir):
        asked.append(cache_dir)
        raise DataError("stopped before any download")

    monkeypatch.setattr(demo_corpus, "fetch_demo_packages", fetch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for moved in (tmp_path / "moved", None):
        if moved is None:
            monkeypatch.delenv("TAPE_TRAIN_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TAPE_TRAIN_CACHE_DIR", str(moved))
        assert data_cli.main(["prepare", "--demo", "--out", str(tmp_path / "demo")]) == 1
    assert asked == [tmp_path / "moved" / "debian", tmp_path / "xdg" / "tape-train" / "debian"]


def _apt_reaches_archive() -> str | None:
    if not all(shutil.which(t) for t in ("apt-get", "apt-cache", "dpkg-deb")):
        return "apt-get/apt-cache/dpkg-deb not installed (not a Debian/Ubuntu machine)"
    probe = subprocess.run(["apt-cache", "show", "--no-all-versions", "fortunes-min"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return "apt has no package lists for the demo packages (run `apt-get update`)"
    return None


@pytest.mark.slow
def test_prepare_demo_corpus_end_to_end(tmp_path, capsys):
    reason = _apt_reaches_archive()
    if reason:
        pytest.skip(reason)
    out, cache = tmp_path / "demo", tmp_path / "cache"
    assert data_cli.main(["prepare", "--demo", "--out", str(out), "--cache-dir",
                          str(cache)]) == 0
    manifest = read_complete_manifest(out)
    assert manifest is not None
    assert manifest["splits"]["train"]["shards"] == 16
    assert manifest["splits"]["train"]["text_bytes"] > 10e6
    assert manifest["splits"]["eval"]["documents"] > 50
    assert len(manifest["packages"]) >= 6
    assert all(s["documents"] > 0 for s in manifest["sources"].values())
    capsys.readouterr()
    assert data_cli.main(["prepare", "--demo", "--out", str(out), "--cache-dir",
                          str(cache)]) == 0
    assert "already complete" in capsys.readouterr().out
    assert tokenizer_cli.main(["train", "--input", str(out), "--vocab-size", "1000",
                               "--max-bytes", "3000000", "--out", str(out / "tokenizer")]) == 0
    from tape_train.data import load_tokenizer
    tok = load_tokenizer(out / "tokenizer.model")
    cfg = DataConfig(sources=[str(out)], tokenizer=str(out / "tokenizer.model"),
                     eval_max_documents=20)
    loader = build_train_loader(cfg, tok, 128, 2, seed=0)
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 128)
    text = tok.decode(batch["input_ids"][0].tolist())
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)  # real prose, not bytes
    loader.close()
    assert len(list(iter_eval_documents(cfg, tok))) == 20


def _shard_texts(directory) -> dict[str, list[str]]:
    import zstandard

    manifest = read_complete_manifest(directory)
    out = {}
    for shard in manifest["shards"]:
        raw = zstandard.ZstdDecompressor().stream_reader(
            open(directory / shard["path"], "rb")).read().decode()
        out[shard["path"]] = [json.loads(line)["text"] for line in raw.splitlines()]
    return out


@pytest.fixture
def parquet_corpus(tmp_path):
    """3 Parquet files of real text (2 row groups each, 4 duplicates), an extra column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = real_text_documents(60)
    (tmp_path / "pq").mkdir()
    for s in range(3):
        part = texts[s * 20:(s + 1) * 20] + (texts[:2] if s == 2 else [])
        pq.write_table(pa.table({"text": part, "url": [f"u{i}" for i in range(len(part))]}),
                       tmp_path / "pq" / f"part-{s}.parquet", row_group_size=12)
    return texts, str(tmp_path / "pq" / "*.parquet")


def test_prepare_hub_writes_what_input_writes(tmp_path, parquet_corpus, tok, capsys, caplog):
    """`--hub` streams the dataset file by file (a `datasets` builder over local Parquet stands
    in for the Hub) into the same prepared directory `--input` makes of the same files: same
    documents in the same shards, dedup and held-out split; plus the Hub facts and progress
    lines per file; re-running is a no-op; `--tokenize` works the same."""
    texts, files = parquet_corpus
    common = ["--num-shards", "4", "--eval-fraction", "0.2", "--progress", "off"]
    with caplog.at_level("INFO", logger="tape_train.data"):
        assert data_cli.main(["prepare", "--hub", "parquet", "--data-files", files,
                              "--out", str(tmp_path / "hub"), *common]) == 0
    for i in (1, 2, 3):
        assert f"prepare: file {i}/3 of parquet done: " in caplog.text
    assert data_cli.main(["prepare", "--input", files, "--out", str(tmp_path / "in"),
                          *common]) == 0
    manifest = read_complete_manifest(tmp_path / "hub")
    assert manifest["dropped"]["duplicates"] == 2
    assert manifest["splits"] == read_complete_manifest(tmp_path / "in")["splits"]
    assert _shard_texts(tmp_path / "hub") == _shard_texts(tmp_path / "in")
    hub = manifest["hub"]
    assert (hub["name"], hub["config"], hub["split"], hub["data_files"], hub["files"]) == \
        ("parquet", None, "train", [files], 3)
    assert hub["revision"] is None and hub["fingerprint"].startswith("default-")
    assert hub["fields"] == ["text", "url"]
    capsys.readouterr()
    assert data_cli.main(["info", str(tmp_path / "hub")]) == 0
    assert "hub: parquet (config None, split train" in capsys.readouterr().out
    assert data_cli.main(["prepare", "--hub", "parquet", "--data-files", files,
                          "--out", str(tmp_path / "hub"), *common]) == 0
    assert "already complete" in capsys.readouterr().out
    assert data_cli.main(["prepare", "--hub", "parquet", "--data-files", files, "--out",
                          str(tmp_path / "tok"), *common, "--tokenize", "--tokenizer",
                          tok.path]) == 0
    cfg = DataConfig(sources=[str(tmp_path / "tok")], tokenizer=tok.path, format="tokens")
    assert next(build_train_loader(cfg, tok, 32, 2))["input_ids"].shape == (2, 32)


def test_prepare_hub_records_the_hub_revision(tmp_path, parquet_corpus, monkeypatch):
    """For a Hub repository `datasets` pins a commit (the builder's hash); the manifest keeps
    it. A builder with a repo_id and a commit hash stands in for the Hub."""
    import datasets

    _, files = parquet_corpus
    real = datasets.load_dataset_builder
    commit = "0123abcd" * 5

    def hub_builder(path, name=None, data_files=None):
        assert (path, name, data_files) == ("org/corpus", "en", None)
        builder = real("parquet", data_files=files)
        builder.repo_id, builder.hash = path, commit
        return builder

    monkeypatch.setattr(datasets, "load_dataset_builder", hub_builder)
    assert data_cli.main(["prepare", "--hub", "org/corpus", "--hub-config", "en",
                          "--out", str(tmp_path / "o"), "--progress", "off"]) == 0
    hub = read_complete_manifest(tmp_path / "o")["hub"]
    assert (hub["name"], hub["config"], hub["revision"]) == ("org/corpus", "en", commit)


def test_prepare_hub_errors_are_one_line_and_leave_nothing_complete(tmp_path, parquet_corpus,
                                                                    capsys):
    texts, files = parquet_corpus

    def error(*args) -> str:
        """Our one error line, the last on stderr (datasets may log the failure before it)."""
        capsys.readouterr()
        assert data_cli.main(["prepare", *args, "--progress", "off"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        ours = [line for line in lines if line.startswith("tape-data: ")]
        assert len(ours) == 1 and lines[-1] == ours[0], lines
        return ours[0]

    out = str(tmp_path / "o")
    missing = str(tmp_path / "no-such-dataset")  # a local path: no network in tests
    line = error("--hub", missing, "--out", out)
    assert line.startswith(
        f"tape-data: error: --hub: cannot open dataset '{missing}' (config=None, split='train')")
    assert "HF_HUB_OFFLINE" not in line  # a missing dataset is not a network problem
    assert error("--hub", "parquet", "--data-files", files, "--text-field", "body",
                 "--out", out) == ("tape-data: error: --text-field: dataset 'parquet' has no "
                                   "field 'body' (its fields: text, url)")
    assert error("--input", files, "--split", "test", "--out", out) == \
        "tape-data: error: --split needs --hub (it selects what to stream from the Hub)"
    # A JSON record without the text: one line naming the record (or skipped and counted).
    lines = [json.dumps({"text": t}) for t in texts[:5]]
    lines[2] = json.dumps({"body": "no text here"})
    (tmp_path / "j.jsonl").write_text("\n".join(lines) + "\n")
    jsonl = ["--hub", "json", "--data-files", str(tmp_path / "j.jsonl"), "--out", out]
    assert "#0:record 2: text not a string: field 'text' is NoneType" in error(*jsonl)
    # An empty data file: the builder's bare StopIteration said nothing ("StopIteration: ").
    (tmp_path / "empty.jsonl").write_text("")
    empty = str(tmp_path / "empty.jsonl")
    assert error("--hub", "json", "--data-files", empty, "--out", out).endswith(
        f"(config=None, split='train', data_files=['{empty}']): StopIteration: no record to "
        f"read: are the data files empty?")
    assert data_cli.main(["prepare", *jsonl, "--skip-bad-records", "--eval-fraction", "0",
                          "--progress", "off"]) == 0
    assert read_complete_manifest(tmp_path / "o")["splits"]["train"]["documents"] == 4
    # A file that breaks mid-stream: one line, no manifest, no partial shards left behind.
    (tmp_path / "pq" / "part-3.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    broken = str(tmp_path / "broken")
    line = error("--hub", "parquet", "--data-files", files, "--out", broken)
    assert "--hub: reading hub:parquet/default/train" in line
    assert read_complete_manifest(broken) is None and not list(Path(broken).iterdir())
    # ... in the data itself, so a re-run fails again: it says so, not that a re-run resumes
    assert line.endswith("the data itself could not be parsed, so a re-run stops here again: "
                         "fix or leave out that file")
    (tmp_path / "cut.jsonl").write_bytes(b'{"text": "whole"}\n{"text": "cut\n')
    line = error("--hub", "json", "--data-files", str(tmp_path / "cut.jsonl"), "--out", broken)
    assert "(ArrowInvalid: JSON parse error" in line and "a re-run stops here again" in line


class _FakeApt:
    """apt as ``demo_corpus`` calls it, over a fake archive that serves ``archive`` versions.
    The machine's lists (no ``Dir::State::Lists`` option) are stale: ``system`` versions."""

    def __init__(self, system: dict[str, str], archive: dict[str, str], update_ok: bool = True):
        self.system, self.archive, self.update_ok = system, archive, update_ok
        self.commands: list[list[str]] = []

    def __call__(self, cmd, cwd=None):
        self.commands.append(cmd)
        private = any(arg.startswith("Dir::State::Lists=") for arg in cmd)
        lists = self.archive if private else self.system
        if cmd[0] == "apt-cache":
            names = cmd[cmd.index("--no-all-versions") + 1:]
            out = "\n\n".join(f"Package: {n}\nVersion: {lists[n]}" for n in names if n in lists)
            return subprocess.CompletedProcess(cmd, 0, out, "")
        if cmd[-1] == "update":
            if not self.update_ok:
                return subprocess.CompletedProcess(cmd, 100, "", "E: offline")
            lists_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("Dir::State::Lists="))
            (Path(lists_dir) / "archive_main_binary-amd64_Packages").write_text("")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        names = cmd[cmd.index("download") + 1:]
        if any(lists.get(n) != self.archive.get(n) for n in names):
            return subprocess.CompletedProcess(cmd, 100, "", "E: 404  Not Found")
        for name in names:
            (Path(cwd) / f"{name}_{lists[name].replace(':', '%3a')}_all.deb").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_demo_packages_refresh_stale_lists_privately(tmp_path, monkeypatch):
    from tape_train.data import demo_corpus

    archive = {name: "2.0-new" for name in demo_corpus.FIXED_PACKAGES}
    archive["python3.11-doc"] = "3.11.2-6+deb12u9"
    system = {**archive, "perl-doc": "1.0-old"}       # a point release replaced perl-doc
    del system["fortunes"]                            # and the lists lack one package
    apt = _FakeApt(system, archive)
    monkeypatch.setattr(demo_corpus, "_run", apt)
    debs = demo_corpus.fetch_demo_packages(tmp_path)
    assert {name: version for name, (_, version) in debs.items()} == archive
    updates = [cmd for cmd in apt.commands if cmd[-1] == "update"]
    assert len(updates) == 1
    assert f"Dir::State::Lists={tmp_path / 'apt-lists'}" in updates[0]  # never the system's
    # Packages the machine's lists gave are not downloaded again with the fresh lists.
    fresh_downloads = [n for cmd in apt.commands if "download" in cmd
                       and any("Dir::State::Lists" in a for a in cmd)
                       for n in cmd[cmd.index("download") + 1:]]
    assert sorted(fresh_downloads) == ["fortunes", "perl-doc"]
    # Second run: the fresh lists are used first; all cached, nothing downloaded, no update.
    apt.commands.clear()
    assert demo_corpus.fetch_demo_packages(tmp_path).keys() == debs.keys()
    assert not [cmd for cmd in apt.commands if cmd[0] == "apt-get"]


def test_demo_packages_offline_skips_what_it_cannot_get(tmp_path, monkeypatch, caplog):
    from tape_train.data import demo_corpus
    from tape_train.data.config import DataError

    archive = {name: "2.0-new" for name in demo_corpus.FIXED_PACKAGES}
    system = {**archive, "perl-doc": "1.0-old"}
    monkeypatch.setattr(demo_corpus, "_run", _FakeApt(system, archive, update_ok=False))
    with caplog.at_level("WARNING", logger="tape_train.data"):
        debs = demo_corpus.fetch_demo_packages(tmp_path)
    assert "perl-doc" not in debs and "fortunes" in debs
    assert "package perl-doc could not be downloaded" in caplog.text
    assert "apt-get update failed" in caplog.text
    monkeypatch.setattr(demo_corpus, "_run", _FakeApt({}, archive, update_ok=False))
    with pytest.raises(DataError, match="none of the demo packages"):
        demo_corpus.fetch_demo_packages(tmp_path / "empty")


def test_an_unwritable_demo_cache_is_refused_before_any_download(tmp_path, monkeypatch):
    """A download cache that cannot be created, or exists read-only, is one error naming it and
    --cache-dir before apt-get fetches anything (it would fetch each package, then fail to
    write it); a read-only cache that already holds every package is used (the control)."""
    import os

    from tape_train.data import demo_corpus
    from tape_train.data.config import DataError

    archive = {name: "2.0-new" for name in (*demo_corpus.FIXED_PACKAGES, "python3.11-doc")}
    apt = _FakeApt(archive, archive)
    monkeypatch.setattr(demo_corpus, "_run", apt)
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"into .*file/cache: Not a directory; give --cache-dir"):
        demo_corpus.fetch_demo_packages(tmp_path / "file" / "cache")
    shared = tmp_path / "shared"  # full/ holds every package, partial/ all but perl-doc
    assert demo_corpus.fetch_demo_packages(shared / "full").keys() == archive.keys()
    shutil.copytree(shared / "full", shared / "partial")
    next((shared / "partial").glob("perl-doc_*.deb")).unlink()
    for directory in (shared / "full", shared / "partial"):
        directory.chmod(0o555)
    mounted = False
    try:
        if os.access(shared / "partial", os.W_OK):  # root: a read-only mount stops it
            mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(shared), str(shared)],
                                     capture_output=True).returncode == 0
            if not mounted or os.access(shared / "partial", os.W_OK):
                pytest.skip("running as root where a read-only bind mount is not allowed")
        apt.commands.clear()
        with pytest.raises(DataError, match=r"cannot download 1 package\(s\) \(perl-doc, "
                                            r"\.\.\.\) into .*partial: not writable"):
            demo_corpus.fetch_demo_packages(shared / "partial")
        assert demo_corpus.fetch_demo_packages(shared / "full").keys() == archive.keys()
        assert not [cmd for cmd in apt.commands if "download" in cmd or "update" in cmd]
    finally:
        if mounted:
            subprocess.run(["umount", str(shared)], check=True)
        for directory in (shared / "full", shared / "partial"):
            directory.chmod(0o755)


def test_scratch_of_a_killed_prepare_is_removed_by_the_next_one(tmp_path):
    """A SIGKILLed prepare leaves .tmp-prepare-<pid>; the next prepare into the same directory
    removes it. A live process's scratch is kept (negative control)."""
    import subprocess as sp
    import sys

    from tape_train.data.corpus import SCRATCH_PREFIX, write_corpus

    dead = sp.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = tmp_path / "out" / f"{SCRATCH_PREFIX}{dead.pid}"
    (abandoned / "sub").mkdir(parents=True)
    (abandoned / "sub" / "train-00000.jsonl.zst").write_bytes(b"x" * 1000)
    alive = sp.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / "out" / f"{SCRATCH_PREFIX}{alive.pid}"
        busy.mkdir()
        docs = ({"text": f"document {i} " * 20, "source": "s", "id": str(i)} for i in range(40))
        write_corpus(docs, tmp_path / "out", num_shards=2, eval_fraction=0.1, seed=0,
                     config={}, extra={})
        assert not abandoned.exists()
        assert busy.is_dir()
    finally:
        alive.kill()
        alive.wait()


def test_more_shards_than_open_files_allowed_is_refused_up_front(tmp_path):
    """--num-shards beyond `ulimit -n` (hard limit included) fails before anything is written,
    naming the flag and the limit; within the hard limit the soft limit is raised."""
    import resource
    import subprocess as sp
    import sys

    script = f"""
import resource, sys
from tape_train.data.config import DataError
from tape_train.data.corpus import write_corpus
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
docs = lambda: ({{"text": f"doc {{i}} " * 30, "source": "s", "id": str(i)}} for i in range(50))
write_corpus(docs(), {str(tmp_path / 'b')!r}, num_shards=300, eval_fraction=0.1)
print("soft limit now", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
try:
    write_corpus(docs(), {str(tmp_path / 'a')!r}, num_shards=1000, eval_fraction=0.1)
except DataError as exc:
    print("refused:", exc)
"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"hard open-file limit {hard} < 512 here")
    out = sp.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: --num-shards 1000 keeps 1001 files open at once, but this process may " \
           "open only 512 (ulimit -n); use at most 447 shards" in out.stdout
    assert not (tmp_path / "a").exists()  # refused before anything was written
    assert "soft limit now 365" in out.stdout  # 300 shards: raised as far as needed
    assert (tmp_path / "b" / "manifest.json").is_file()


def test_prepare_hub_without_network_says_what_to_do(tmp_path, monkeypatch, capsys):
    """No route to the Hub (a compute node without internet): the one error line says how to
    go on — prepare where the Hub is reachable, or HF_HUB_OFFLINE=1 with a filled cache."""
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset_builder", unreachable)
    assert data_cli.main(["prepare", "--hub", "org/corpus", "--out", str(tmp_path / "o"),
                          "--progress", "off"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tape-data: error: --hub: cannot open dataset 'org/corpus'")
    assert "No connection to the Hub" in err and "HF_HUB_OFFLINE=1" in err
    # said to `tape-data prepare --hub` itself: not "prepare ... (`tape-data prepare --hub`)"
    assert "run this prepare where the Hub is reachable and copy the prepared directory" in err
    assert "`tape-data prepare --hub`" not in err, err
    assert not (tmp_path / "o" / "manifest.json").exists()
    # negative control: a source of a training config is told to prepare it with that command
    from tape_train.data.config import SourceConfig
    from tape_train.data.formats import _offline_hint
    hint = _offline_hint(SourceConfig(hub="org/corpus", key="data.sources[0]"))
    assert "prepare the corpus where the Hub is reachable (`tape-data prepare --hub`" in hint
    # Already offline (HF_HUB_OFFLINE set): the cache lacks it; not "set HF_HUB_OFFLINE=1" again.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert data_cli.main(["prepare", "--hub", "org/corpus", "--out", str(tmp_path / "o"),
                          "--progress", "off"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("HF_HUB_OFFLINE is set and the Hugging Face cache holds no copy of 'org/corpus'"
            in err) and "set HF_HUB_OFFLINE=1" not in err


def test_out_inside_an_input_directory_is_refused(tmp_path, capsys):
    """`--out` that is, or lies inside, an `--input` directory is refused before anything is
    written: a later prepare of that input would read the shards (the held-out split too)."""
    write_jsonl(tmp_path / "in" / "a.jsonl", real_text_documents(30))
    for out, where in ((tmp_path / "in", "is"), (tmp_path / "in" / "sub" / "prep", "lies inside")):
        assert _prepare_input(tmp_path, None, out) == 1
        err = capsys.readouterr().err
        assert f"tape-data: error: --out {out} {where} the --input directory" in err
        assert "write --out outside" in err
    assert sorted(p.name for p in (tmp_path / "in").rglob("*")) == ["a.jsonl"]
    # negative control: beside the input, the same prepare is written
    assert _prepare_input(tmp_path, None, tmp_path / "out") == 0
    assert read_complete_manifest(tmp_path / "out") is not None


def test_a_prepared_directory_inside_a_raw_source_directory_is_refused(tmp_path):
    """A source directory holding a prepared directory would read its shards as raw files, the
    held-out split as training text: refused, naming the prepared directory."""
    from tape_train.data.config import DataError, SourceConfig
    from tape_train.data.formats import resolve_local_shards

    write_jsonl(tmp_path / "in" / "a.jsonl", real_text_documents(30))
    prepared = tmp_path / "corpora" / "mine"
    assert _prepare_input(tmp_path, None, prepared) == 0
    write_jsonl(tmp_path / "corpora" / "raw.jsonl", ["a raw document"])
    source = SourceConfig(path=str(tmp_path / "corpora"), key="data.sources[0]")
    with pytest.raises(DataError, match=rf"data.sources\[0\].path: directory '.*corpora' holds "
                                        rf"the prepared directory '{prepared}', which would be "
                                        rf"read as raw files, its held-out eval split"):
        resolve_local_shards(source)
    # negative control: the prepared directory named itself gives its training shards
    shards = resolve_local_shards(SourceConfig(path=str(prepared), key="data.sources[0]"))
    assert sorted(Path(s.path).name for s in shards) == [
        f"train-0000{i}-of-00004.jsonl.zst" for i in range(4)]
    # Another tool's manifest.json makes no prepared directory: a raw corpus that has one,
    # at its top or below, is read as raw files.
    raw = tmp_path / "downloaded"
    write_jsonl(raw / "part" / "b.jsonl", ["another raw document"])
    write_jsonl(raw / "c.jsonl", ["a third one"])
    for where in (raw, raw / "part"):
        (where / "manifest.json").write_text('{"name": "some-dataset", "files": ["b.jsonl"]}')
    shards = resolve_local_shards(SourceConfig(path=str(raw), key="data.sources[0]"))
    assert sorted(Path(s.path).name for s in shards) == ["b.jsonl", "c.jsonl"]


def test_the_held_out_split_named_as_training_files_is_refused(tmp_path):
    """A glob or file naming a prepared directory's eval shard as training text (the held-out
    documents evaluation scores) is refused; as an eval source it is read."""
    from tape_train.data.config import DataError

    write_jsonl(tmp_path / "in" / "a.jsonl", real_text_documents(60))
    out = tmp_path / "out"
    assert _prepare_input(tmp_path, None, out) == 0
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=500, max_bytes=200_000)
    eval_shard = out / "eval-00000-of-00001.jsonl.zst"
    for path in (str(out / "*.jsonl.zst"), str(eval_shard)):
        with pytest.raises(DataError, match=rf"data.sources\[0\].path: '{eval_shard}' is the "
                                            rf"held-out \(eval\) split of the prepared directory"):
            build_train_loader(DataConfig(sources=[path], prefetch=0), tok, 32, 2)
    # negative controls: its train-* shards train; its eval shard is a valid eval source
    cfg = DataConfig(sources=[str(out / "train-*.jsonl.zst")], eval_sources=[str(eval_shard)],
                     prefetch=0)
    assert next(build_train_loader(cfg, tok, 32, 2))["input_ids"].shape == (2, 32)
    held = list(iter_eval_documents(cfg, tok))
    assert held and len(held) == json.loads((out / "manifest.json").read_text())[
        "splits"]["eval"]["documents"]


def test_an_unusable_cache_directory_is_named_even_when_apt_knows_no_package(tmp_path):
    """With no package lists apt knows no demo package: the message about the cache directory
    that cannot be made indexed the empty list (an IndexError instead of the error)."""
    from tape_train.data import demo_corpus

    (tmp_path / "file").write_text("x")
    cache = tmp_path / "file" / "cache"
    with pytest.raises(DataError, match=r"cannot download the demo packages into .*file/cache: "):
        demo_corpus.download_packages({}, cache, [])
    with pytest.raises(DataError, match=r"cannot download 1 package\(s\) \(fortunes, \.\.\.\)"):
        demo_corpus.download_packages({"fortunes": "1"}, cache, [])
