"""Reports (table, JSON, plot; atomic writes) and `tape-eval` end to end on real checkpoints.

Checkpoints are written by the trainer's own ``save_checkpoint`` (layout, marker, discovery)
through a stand-in engine that stores the model's state dict the way DeepSpeed does at ZeRO
stage 0, so ``load_model_from_checkpoint`` reads them without DeepSpeed start-up cost.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from tape_train.eval import report
from tape_train.eval.cli import main
from tape_train.eval.perplexity import evaluate_perplexity
from tape_train.model import TransformerLM, load_model_config
from tape_train.train import checkpoint as ckpt
from tape_train.data.synthetic import synthetic_held_out
from test_eval_perplexity import RecordingModel

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(length, protocol, ppl, tokens=100, nbytes=300.0):
    nll = math.log(ppl) * tokens
    return {"length": length, "protocol": protocol, "stride": length // 2 if protocol ==
            "sliding" else None, "perplexity": ppl, "loss": nll / tokens, "nll_sum": nll,
            "tokens": tokens, "bytes": nbytes,
            "bits_per_byte": nll / (math.log(2) * nbytes) if nbytes else math.nan}


def _runs():
    tape = [_result(L, p, 20 + L / 64) for L in (64, 128, 256) for p in ("nonoverlap", "sliding")]
    rope = [_result(L, p, 20 + L) for L in (64, 128, 256) for p in ("nonoverlap", "sliding")]
    rope[-1] = _result(256, "sliding", math.inf, nbytes=0)     # overflow and zero bytes
    return [{"label": "TAPE", "train_seq_len": 64, "results": tape},
            {"label": "RoPE", "train_seq_len": 64, "results": rope}]


def test_reports_written_complete_and_atomic(tmp_path):
    paths = report.write_reports(tmp_path / "out", _runs(), settings={"max_tokens": 100})
    table = (tmp_path / "out" / "eval.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| TAPE") or
            line.startswith("| RoPE")]
    assert len(rows) == 12
    assert "| TAPE | nonoverlap | 128 | 2× | – | 22.000 |" in table
    payload = json.loads(paths["json"].read_text())
    assert payload["format"] == report.REPORT_FORMAT and payload["settings"]["max_tokens"] == 100
    assert [m["label"] for m in payload["models"]] == ["TAPE", "RoPE"]
    assert payload["models"][1]["results"][-1]["perplexity"] is None   # inf → null, valid JSON
    png = paths["plot"].read_bytes()
    assert png.startswith(PNG_MAGIC)
    import matplotlib.image
    image = matplotlib.image.imread(paths["plot"])
    assert image.shape[0] > 300 and image.shape[1] > 2 * image.shape[0] * 0.9  # two panels
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "eval.json", "eval.md", "ppl_vs_length.png"]                         # no temp files


def test_a_report_cut_short_leaves_no_json_beside_new_files(tmp_path, monkeypatch):
    """eval.json marks a complete report: rewriting a report and stopping after the Markdown
    must not leave the earlier report's JSON beside the new table (a mix that looks complete).
    Control: the uninterrupted rewrite ends with a JSON again."""
    out = tmp_path / "out"
    report.write_reports(out, _runs())
    relabelled = [dict(run, label=run["label"] + " v2") for run in _runs()]

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(report, "plot_perplexity_vs_length", stopped)
        with pytest.raises(KeyboardInterrupt):
            report.write_reports(out, relabelled)
    assert "TAPE v2" in (out / "eval.md").read_text() and not (out / "eval.json").exists()
    report.write_reports(out, relabelled)
    assert "TAPE v2" in (out / "eval.json").read_text()



def test_two_reports_written_to_one_out_at_once_do_not_mix(tmp_path, monkeypatch):
    """Two tape-evals given the same --out: the one that finishes second waits for the
    first's three files, so the report left is the second's whole (not its table beside the
    first's plot and JSON). The first is held inside its plot until the second has started."""
    import threading

    out = tmp_path / "out"
    first, second = _runs(), [dict(run, label=run["label"] + " v2") for run in _runs()]
    plot, in_plot, go_on = report.plot_perplexity_vs_length, threading.Event(), threading.Event()

    def held_plot(runs, path):
        if runs is first:
            in_plot.set()
            go_on.wait(timeout=60)
        return plot(runs, path)

    monkeypatch.setattr(report, "plot_perplexity_vs_length", held_plot)
    writer = threading.Thread(target=report.write_reports, args=(out, first))
    writer.start()
    assert in_plot.wait(timeout=60)                  # the first has written its table
    late = threading.Thread(target=report.write_reports, args=(out, second))
    late.start()
    late.join(timeout=2)  # it waits for the lock (without one it would finish meanwhile)
    go_on.set()
    writer.join(timeout=60)
    late.join(timeout=60)
    assert not writer.is_alive() and not late.is_alive()
    labels = {m["label"] for m in json.loads((out / "eval.json").read_text())["models"]}
    assert labels == {"TAPE v2", "RoPE v2"} and "TAPE v2" in (out / "eval.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.md", "ppl_vs_length.png"]

def test_failed_write_keeps_previous_file(tmp_path):
    target = tmp_path / "eval.json"
    target.write_text("previous")

    def crash(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        report.write_atomic(target, crash)
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]


class StateDictEngine:
    """Writes the model states file DeepSpeed writes at ZeRO stage 0/1."""

    def __init__(self, model):
        self.model = model

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        tag_dir = ckpt.Path(save_dir) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.model.state_dict()}, tag_dir / "mp_rank_00_model_states.pt")


def make_checkpoint(run_dir, pe, seed, step=5, vocab_size=50, data=None, seq_len=8,
                    train=None, meta=None, eval_section=None, loader=None, **model_overrides):
    torch.manual_seed(seed)
    cfg = load_model_config("tiny", **{"num_layers": 1, "hidden_size": 32, "num_heads": 2,
                                       "intermediate_size": 64, "vocab_size": vocab_size,
                                       "pe": pe, "tape_position_size": 8, **model_overrides})
    model = TransformerLM(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    config = {"model": cfg.to_dict(), "train": {"seq_len": seq_len, "seed": 7,
                                                "synthetic_data": data is None, **(train or {})}}
    if data is not None:
        config["data"] = data
    if eval_section is not None:
        config["eval"] = eval_section
    ckpt.save_checkpoint(StateDictEngine(model), run_dir, step, rank=0,
                         meta={"step": step, "world_size": 1, "zero_stage": 0,
                               "config": config, **(meta or {})},
                         rank_state={"rng": ckpt.capture_rng_state(), "loader": loader},
                         keep=2)
    return model


def test_tape_eval_two_checkpoints_end_to_end(tmp_path, capsys):
    tape = make_checkpoint(tmp_path / "tape", "tape", seed=1)
    rope = make_checkpoint(tmp_path / "rope", "rope", seed=2)
    out = tmp_path / "report"
    rc = main(["--checkpoint", str(tmp_path / "tape"),
               str(tmp_path / "rope" / "checkpoints" / "step_00000005"),
               "--label", "TAPE", "RoPE", "--lengths", "8", "16", "--max-tokens", "40",
               "--batch-size", "3", "--dtype", "fp32", "--out", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| TAPE | sliding | 16 | 2× | 8 |" in stdout and "eval.json" in stdout
    payload = json.loads((out / "eval.json").read_text())
    assert [m["label"] for m in payload["models"]] == ["TAPE", "RoPE"]
    assert [m["pe"] for m in payload["models"]] == ["tape", "rope"]
    assert (out / "ppl_vs_length.png").read_bytes().startswith(PNG_MAGIC)
    # Same numbers as evaluating the saved weights directly on the run's synthetic documents.
    for model, entry in zip((tape, rope), payload["models"]):
        assert entry["step"] == 5 and entry["train_seq_len"] == 8
        docs = list(synthetic_held_out(50, 8 * 8, 7))   # the run's lengths: 8L of seq_len 8
        for protocol in ("nonoverlap", "sliding"):
            want = evaluate_perplexity(model.float(), docs, lengths=[8, 16], protocol=protocol,
                                       max_tokens=40)
            got = [r for r in entry["results"] if r["protocol"] == protocol]
            for w, g in zip(want, got):
                assert g["tokens"] == w["tokens"] == 40
                assert g["nll_sum"] == pytest.approx(w["nll_sum"], rel=1e-5)
    # Negative control: the two models really produce different numbers.
    assert payload["models"][0]["results"][0]["nll_sum"] != pytest.approx(
        payload["models"][1]["results"][0]["nll_sum"], rel=1e-6)


def test_auto_dtype_follows_a_checkpoint_trained_in_fp32(tmp_path, monkeypatch, caplog):
    """``--dtype auto`` evaluates in fp32 when a checkpoint trained in fp32 (as its scheduled
    evaluation did: bf16 would move its numbers), even where bf16 is fast; a run trained in
    bf16 gets the device's choice."""
    import logging

    from tape_train import precision

    fast = precision.PrecisionChoice("bf16", "bf16 is fast here (test)")
    monkeypatch.setattr(precision, "resolve_dtype", lambda requested, device_type: fast)
    make_checkpoint(tmp_path / "fp32", "tape", seed=1, train={"dtype": "fp32"})
    make_checkpoint(tmp_path / "bf16", "rope", seed=2, train={"dtype": "bf16"})
    common = ["--lengths", "8", "--max-tokens", "16", "--protocols", "nonoverlap",
              "--no-progress"]

    def dtype_of(*runs: str) -> str:
        out = tmp_path / "out"
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert main(["--checkpoint", *(str(tmp_path / r) for r in runs), *common,
                         "--out", str(out)]) == 0
        return json.loads((out / "eval.json").read_text())["settings"]["dtype"]

    assert dtype_of("fp32", "bf16") == "fp32"
    assert f"{tmp_path / 'fp32'}" in caplog.text and "trained in fp32" in caplog.text
    assert dtype_of("bf16") == "bf16"          # negative control: the device's choice


def test_a_synthetic_run_is_scored_on_the_documents_its_scheduled_evaluation_used(tmp_path,
                                                                                    caplog):
    """A run trained on synthetic data has random held-out documents sized by its eval
    lengths; tape-eval scores the same ones (the trainer's own source), whatever lengths it is
    asked up to the run's, so its numbers are the logged ones; bits per byte is bits per
    token. Control: a longer length needs longer documents, and the report says so."""
    from types import SimpleNamespace

    from tape_train.config import RunConfig
    from tape_train.train.loop import Trainer

    eval_section = {"interval": 2, "lengths": [8, 16], "max_tokens": None}
    model = make_checkpoint(tmp_path / "run", "tape", seed=4, eval_section=eval_section)
    run_cfg = RunConfig.from_dict({"model": model.cfg.to_dict(), "eval": eval_section,
                                   "train": {"seq_len": 8, "seed": 7, "synthetic_data": True}})
    trainer_docs = list(Trainer._eval_document_source(SimpleNamespace(
        cfg=run_cfg, eval_documents_fn=None)))
    logged = evaluate_perplexity(model.float(), trainer_docs, lengths=[8], protocol="nonoverlap")
    out = tmp_path / "report"
    base = ["--checkpoint", str(tmp_path / "run"), "--protocols", "nonoverlap", "--max-tokens",
            "all", "--dtype", "fp32", "--no-progress"]
    assert main([*base, "--lengths", "8", "--out", str(out)]) == 0
    payload = json.loads((out / "eval.json").read_text())
    [r] = payload["models"][0]["results"]
    assert r["tokens"] == logged[0]["tokens"] == 4 * 32            # 4 documents of 33 tokens
    assert r["nll_sum"] == pytest.approx(logged[0]["nll_sum"], rel=1e-6)
    assert r["bytes"] == r["tokens"]                                 # one byte per prediction
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2))
    assert "not the run's own" not in payload["settings"]["data"]
    # Control: L=32 is beyond the run's lengths: longer documents, said in the log and report.
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):
        assert main([*base, "--lengths", "8", "32", "--out", str(out)]) == 0
    payload = json.loads((out / "eval.json").read_text())
    assert payload["models"][0]["results"][0]["tokens"] == 4 * 64
    assert "not the run's own held-out documents" in payload["settings"]["data"]
    assert "not comparable with the ones in the run's log" in caplog.text


def test_tape_eval_on_a_data_config_with_real_text(tmp_path):
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=300_000)
    texts = real_text_documents(max_documents=12)
    write_jsonl(tmp_path / "train.jsonl", texts[:6])
    write_jsonl(tmp_path / "heldout.jsonl", texts[6:])
    data = {"sources": [{"path": str(tmp_path / "train.jsonl")}], "tokenizer": tok.path,
            "eval_sources": [{"path": str(tmp_path / "heldout.jsonl")}]}
    make_checkpoint(tmp_path / "run", "tape", seed=3, vocab_size=tok.vocab_size, data=data)
    out = tmp_path / "report"
    rc = main(["--checkpoint", str(tmp_path / "run"), "--protocols", "nonoverlap",
               "--max-tokens", "300", "--out", str(out), "--no-progress"])
    assert rc == 0
    results = json.loads((out / "eval.json").read_text())["models"][0]["results"]
    assert [r["length"] for r in results] == [8, 16, 32, 64]    # default L..8L of seq_len 8
    for r in results:
        assert r["tokens"] == 300 and 300 < r["bytes"] < 300 * 16   # bytes of real text
        assert r["bits_per_byte"] == pytest.approx(r["nll_sum"] / (math.log(2) * r["bytes"]))
        assert r["bytes"] == pytest.approx(results[0]["bytes"])     # same text at every L
        assert r["capped"] and float(r["bytes"]).is_integer()  # the cut text's own bytes
    # The report says the cap cut the held-out set, and what was measured.
    table = (out / "eval.md").read_text()
    assert "| 300 ‡ |" in table and "‡ max_tokens=300 cut the held-out set" in table
    assert "## What was measured" in table and "- max_tokens: 300 (the first 300" in table
    # The trainer's scheduled evaluation knows it too, also with the cap on the end of a
    # document (its cached copy of the held-out set keeps the flag).
    from types import SimpleNamespace

    from tape_train.config import RunConfig
    from tape_train.data import iter_eval_documents
    from tape_train.eval.perplexity import evaluate_schedule
    from tape_train.train.loop import Trainer

    first = len(next(iter_eval_documents(data, tok))[0]) - 1
    cfg = RunConfig.from_dict({"model": "tiny", "data": data, "train": {"seq_len": 8},
                               "eval": {"max_tokens": first, "lengths": [8],
                                        "protocols": ["nonoverlap"]}})
    trainer = SimpleNamespace(cfg=cfg, eval_documents_fn=None, tokenizer=None)
    [scheduled] = evaluate_schedule(RecordingModel(), Trainer._eval_document_source(trainer),
                                    cfg.eval, train_seq_len=8)
    assert scheduled["capped"] and scheduled["tokens"] == first and scheduled["documents"] == 1
    # Control: the whole held-out set is not cut, and the table has no mark.
    assert main(["--checkpoint", str(tmp_path / "run"), "--protocols", "nonoverlap",
                 "--lengths", "8", "--max-tokens", "all", "--out", str(out),
                 "--no-progress"]) == 0
    [whole] = json.loads((out / "eval.json").read_text())["models"][0]["results"]
    assert not whole["capped"] and whole["tokens"] > 300
    table = (out / "eval.md").read_text()
    assert "‡" not in table and "- max_tokens: all" in table


def test_bits_per_byte_counts_the_bytes_of_exactly_the_text_scored(tmp_path):
    """The held-out documents carry where each token's text ends, so a document cut by
    max_tokens counts the bytes of its scored prefix (as decoded), and without BOS the first
    token (never predicted) counts none; multi-byte characters count their UTF-8 bytes.
    Control: without those ends the cut document's bytes are prorated, and differ."""
    from tape_train.data import iter_eval_documents
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=300_000)
    prose = next(t for t in real_text_documents() if t.isascii() and t[0].isalpha()
                 and len(t) > 1500)
    unicode = "Crème brûlée — naïve café, 日本語のテキスト 🙂 and    spaces\tand tabs.\n"
    held_out = [prose, unicode, "    an indented line."]
    write_jsonl(tmp_path / "heldout.jsonl", held_out)
    sizes = [len(t.encode("utf-8")) for t in held_out]
    data = {"sources": [{"path": str(tmp_path / "heldout.jsonl")}], "tokenizer": tok.path,
            "eval_sources": [{"path": str(tmp_path / "heldout.jsonl")}]}

    def scored_bytes(documents, max_tokens=None, protocol="sliding"):
        [r] = evaluate_perplexity(RecordingModel(), documents, lengths=[16], protocol=protocol,
                                  max_tokens=max_tokens)
        return r["bytes"]

    docs = list(iter_eval_documents(data, tok, byte_ends=True))
    assert [n for _, n, _ in docs] == sizes
    for protocol in ("nonoverlap", "sliding"):
        assert scored_bytes(docs, protocol=protocol) == sum(sizes)   # every byte, once
    cap = 301                                  # inside the first document
    prefix = tok.decode(docs[0][0][1:cap + 1]).encode("utf-8")
    assert prose.encode("utf-8").startswith(prefix) and 0 < len(prefix) < sizes[0]
    assert scored_bytes(docs, cap) == scored_bytes(docs, cap, "nonoverlap") == len(prefix)
    # Control: the same documents without their ends prorate the cut one.
    pairs = [(ids, n) for ids, n, _ in docs]
    assert scored_bytes(pairs) == pytest.approx(sum(sizes))
    assert scored_bytes(pairs, cap) == pytest.approx(sizes[0] * cap / (len(docs[0][0]) - 1))
    assert scored_bytes(pairs, cap) != pytest.approx(len(prefix), abs=0.5)
    # Without BOS the first token is context only: its text is not counted (the indented
    # line's first token is spaces).
    no_bos = list(iter_eval_documents(dict(data, add_bos=False), tok, byte_ends=True))
    first_text = [len(tok.decode(ids[:1]).encode("utf-8")) for ids, _, _ in no_bos]
    assert first_text[2] > 0
    assert scored_bytes(no_bos) == sum(sizes) - sum(first_text)


def test_a_tokenizer_other_than_the_runs_is_refused_by_eval_and_export(tmp_path, capsys,
                                                                         caplog, monkeypatch):
    """tape-eval --tokenizer and tape-export --tokenizer with a tokenizer of the right size that
    the run did not train with scored (ppl 6831) and bundled it without a word: the model's ids
    read as other pieces. The sha256 the run's loader state recorded is compared: refused,
    naming both, before any weights are read; --allow-other-tokenizer goes on with a warning.
    The run's own data.tokenizer path retrained since is the same mistake. Control: the run's
    tokenizer, given or by default, is accepted."""
    from tape_train.data import DataConfig, build_train_loader
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl
    from tape_train.inference.export import main as export_main

    texts = real_text_documents(max_documents=12)
    write_jsonl(tmp_path / "train.jsonl", texts[:6])
    write_jsonl(tmp_path / "heldout.jsonl", texts[6:])
    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=300_000)
    other = train_small_tokenizer(tmp_path / "other", vocab_size=512, max_bytes=120_000)
    assert other.sha256 != tok.sha256 and other.vocab_size == tok.vocab_size
    data = {"sources": [{"path": str(tmp_path / "train.jsonl")}], "tokenizer": tok.path,
            "eval_sources": [str(tmp_path / "heldout.jsonl")]}
    loader = build_train_loader(DataConfig(**data), tok, seq_len=8, micro_batch_size=2)
    next(loader)
    state = loader.state_dict()  # what the trainer saves: its fingerprint holds the sha256
    loader.close()
    make_checkpoint(tmp_path / "run", "tape", seed=3, vocab_size=512, data=data, loader=state)

    def evaluate(*extra):
        return main(["--checkpoint", str(tmp_path / "run"), "--protocols", "nonoverlap",
                     "--lengths", "8", "--max-tokens", "100", "--out", str(tmp_path / "ev"),
                     "--no-progress", *extra])

    def export(name, *extra):
        return export_main([str(tmp_path / "run"), "--out", str(tmp_path / name), *extra])

    capsys.readouterr()
    assert evaluate("--tokenizer", other.path) == 1
    err = capsys.readouterr().err
    assert f"tokenizer {other.path} (sha256 {other.sha256[:12]}…) is not the one " in err
    assert f"trained with (sha256 {tok.sha256[:12]}…, its data.tokenizer {tok.path}): " in err
    assert "--allow-other-tokenizer" in err and not (tmp_path / "ev").exists()
    assert export("a", "--tokenizer", other.path) == 1
    assert f"(sha256 {tok.sha256[:12]}…" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    with caplog.at_level(logging.WARNING):
        assert evaluate("--tokenizer", other.path, "--allow-other-tokenizer") == 0
        assert export("b", "--tokenizer", other.path, "--allow-other-tokenizer") == 0
    assert sum("--allow-other-tokenizer:" in r.getMessage() for r in caplog.records) == 2
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert "not the tokenizer the run trained with" in json.dumps(report)
    # control: the run's own tokenizer, named or by default
    assert evaluate("--tokenizer", tok.path) == 0 and evaluate() == 0
    assert export("c", "--tokenizer", tok.path) == 0 and export("d") == 0
    # the run's data.tokenizer retrained in place since: refused by default too, the export
    # before the weights are consolidated
    good = Path(tok.path).read_bytes()
    Path(tok.path).write_bytes(Path(other.path).read_bytes())
    assert evaluate() == 1
    assert "a file that has changed since" in capsys.readouterr().err
    with monkeypatch.context() as m:
        m.setattr("tape_train.loading._consolidate", lambda *a: pytest.fail("consolidated"))
        assert export("e") == 1 and not (tmp_path / "e").exists()
    assert "a file that has changed since" in capsys.readouterr().err
    # tape-generate: a --tokenizer other than the export's own bundled one
    from tape_train.inference.generate import main as generate_main

    capsys.readouterr()
    sample = [str(tmp_path / "c"), "--prompt", "The", "--max-new-tokens", "3", "--device", "cpu",
              "--dtype", "fp32"]
    assert generate_main([*sample, "--tokenizer", other.path]) == 1
    err = capsys.readouterr().err
    assert f"is not the model's own, {tmp_path / 'c' / 'tokenizer.model'} (sha256 " in err, err
    assert generate_main([*sample, "--tokenizer", other.path, "--allow-other-tokenizer"]) == 0
    assert "--allow-other-tokenizer: decoding with it anyway" in capsys.readouterr().err
    assert generate_main([*sample, "--tokenizer", str(tmp_path / "c" / "tokenizer.model")]) == 0
    # a checkpoint: compared with the sha256 its run recorded, its data.tokenizer retrained
    # since too; a run whose data.tokenizer cannot be read any more takes a good --tokenizer
    run = [str(tmp_path / "run"), *sample[1:]]
    assert generate_main(run) == 1
    assert "a file that has changed since" in capsys.readouterr().err
    (tmp_path / "good.model").write_bytes(good)
    Path(tok.path).write_bytes(b"not a model")
    assert generate_main([*run, "--tokenizer", str(tmp_path / "good.model")]) == 0


def test_runs_of_two_tokenizers_evaluated_together_are_told_to_be_evaluated_apart(tmp_path,
                                                                                 capsys):
    """Two runs trained with different tokenizers, evaluated together: the refusal said to pass
    the first run's tokenizer with --tokenizer, which the second run would refuse in turn. It
    says that checkpoints evaluated together must share a tokenizer. Control: each run alone
    is evaluated."""
    from tape_train.data import DataConfig, build_train_loader
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    texts = real_text_documents(max_documents=12)
    write_jsonl(tmp_path / "train.jsonl", texts[:6])
    write_jsonl(tmp_path / "heldout.jsonl", texts[6:])
    runs = []
    for name, max_bytes in (("a", 300_000), ("b", 120_000)):
        tok = train_small_tokenizer(tmp_path / f"tok-{name}", vocab_size=512,
                                    max_bytes=max_bytes)
        data = {"sources": [{"path": str(tmp_path / "train.jsonl")}], "tokenizer": tok.path,
                "eval_sources": [str(tmp_path / "heldout.jsonl")]}
        loader = build_train_loader(DataConfig(**data), tok, seq_len=8, micro_batch_size=2)
        next(loader)
        make_checkpoint(tmp_path / name, "tape", seed=3, vocab_size=512, data=data,
                        loader=loader.state_dict())
        loader.close()
        runs.append(str(tmp_path / name))

    def evaluate(*checkpoints):
        return main(["--checkpoint", *checkpoints, "--protocols", "nonoverlap", "--lengths",
                     "8", "--max-tokens", "100", "--out", str(tmp_path / "ev"), "--no-progress"])

    capsys.readouterr()
    assert evaluate(*runs) == 1
    err = capsys.readouterr().err
    assert "checkpoints evaluated together must share a tokenizer (evaluate them separately" \
        in err, err
    assert "pass the run's tokenizer with --tokenizer" not in err
    assert evaluate(runs[0]) == 0 and evaluate(runs[1]) == 0


def test_a_run_read_from_another_directory_finds_the_data_and_tokenizer_it_named(
        tmp_path, monkeypatch, caplog):
    """A run's config names its data and tokenizer as given, often relative to the project
    directory it was started from; tape-eval and tape-export run from elsewhere find them
    there (from where the run lies, or the directory recorded in the marker), with the same
    numbers. Control: a run whose place says nothing and that recorded nothing."""
    import shutil

    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl
    from tape_train.inference.export import main as export_main

    project = tmp_path / "project"
    tok = train_small_tokenizer(project / "data" / "tok", vocab_size=512, max_bytes=300_000)
    texts = real_text_documents(max_documents=12)
    write_jsonl(project / "data" / "train.jsonl", texts[:6])
    write_jsonl(project / "data" / "heldout.jsonl", texts[6:])
    data = {"sources": [{"path": "data/train.jsonl"}],
            "tokenizer": str(Path(tok.path).relative_to(project)),
            "eval_sources": ["data/held*.jsonl"]}
    make_checkpoint(project / "runs" / "r", "tape", seed=3, vocab_size=tok.vocab_size,
                    data=data, train={"run_dir": "runs/r"})
    # The same run copied where its place says nothing; once with the directory it started
    # from recorded (as the trainer does), once without.
    shutil.copytree(project / "runs" / "r", tmp_path / "copy-recorded")
    make_checkpoint(tmp_path / "copy-bare", "tape", seed=3, vocab_size=tok.vocab_size,
                    data=data, train={"run_dir": "runs/r"})
    recorded = tmp_path / "copy-recorded" / "checkpoints" / "step_00000005" / "COMPLETE.json"
    marker = json.loads(recorded.read_text())
    recorded.write_text(json.dumps({**marker, "launch_dir": str(project)}))

    def evaluate(run, out):
        return main(["--checkpoint", str(run), "--protocols", "nonoverlap", "--lengths", "8",
                     "--max-tokens", "200", "--out", str(out), "--no-progress"])

    monkeypatch.chdir(project)
    assert evaluate("runs/r", tmp_path / "here") == 0
    expected = json.loads((tmp_path / "here" / "eval.json").read_text())["models"][0]["results"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for run in (project / "runs" / "r", tmp_path / "copy-recorded"):
        out = tmp_path / f"report-{run.name}"
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert evaluate(run, out) == 0
        assert f"data.eval_sources[0].path data/held*.jsonl is not under the working " \
               f"directory; using {project / 'data/held*.jsonl'}" in caplog.text
        assert f"data.tokenizer {data['tokenizer']} is not under the working directory; " \
               f"using {project / data['tokenizer']}" in caplog.text
        got = json.loads((out / "eval.json").read_text())["models"][0]["results"]
        assert [r["nll_sum"] for r in got] == [r["nll_sum"] for r in expected]
        assert export_main([str(run), "--out", str(tmp_path / f"export-{run.name}")]) == 0
        bundled = tmp_path / f"export-{run.name}" / "tokenizer.model"
        assert bundled.read_bytes() == Path(tok.path).read_bytes()
    # Control: nothing tells where the paths were relative to.
    assert evaluate(tmp_path / "copy-bare", tmp_path / "report-bare") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert export_main([str(tmp_path / "copy-bare"), "--out", str(tmp_path / "ex-bare")]) == 0
    assert f"tokenizer {data['tokenizer']} not found; exporting without it" in caplog.text
    assert not (tmp_path / "ex-bare" / "tokenizer.model").exists()


def test_lengths_no_held_out_document_reaches_are_refused_before_any_weights_are_read(
        tmp_path, monkeypatch, capsys):
    from tape_train import loading
    from tape_train.data.testing import train_small_tokenizer, write_jsonl

    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=300_000)
    write_jsonl(tmp_path / "heldout.jsonl", ["A short held-out document.", "Another one."])
    data = {"sources": [{"path": str(tmp_path / "heldout.jsonl")}], "tokenizer": tok.path,
            "eval_sources": [{"path": str(tmp_path / "heldout.jsonl")}]}
    make_checkpoint(tmp_path / "run", "tape", seed=3, vocab_size=tok.vocab_size, data=data)
    loads = []
    real_load = loading.load_model_from_checkpoint
    monkeypatch.setattr(loading, "load_model_from_checkpoint",
                        lambda *a, **k: loads.append(a) or real_load(*a, **k))
    args = ["--checkpoint", str(tmp_path / "run"), "--protocols", "nonoverlap",
            "--out", str(tmp_path / "report"), "--no-progress", "--lengths"]
    assert main(args + ["512", "1024"]) == 1
    err = capsys.readouterr().err
    assert "cannot evaluate L=512, L=1024: no held-out document reaches it" in err
    assert str(tmp_path / "run" / "checkpoints" / "step_00000005") in err
    assert loads == [] and not (tmp_path / "report").exists()
    # Control: one length reached, the other reported n/a after the evaluation.
    assert main(args + ["4", "1024"]) == 0
    assert len(loads) == 1


def test_tape_eval_errors_are_clear(tmp_path, capsys):
    make_checkpoint(tmp_path / "run", "rope", seed=4)
    assert main(["--checkpoint", str(tmp_path / "run"), "--label", "a", "b",
                 "--out", str(tmp_path / "o")]) == 1
    assert "--label got 2 name(s) for 1 checkpoint(s)" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "nothing-here"),
                 "--out", str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", ""]) == 1
    assert "--out '' is empty (an unset shell variable?)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "run"), "--lengths", "8", "--protocols",
                 "sliding", "--stride", "8", "--out", str(tmp_path / "o")]) == 1
    assert "tape-eval: error: --stride=8 must be smaller" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--lengths", "8", "0"], "--lengths (value 2) must be a positive integer, got 0"),
    (["--lengths", "8", "8"], "--lengths has duplicates: [8]"),
    (["--stride", "0"], "--stride must be a positive integer, got 0"),
    (["--lengths", "4", "8", "--stride", "4"],
     "--stride=4 must be smaller than every evaluation length, got length 4"),
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--protocols", "sliding", "sliding"], "--protocols has duplicates"),
    (["--max-tokens", "0"], "--max-tokens must be a positive integer or 'all', got '0'"),
    (["--protocols", "nonoverlap", "--stride", "4"],   # it would be recorded, and ignored
     "--stride is only used by --protocols sliding, which is not asked for (--protocols "
     "nonoverlap)"),
])
def test_tape_eval_errors_name_the_option_given_not_the_config_key(tmp_path, capsys, args,
                                                                   message):
    """The user typed options: the errors name them (the config keys are for a run config,
    whose errors keep naming `eval.<key>`, test_eval_config.py)."""
    make_checkpoint(tmp_path / "run", "rope", seed=4)
    assert main(["--checkpoint", str(tmp_path / "run"), *args, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"tape-eval: error: {message}" in err
    assert "eval." not in err.replace("eval.json", "")


def test_tape_eval_stride_too_large_for_the_default_lengths_says_where_they_come_from(
        tmp_path, capsys):
    make_checkpoint(tmp_path / "run", "rope", seed=4, seq_len=8)
    assert main(["--checkpoint", str(tmp_path / "run"), "--stride", "8",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert ("--stride=8 must be smaller than every evaluation length, got length 8" in err
            and "without --lengths the lengths are L, 2L, 4L, 8L of its train.seq_len=8" in err)
    assert str(tmp_path / "run" / "checkpoints" / "step_00000005") in err
    assert not (tmp_path / "o").exists()


def _torchrun(tmp_path, nproc, target, *args):
    """``python -m torch.distributed.run --standalone --nproc_per_node <nproc> <target>
    <args>``: what eval.sbatch runs on a node (``target`` ``-m tape_train.eval.cli`` or a
    script)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", *target, *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=180)


EVAL_ARGS = ["--lengths", "8", "16", "--max-tokens", "70", "--batch-size", "1", "--dtype",
             "fp32", "--no-progress"]


@pytest.mark.distributed
def test_tape_eval_on_two_gloo_ranks_equals_one_process(tmp_path, capsys):
    make_checkpoint(tmp_path / "run", "tape", seed=6)
    assert main(["--checkpoint", str(tmp_path / "run"), *EVAL_ARGS,
                 "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    proc = _torchrun(tmp_path, 2, ["-m", "tape_train.eval.cli"], "--checkpoint",
                     str(tmp_path / "run"), *EVAL_ARGS, "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "eval.json").read_text())
    two = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert (one["settings"]["world_size"], two["settings"]["world_size"]) == (1, 2)
    pairs = list(zip(one["models"][0]["results"], two["models"][0]["results"]))
    assert len(pairs) == 4                                   # 2 lengths x 2 protocols
    for want, got in pairs:
        assert got["tokens"] == want["tokens"] == 70 and got["windows"] == want["windows"]
        for key in ("nll_sum", "perplexity", "bytes", "bits_per_byte"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), key
    # Rank 0 alone writes and prints: one table, one set of files, one progress line each.
    assert proc.stdout.count("| model |") == 1 and proc.stdout.count("wrote ") == 1
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "eval.json", "eval.md", "ppl_vs_length.png"]
    assert proc.stderr.count("eval L=16 protocol=sliding") == 1
    assert "[rank1]" not in proc.stderr and "error" not in proc.stderr


WITNESS = """import atexit, os, sys
class Witness:
    def __del__(self, write=os.write):  # runs when the interpreter finalizes this module
        write(2, b"interpreter finalized\\n")
witness = Witness()
atexit.register(lambda: sys.stderr.write("atexit handlers ran\\n"))
from tape_train.eval.cli import main
sys.exit(main())
"""


@pytest.mark.distributed
def test_ranks_end_after_their_atexit_handlers_without_finalizing(tmp_path):
    """A rank of a multi-rank tape-eval ends without the interpreter's finalization, in which
    a gloo worker thread still releasing its last collective's tensors aborts the process
    (exit -6, about one two-rank run in eight here) and torchrun then ends rank 0, perhaps
    before its report is written. Its atexit handlers still run (logging, scratch removal).
    One process without a group (the control) finalizes as usual: the witness works."""
    make_checkpoint(tmp_path / "run", "tape", seed=6)
    script = tmp_path / "witness.py"
    script.write_text(WITNESS)
    args = ["--checkpoint", str(tmp_path / "run"), *EVAL_ARGS]
    proc = _torchrun(tmp_path, 2, [str(script)], *args, "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("atexit handlers ran") == 2, proc.stderr[-3000:]
    assert "interpreter finalized" not in proc.stderr
    assert (tmp_path / "two" / "eval.json").is_file()
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])))
    alone = subprocess.run([sys.executable, str(script), *args, "--out", str(tmp_path / "one")],
                           capture_output=True, text=True, cwd=tmp_path, timeout=180, env=env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "atexit handlers ran" in alone.stderr and "interpreter finalized" in alone.stderr


FAIL_ON_RANK_1 = """import os, sys
import tape_train.eval.perplexity as perplexity
real, calls = perplexity._forward, []
def forward(*args, **kwargs):   # rank 1 fails in its second batch; rank 0 goes on
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        raise RuntimeError("injected failure")
    return real(*args, **kwargs)
perplexity._forward = forward
from tape_train.eval.cli import main
sys.exit(main())
"""


@pytest.mark.distributed
def test_a_rank_that_fails_ends_the_job_without_a_hang_or_a_report(tmp_path):
    make_checkpoint(tmp_path / "run", "tape", seed=6)
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(FAIL_ON_RANK_1)
    proc = _torchrun(tmp_path, 2, [str(script)], "--checkpoint", str(tmp_path / "run"),
                     *EVAL_ARGS, "--out", str(tmp_path / "out"))   # a hang: TimeoutExpired
    assert proc.returncode != 0
    assert "tape-eval: error (rank 1 of 2): injected failure" in proc.stderr
    # Rank 0, waiting for rank 1 in the all-reduce, says why in one line of its own (unless
    # torchrun, which ends the other workers when one fails, was faster).
    rank0 = [line for line in proc.stderr.splitlines() if line.startswith("tape-eval: error: ")]
    assert len(rank0) <= 1 and all(line.startswith(
        "tape-eval: error: summing the results with the other ranks failed, most likely because "
        "another rank stopped (its own error is in this log): ") for line in rank0), rank0
    assert not (tmp_path / "out").exists()                 # no partial report


BUG_ON_RANK_0 = """import os, sys
import tape_train.eval.cli as cli
real = cli._held_out
def held_out(*args, **kwargs):   # a bug (not an input error) on rank 0 while reading inputs
    if os.environ["RANK"] == "0":
        raise KeyError("injected bug")
    return real(*args, **kwargs)
cli._held_out = held_out
sys.exit(cli.main())
"""


@pytest.mark.distributed
def test_a_bug_on_rank_zero_while_reading_the_inputs_ends_every_rank_saying_why(tmp_path):
    """Rank 0 ends with its traceback; rank 1, waiting for the inputs, says in one line that
    rank 0 stopped (it printed gloo's '[.../pair.cc:553] Connection closed by peer ... GLHF!'
    as if that were the error). torchrun looks every 5 s, so rank 1 speaks before it is ended."""
    make_checkpoint(tmp_path / "run", "tape", seed=6)
    script = tmp_path / "bug_on_rank_0.py"
    script.write_text(BUG_ON_RANK_0)
    proc = _torchrun(tmp_path, 2, ["--monitor-interval=5", str(script)], "--checkpoint",
                     str(tmp_path / "run"), *EVAL_ARGS, "--out", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert "KeyError: 'injected bug'" in proc.stderr                 # rank 0's own traceback
    rank1 = [line for line in proc.stderr.splitlines() if line.startswith("tape-eval: error")]
    assert len(rank1) == 1 and rank1[0].startswith(
        "tape-eval: error (rank 1 of 2): receiving the inputs from rank 0 failed, most likely "
        "because another rank stopped (its own error is in this log): "), proc.stderr[-3000:]
    assert "pair.cc" not in rank1[0] and "GLHF" not in rank1[0]
    assert not (tmp_path / "out").exists()


COUNT_READS = """import os, sys
def counted(module, name, what):   # one line per call, tagged by rank
    real = getattr(module, name)
    def wrapper(*args, **kwargs):
        with open("reads.log", "a") as f:
            f.write(what + " " + os.environ["RANK"] + "\\n")
        return real(*args, **kwargs)
    setattr(module, name, wrapper)
import tape_train.checkpoint_layout as layout
import tape_train.eval.cli as cli
counted(layout, "verify_files", "checksums")
counted(cli, "_held_out", "held-out")
sys.exit(cli.main())
"""


@pytest.mark.distributed
def test_rank_zero_reads_the_inputs_once_and_an_input_error_is_printed_once(tmp_path):
    """Under torchrun rank 0 alone reads the checkpoints back against their checksums and the
    held-out data (once, not once per rank: one reader of a Hub dataset) and sends them to the
    others; an input error stops every rank before any weights are read and is printed once."""
    make_checkpoint(tmp_path / "run", "tape", seed=6)
    script = tmp_path / "count.py"
    script.write_text(COUNT_READS)
    reads = tmp_path / "reads.log"

    def errors(proc):
        return [line for line in proc.stderr.splitlines() if line.startswith("tape-eval: err")]

    def run(*extra):
        if reads.exists():
            reads.unlink()
        return _torchrun(tmp_path, 2, [str(script)], "--checkpoint", str(tmp_path / "run"),
                         *EVAL_ARGS, "--out", str(tmp_path / "o"), *extra)

    # A data config that does not exist: one line (before: one per rank).
    proc = run("--data", "no-such-data.yaml")
    assert proc.returncode != 0
    assert len(errors(proc)) == 1 and "no-such-data.yaml" in errors(proc)[0], proc.stderr[-3000:]
    assert errors(proc)[0].startswith("tape-eval: error: ")
    assert not reads.exists()   # found before any checkpoint or data is read, on any rank
    assert not (tmp_path / "o").exists()
    # A damaged checkpoint: found by rank 0's read-back, one line, the others stop quietly.
    shard = tmp_path / "run" / "checkpoints" / "step_00000005" / "mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run()
    assert proc.returncode != 0
    assert len(errors(proc)) == 1 and str(shard) in errors(proc)[0], proc.stderr[-3000:]
    assert not (tmp_path / "o").exists()
    # Control: restored, the same two ranks evaluate and write the report, rank 0 having read
    # the inputs for both.
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run()
    assert proc.returncode == 0 and not errors(proc), proc.stderr[-3000:]
    assert (tmp_path / "o" / "eval.json").is_file()
    assert sorted(reads.read_text().split("\n")[:-1]) == ["checksums 0", "held-out 0"]


def test_checkpoints_of_different_vocabularies_are_refused_before_evaluating(tmp_path, capsys):
    make_checkpoint(tmp_path / "big", "tape", seed=1, vocab_size=50)
    make_checkpoint(tmp_path / "small", "rope", seed=2, vocab_size=20)
    args = ["--lengths", "8", "--max-tokens", "40", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(["--checkpoint", str(tmp_path / "big"), str(tmp_path / "small"), *args]) == 1
    err = capsys.readouterr().err
    assert "small" in err and "vocabulary of 20" in err and "share a tokenizer" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    # Control: the smaller vocabulary first, its token ids fit the larger one.
    assert main(["--checkpoint", str(tmp_path / "small"), str(tmp_path / "big"), *args]) == 0


def test_table_and_plot_mark_unmeasured_and_few_token_lengths(tmp_path):
    thin = dict(_result(128, "nonoverlap", 30.0), documents_at_length=2, windows_at_length=3,
                tokens_at_length=384, measured=True, few_tokens=True)
    solid = dict(_result(64, "nonoverlap", 20.0), documents_at_length=40, windows_at_length=90,
                 tokens_at_length=5760, measured=True, few_tokens=False)
    none = dict(_result(256, "nonoverlap", 30.0), perplexity=math.nan, loss=math.nan,
                bits_per_byte=math.nan, documents_at_length=0, windows_at_length=0,
                tokens_at_length=0, measured=False, few_tokens=True)
    runs = [{"label": "TAPE", "train_seq_len": 64, "results": [solid, thin, none]}]
    table = report.format_table(runs)
    assert "| TAPE | nonoverlap | 64 | 1× | – | 20.000 | " in table          # no mark
    assert "| TAPE | nonoverlap | 128 | 2× | – | 30.000 † |" in table
    assert "| 2 | 3 | 384 |" in table and "fewer than 1000 tokens" in table
    assert "| TAPE | nonoverlap | 256 | 4× | – | n/a | n/a | n/a |" in table
    paths = report.write_reports(tmp_path, runs)
    assert json.loads(paths["json"].read_text())["models"][0]["results"][2]["perplexity"] is None
    assert paths["plot"].read_bytes().startswith(PNG_MAGIC)


def test_tape_eval_refuses_a_damaged_checkpoint(tmp_path, capsys):
    make_checkpoint(tmp_path / "run", "rope", seed=4)
    tag = tmp_path / "run" / "checkpoints" / "step_00000005"
    shard = tag / "mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01                     # one bit, size unchanged
    shard.write_bytes(bytes(data))
    args = ["--lengths", "8", "--max-tokens", "16", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(["--checkpoint", str(tmp_path / "run"), *args]) == 1
    err = capsys.readouterr().err
    assert "damaged" in err and str(shard) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    from tape_train.inference.export import main as export_main

    assert export_main([str(tag), "--out", str(tmp_path / "export")]) == 1
    assert str(shard) in capsys.readouterr().err and not (tmp_path / "export").exists()
    data[len(data) // 2] ^= 0x01                     # negative control: restored, accepted
    shard.write_bytes(bytes(data))
    assert main(["--checkpoint", str(tmp_path / "run"), *args]) == 0


def test_checkpoints_trained_with_different_tokenizers_of_one_size_are_refused(tmp_path, capsys):
    """Two runs whose tokenizers have the same vocabulary size but are different files: the
    second was scored on ids of the first's tokenizer, silently meaningless numbers."""
    import shutil

    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    bpe = train_small_tokenizer(tmp_path / "bpe", vocab_size=512, max_bytes=200_000)
    uni = train_small_tokenizer(tmp_path / "uni", vocab_size=512, model_type="unigram",
                                max_bytes=200_000)
    write_jsonl(tmp_path / "heldout.jsonl", real_text_documents(max_documents=6))
    shutil.copy(bpe.path, tmp_path / "same.model")  # another file with the same bytes
    for name, tok in (("a", bpe.path), ("a-copy", str(tmp_path / "same.model")),
                      ("b", uni.path)):
        data = {"sources": [{"path": str(tmp_path / "heldout.jsonl")}], "tokenizer": tok,
                "eval_sources": [{"path": str(tmp_path / "heldout.jsonl")}]}
        make_checkpoint(tmp_path / name, "tape", seed=3, vocab_size=512, data=data)
    args = ["--lengths", "8", "--protocols", "nonoverlap", "--max-tokens", "40",
            "--out", str(tmp_path / "o"), "--no-progress", "--dtype", "fp32"]
    assert main(["--checkpoint", str(tmp_path / "a"), str(tmp_path / "b"), *args]) == 1
    err = capsys.readouterr().err
    assert f"trained with tokenizer {uni.path}" in err and "must share a tokenizer" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
    # Controls: the same tokenizer file (or one with the same bytes) is evaluated; so is any
    # pair when --tokenizer chooses one for all.
    assert main(["--checkpoint", str(tmp_path / "a"), str(tmp_path / "a-copy"), *args]) == 0
    assert main(["--checkpoint", str(tmp_path / "a"), str(tmp_path / "b"), *args,
                 "--tokenizer", bpe.path]) == 0


def test_a_checkpoint_rotated_away_while_another_is_evaluated_is_still_evaluated(
        tmp_path, capsys, monkeypatch):
    """tape-eval checks every checkpoint first and reads each one's weights at its turn; a run
    still training deletes its older tags meanwhile (checkpoint.keep). Their files are held
    open from the start, so the deleted one is evaluated all the same, and nothing is left in
    the temp dir. Where they cannot be held, the error says what happened (it used to be the
    bare 'checkpoint path ... does not exist' of a typo, after the first model's evaluation)."""
    import contextlib
    import shutil
    import tempfile

    from tape_train import loading
    from tape_train.eval import perplexity

    # A temp dir of this test's own: other tests' processes (killed on purpose) may leave
    # their copies in the worker's.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    make_checkpoint(tmp_path / "a", "tape", seed=1)
    make_checkpoint(tmp_path / "b", "rope", seed=2)
    tag_b = tmp_path / "b" / "checkpoints" / "step_00000005"
    real = perplexity.evaluate_perplexity

    def evaluate_then_rotate(*args, **kwargs):
        results = real(*args, **kwargs)
        if tag_b.exists():
            shutil.rmtree(tag_b)                  # what the live run's rotation does
        return results

    def evaluate(out, *checkpoints) -> int:
        labels = ["A", "B"][-len(checkpoints):]
        return main(["--checkpoint", *map(str, checkpoints), "--label", *labels,
                     "--lengths", "8", "--max-tokens", "16", "--dtype", "fp32",
                     "--out", str(out), "--no-progress"])

    def perplexities(out) -> dict:
        models = json.loads((out / "eval.json").read_text())["models"]
        return {m["label"]: [(r["protocol"], r["length"], r["perplexity"])
                             for r in m["results"]] for m in models}

    monkeypatch.setattr(perplexity, "evaluate_perplexity", evaluate_then_rotate)
    assert evaluate(tmp_path / "o", tmp_path / "a", tag_b) == 0, capsys.readouterr().err
    assert not tag_b.exists()
    both = perplexities(tmp_path / "o")
    assert sorted(both) == ["A", "B"]
    assert not list(private_tmp.glob("tape-held-*"))
    # B's numbers are those of B evaluated with its tag in place.
    make_checkpoint(tmp_path / "b", "rope", seed=2)
    monkeypatch.setattr(perplexity, "evaluate_perplexity", real)
    assert evaluate(tmp_path / "o2", tag_b) == 0
    assert perplexities(tmp_path / "o2")["B"] == both["B"]

    # Without the hold (no /proc, too many files): one line naming what happened.
    @contextlib.contextmanager
    def not_held(tag_dir):
        yield tag_dir

    monkeypatch.setattr(loading, "held_checkpoint", not_held)
    monkeypatch.setattr(perplexity, "evaluate_perplexity", evaluate_then_rotate)
    capsys.readouterr()
    assert evaluate(tmp_path / "o3", tmp_path / "a", tag_b) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"checkpoint {tag_b} was deleted after tape-eval checked it at the start" in err
    assert "(evaluated since, and not reported: A)" in err and "checkpoint.keep" in err
    assert not (tmp_path / "o3" / "eval.json").exists()


def _legend_entries(monkeypatch, runs, path) -> list[str]:
    """The labels of every legend ``report.plot_perplexity_vs_length`` draws."""
    from matplotlib.axes import Axes

    shown = []
    legend = Axes.legend

    def record(ax, *args, **kwargs):
        shown.extend(ax.get_legend_handles_labels()[1])
        return legend(ax, *args, **kwargs)

    monkeypatch.setattr(Axes, "legend", record)
    report.plot_perplexity_vs_length(runs, path)
    return shown


def test_labels_keep_their_own_cell_and_show_literally_in_the_plot(tmp_path, monkeypatch):
    """A `|` in a --label shifted every number of its row under another header (a newline
    split the row); in the plot `$5 vs $10` became TeX math and a leading `_` hid the line
    from the legend."""
    import re

    labels = ["TAPE | ours\nv2", "cost $5 vs $10", "_baseline", "RoPE"]
    runs = [{"label": label, "train_seq_len": 8,
             "results": [_result(8, "nonoverlap", 10.0 + i), _result(16, "nonoverlap", 11.0 + i)]}
            for i, label in enumerate(labels)]
    table = report.format_table(runs)
    header, _, *rows = table.strip().splitlines()
    cells = lambda line: re.split(r"(?<!\\)\|", line)  # noqa: E731 - unescaped pipes
    assert len(rows) == 2 * len(labels)
    assert all(len(cells(row)) == len(cells(header)) for row in rows), table
    assert rows[0].startswith(r"| TAPE \| ours v2 | nonoverlap | 8 |")
    shown = _legend_entries(monkeypatch, runs, tmp_path / "p.png")
    assert shown[:4] == ["TAPE | ours\nv2", r"cost \$5 vs \$10", " _baseline", "RoPE"]
    # The JSON keeps the labels as given.
    report.write_json(tmp_path / "eval.json", runs)
    assert [m["label"] for m in json.loads((tmp_path / "eval.json").read_text())["models"]] \
        == labels


def test_checkpoints_trained_on_different_data_are_flagged(tmp_path, capsys, caplog):
    """Run b held out nothing of the text whose hashed 50 % run a held out: scored on a's
    held-out documents, b was scored on text it trained on, and nothing said so."""
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=200_000)
    write_jsonl(tmp_path / "text.jsonl", real_text_documents(max_documents=12))
    source = [{"path": str(tmp_path / "text.jsonl")}]
    for name, held_out, weight in (("a", 0.5, 1.0), ("a-too", 0.5, 2.0), ("b", 0.0, 1.0)):
        data = {"sources": [dict(source[0], weight=weight)], "tokenizer": tok.path,
                "eval_fraction": held_out}
        make_checkpoint(tmp_path / name, "tape", seed=3, vocab_size=512, data=data)
    out = tmp_path / "o"
    args = ["--lengths", "8", "--protocols", "nonoverlap", "--max-tokens", "40",
            "--out", str(out), "--no-progress", "--dtype", "fp32"]
    with caplog.at_level(logging.WARNING, logger="tape_train.eval"):
        assert main(["--checkpoint", str(tmp_path / "a"), str(tmp_path / "b"), *args]) == 0
    warned = [r.getMessage() for r in caplog.records if "trained on other data" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "b") in warned[0]
    assert "data.eval_fraction" in warned[0] and "may have seen in training" in warned[0]
    settings = json.loads((out / "eval.json").read_text())["settings"]
    assert "trained on different data" in settings["data"]
    # It says which text was scored (it said "checkpoint data config" alone).
    assert settings["data"].startswith(f"checkpoint data config (0.5 of the documents of "
                                       f"{tmp_path / 'text.jsonl'} (by text hash))")
    assert "trained on different data" in (out / "eval.md").read_text()
    # Control: the same documents (another mixture weight only) are not flagged.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tape_train.eval"):
        assert main(["--checkpoint", str(tmp_path / "a"), str(tmp_path / "a-too"), *args]) == 0
    assert not [r for r in caplog.records if "other data" in r.getMessage()]
    assert "different data" not in json.loads((out / "eval.json").read_text())["settings"]["data"]


@pytest.mark.parametrize("rope_train_len", [8, 16])
def test_each_training_length_line_says_whose_it_is(tmp_path, monkeypatch, rope_train_len):
    """Models trained at different lengths got two dashed lines and one legend entry,
    'training length', for the first: which line belonged to which model was not said."""
    runs = [{"label": label, "train_seq_len": train_len,
             "results": [_result(n, "nonoverlap", 10.0 + i) for n in (8, 16, 32)]}
            for i, (label, train_len) in enumerate((("TAPE", 8), ("RoPE", rope_train_len),
                                                    ("ALiBi", 8)))]
    shown = _legend_entries(monkeypatch, runs, tmp_path / "p.png")
    lines = [label for label in shown if label.startswith("training length")]
    if rope_train_len == 8:   # control: one training length, one plain entry
        assert lines == ["training length"]
    else:
        assert lines == ["training length 8: TAPE, ALiBi", "training length 16: RoPE"]


def test_a_report_inside_a_checkpoint_is_refused_before_evaluating(tmp_path, capsys):
    """`--out runs/x/checkpoints/step_N/eval` was written, and deleted with the tag when the
    run, still training, rotated it (checkpoint.keep)."""
    make_checkpoint(tmp_path / "run", "rope", seed=4)
    tag = tmp_path / "run" / "checkpoints" / "step_00000005"
    args = ["--checkpoint", str(tmp_path / "run"), "--lengths", "8", "--protocols",
            "nonoverlap", "--max-tokens", "16", "--dtype", "fp32", "--no-progress"]
    for out in (tag, tag / "eval"):
        assert main([*args, "--out", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f"tape-eval: error: --out {out} is inside the checkpoint {tag}, which "
                       f"training deletes with everything in it as it saves newer checkpoints "
                       f"(checkpoint.keep): write the report elsewhere, e.g. --out "
                       f"{tmp_path / 'run' / 'eval'}")
        assert not (out / "eval.json").exists()
    # Controls: beside the checkpoints, and a directory of one's own named like a tag.
    for out in (tmp_path / "run" / "eval", tmp_path / "reports" / "step_00000005"):
        assert main([*args, "--out", str(out)]) == 0
        assert (out / "eval.json").is_file()


def test_the_plot_says_when_the_cap_cut_the_data_and_which_lengths_have_no_point(tmp_path,
                                                                                monkeypatch):
    """The table marks capped token counts (‡) and unmeasured lengths (n/a); the plot showed
    neither: a capped curve looked like the whole held-out set, a missing point like a gap."""
    from matplotlib.figure import Figure

    said = []
    supxlabel = Figure.supxlabel
    monkeypatch.setattr(Figure, "supxlabel",
                        lambda fig, text, **kw: said.append(text) or supxlabel(fig, text, **kw))

    def runs(capped, unmeasured):
        results = [dict(_result(n, "nonoverlap", 10.0), capped=capped, max_tokens=300,
                        measured=True) for n in (8, 16, 32)]
        if unmeasured:
            results[2].update(measured=False, perplexity=math.nan)
        return [{"label": "TAPE", "train_seq_len": 8, "results": results}]

    report.plot_perplexity_vs_length(runs(True, True), tmp_path / "p.png")
    text = " ".join(said.pop().split())          # wrapped to the figure's width
    assert "only the first 300 predictions of the held-out set (max_tokens cut it)" in text
    assert "no point at L = 32: no held-out document reaches it" in text
    # Control: the whole held-out set, every length reached: nothing to say.
    report.plot_perplexity_vs_length(runs(False, False), tmp_path / "p.png")
    assert said == []


def test_the_report_names_the_held_out_documents(tmp_path):
    from tape_train.data import DataConfig
    from tape_train.eval.cli import held_out_words

    cfg = DataConfig.from_dict({"sources": [{"path": "train.jsonl"}],
                                "eval_sources": [{"path": "books.jsonl"}],
                                "eval_fraction": 0.05, "eval_min_tokens": 4096,
                                "eval_max_documents": 16})
    assert held_out_words(cfg) == ("data.eval_sources books.jsonl; then 0.05 of the documents "
                                   "of train.jsonl (by text hash); documents of >= 4096 "
                                   "tokens; the first 16 documents")
    assert held_out_words(DataConfig.from_dict({"sources": ["a.jsonl"]})) == \
        "no held-out source"


def test_a_missing_data_config_is_refused_before_the_checkpoints_are_read(tmp_path, capsys,
                                                                          monkeypatch):
    """A mistyped --data was found only after every checkpoint had been read back against its
    checksums (minutes for a large one)."""
    from tape_train import loading

    make_checkpoint(tmp_path / "run", "tape", seed=1)
    resolved = []
    real_resolve = loading.resolve_checkpoint
    monkeypatch.setattr(loading, "resolve_checkpoint",
                        lambda *a, **k: resolved.append(a) or real_resolve(*a, **k))
    args = ["--checkpoint", str(tmp_path / "run"), "--lengths", "8", "--protocols",
            "nonoverlap", "--out", str(tmp_path / "o"), "--no-progress", "--data"]
    assert main([*args, str(tmp_path / "no-such-data.yaml")]) == 1
    err = capsys.readouterr().err
    assert "tape-eval: error: data config" in err and "no-such-data.yaml' not found" in err
    assert resolved == []
    # Control: a data config that exists goes on to the checkpoints.
    from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

    tok = train_small_tokenizer(tmp_path / "tok", vocab_size=512, max_bytes=100_000)
    write_jsonl(tmp_path / "heldout.jsonl", real_text_documents(max_documents=4))
    (tmp_path / "data.yaml").write_text(json.dumps({
        "sources": [{"path": str(tmp_path / "heldout.jsonl")}], "tokenizer": tok.path,
        "eval_sources": [{"path": str(tmp_path / "heldout.jsonl")}]}))
    main([*args, str(tmp_path / "data.yaml")])
    assert len(resolved) == 1
