"""End-to-end trainer runs through the real CLI (subprocesses), on CPU fp32 with ZeRO-3.

A tiny TAPE model (2 layers, hidden 64, seq_len 32, micro-batch 2) trains 16 steps on real
text through the real data pipeline (a small corpus of Python-stdlib prose and code, a
512-token sentencepiece BPE, ``data.sharding: global`` so the global token stream does not
depend on the number of ranks, shuffling on), with a checkpoint every 5 steps and a perplexity
evaluation on the held-out documents at steps 8 and 16.

- 2 processes (grad_accum 1) match 1 process (grad_accum 2) on the same global batch.
- SIGKILL at a random step after the step-5 checkpoint (6..9; the kill races the run, so
  the resume may start from a later checkpoint), then re-running the same command,
  reproduces the uninterrupted per-step losses bit for bit, at 1 and at 2 processes.
- SIGUSR1 delivered to ONE of two workers: both ranks stop at the same step, write a
  checkpoint, ``launch/local.sh`` exits 75; re-running continues bit-exactly.
- A checkpoint without its completion marker (a save killed mid-write) is skipped: the re-run
  resumes from the previous complete one (bit-exact loss); a longer ``max_steps`` is reported
  and applied.
- Resuming with a different model shape is refused before anything is built.
- ``load_model_from_checkpoint`` consolidates the 1- and 2-process ZeRO-3 checkpoints; the
  consolidated model reproduces the perplexity the trainer logged at the last step.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS, CKPT_EVERY, EVAL_EVERY = 16, 5, 8

CONFIG = """\
model: {base: tiny, num_layers: 2, hidden_size: 64, num_heads: 4, intermediate_size: 128,
        vocab_size: 512, tape_position_size: 8, max_seq_len: 64}
data: {sources: ["%s"], tokenizer: "%s", sharding: global, shuffle: true, shuffle_buffer: 32,
       eval_fraction: 0.1, prefetch: 2}
train: {seq_len: 32, micro_batch_size: 2, max_steps: %d, lr: 1.0e-3, warmup_steps: 2,
        decay: cosine, dtype: fp32, device: cpu, seed: 11}
optim: {grad_clip: 1.0}
parallel: {zero_stage: 3}
checkpoint: {interval: %d, keep: 2}
eval: {interval: %d, lengths: [32, 64], protocols: [nonoverlap], max_tokens: 128, batch_size: 2}
logging: {console_interval: 1, peak_tflops: 1.0, tensorboard: false}
"""

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _command(nproc: int, config: Path, run_dir: Path, gas: int, *extra: str) -> list[str]:
    overrides = [f"train.run_dir={run_dir}", f"train.grad_accum_steps={gas}", *extra]
    return ["bash", str(REPO / "launch" / "local.sh"), str(nproc), "--config", str(config),
            *overrides]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHON=sys.executable, PYTHONWARNINGS="ignore")


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _losses(run_dir: Path) -> dict[int, float]:
    from tape_train.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def _events(run_dir: Path) -> list[dict]:
    from tape_train.train.metrics import read_metrics

    return read_metrics(run_dir, "event")


def _config(tmp_path_factory) -> Path:
    """The run config, with a small real-text corpus and tokenizer built on first use."""
    base = tmp_path_factory.getbasetemp()
    path = base / "train_resume_config.yaml"
    if not path.exists():
        from tape_train.data.testing import (real_text_documents, train_small_tokenizer,
                                             write_jsonl)

        corpus = write_jsonl(base / "corpus" / "train.jsonl", real_text_documents())
        train_small_tokenizer(base / "corpus", vocab_size=512)
        tokenizer = base / "corpus" / "small-bpe.model"
        assert tokenizer.is_file()
        path.write_text(CONFIG % (corpus, tokenizer, MAX_STEPS, CKPT_EVERY, EVAL_EVERY))
    return path


def _reference(tmp_path_factory, nproc: int, gas: int, *extra: str) -> Path:
    name = "".join(e.replace("parallel.", "").replace("=", "") for e in extra)
    run_dir = tmp_path_factory.mktemp(f"ref{nproc}p{name}")
    # keep=4: the step-10 checkpoints survive for the resume-on-another-layout tests.
    result = _run(_command(nproc, _config(tmp_path_factory), run_dir, gas, "checkpoint.keep=4",
                           *extra))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert sorted(_losses(run_dir)) == list(range(1, MAX_STEPS + 1))
    return run_dir


@pytest.fixture(scope="module")
def ref_1p(tmp_path_factory) -> Path:
    return _reference(tmp_path_factory, nproc=1, gas=2)


@pytest.fixture(scope="module")
def ref_2p(tmp_path_factory) -> Path:
    return _reference(tmp_path_factory, nproc=2, gas=1)


@pytest.fixture(scope="module")
def ref_sp2(tmp_path_factory) -> Path:
    """2 processes at SP2 (dp = 1, two accumulated micro-batches: one process's global batch)."""
    return _reference(tmp_path_factory, 2, 2, "parallel.sp=2")


@pytest.fixture(scope="module")
def ref_tp2(tmp_path_factory) -> Path:
    return _reference(tmp_path_factory, 2, 2, "parallel.tp=2")


def test_two_processes_match_one_process_on_the_same_global_batch(ref_1p, ref_2p):
    one, two = _losses(ref_1p), _losses(ref_2p)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5, abs=1e-6), step
    # The comparison has teeth: the losses move as training proceeds.
    assert len({round(v, 4) for v in one.values()}) > 5


@pytest.mark.parametrize("layout", ["ref_sp2", "ref_tp2"])
def test_sequence_and_tensor_parallel_training_match_one_process(layout, ref_1p, request):
    """The trainer end to end at SP2 / TP2 (dp = 1, same global batch as one process with two
    accumulated micro-batches): per-step losses and the scheduled evaluation agree."""
    from tape_train.train.metrics import read_metrics

    run_dir = request.getfixturevalue(layout)
    one, par = _losses(ref_1p), _losses(run_dir)
    assert sorted(par) == sorted(one)
    for step in one:
        assert par[step] == pytest.approx(one[step], rel=1e-5, abs=1e-6), (layout, step)
    ref_eval, par_eval = read_metrics(ref_1p, "eval"), read_metrics(run_dir, "eval")
    assert [r["step"] for r in par_eval] == [r["step"] for r in ref_eval] != []
    for ref_row, par_row in zip(ref_eval, par_eval):
        keys = [k for k in ref_row if k.startswith("eval/")]
        assert keys
        for key in keys:
            assert par_row[key] == pytest.approx(ref_row[key], rel=1e-5), (layout, key)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training ended (rc {proc.returncode}) before the kill point:\n"
                        f"{out[-2000:]}\n{err[-4000:]}")
        if time.monotonic() > deadline:
            _kill_tree(proc.pid)
            pytest.fail("timed out waiting for the kill point")
        time.sleep(0.02)


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                              text=True).stdout.split()
    out = []
    for child in map(int, children):
        out += [child, *_descendants(child)]
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant, deepest first (workers die before torchrun can
    react), like a node failure."""
    for victim in [*reversed(_descendants(pid)), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _checkpoint_complete(run_dir: Path, step: int) -> bool:
    from tape_train.train.checkpoint import tag_for_step, why_incomplete

    tag = run_dir / "checkpoints" / tag_for_step(step)
    return tag.is_dir() and why_incomplete(tag) is None


@pytest.mark.parametrize("nproc", [1, 2])
def test_exact_resume_after_sigkill(nproc, ref_1p, ref_2p, tmp_path_factory):
    reference = _losses(ref_1p if nproc == 1 else ref_2p)
    gas = 2 if nproc == 1 else 1
    kill_at = random.Random(1234 + nproc).randint(CKPT_EVERY + 1, 2 * CKPT_EVERY - 1)
    # The kill lands a poll and a process-tree walk after step kill_at; on a machine too busy
    # to run this test's process for the seconds the last steps take, the run can end first:
    # then once more, in a fresh run directory (the test needs a kill before the end).
    for attempt in range(2):
        run_dir = tmp_path_factory.mktemp(f"killed{nproc}p")
        cmd = _command(nproc, _config(tmp_path_factory), run_dir, gas)
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        _wait_for(lambda: _checkpoint_complete(run_dir, CKPT_EVERY)
                  and max(_losses(run_dir), default=0) >= kill_at, proc)
        _kill_tree(proc.pid)  # launcher, torchrun and the workers (in sessions of their own)
        proc.communicate()
        if not _checkpoint_complete(run_dir, MAX_STEPS):
            break
    assert not _checkpoint_complete(run_dir, MAX_STEPS), "the run finished before the kill"

    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-5000:]
    resumes = [e for e in _events(run_dir) if e["event"] == "resume"]
    assert resumes, "the re-run did not resume"
    from tape_train.train.checkpoint import step_of_tag

    assert CKPT_EVERY <= step_of_tag(Path(resumes[-1]["checkpoint"]).name) < MAX_STEPS
    assert _losses(run_dir) == reference  # bitwise: floats round-trip through JSON exactly


def _worker_pids(launcher: subprocess.Popen) -> list[int]:
    torchrun = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                              text=True).stdout.split()
    workers = []
    for pid in torchrun:
        workers += subprocess.run(["pgrep", "-P", pid], capture_output=True,
                                  text=True).stdout.split()
    return sorted(int(p) for p in workers)


def test_sigusr1_to_one_rank_checkpoints_exits_75_and_rerun_continues(ref_2p,
                                                                      tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("signal2p")
    cmd = _command(2, _config(tmp_path_factory), run_dir, 1)
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for(lambda: max(_losses(run_dir), default=0) >= 2, proc)
    workers = _worker_pids(proc)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGUSR1)  # one rank only: the ranks must agree by themselves
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-5000:]
    # torchrun's report of the stop says what it is, not a failure with a root cause.
    assert "torchrun: the workers stopped to be resumed (rank " in err, err[-5000:]
    assert "Root Cause" not in err and "FAILED" not in err, err[-5000:]
    stops = [e for e in _events(run_dir) if e["event"] == "stop"]
    assert stops and stops[-1]["exit_code"] == 75
    stopped_at = stops[-1]["step"]
    assert stopped_at < MAX_STEPS and _checkpoint_complete(run_dir, stopped_at)

    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-5000:]
    assert _losses(run_dir) == _losses(ref_2p)


def test_incomplete_checkpoint_is_skipped_and_harmless_config_change_applies(
        ref_1p, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("partial") / "run"
    shutil.copytree(ref_1p, run_dir)
    (run_dir / "metrics.jsonl").unlink()
    last = run_dir / "checkpoints" / f"step_{MAX_STEPS:08d}"
    previous = 3 * CKPT_EVERY  # keep=2: the checkpoints at 15 and 16 survive
    (last / "COMPLETE.json").unlink()  # what a save killed before its marker leaves behind
    shard = next(last.glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])

    # A longer run is a harmless change: reported, applied, not refused.
    result = _run(_command(1, _config(tmp_path_factory), run_dir, 2,
                           f"train.max_steps={MAX_STEPS + 1}", "eval.interval=0"))
    assert result.returncode == 0, result.stderr[-5000:]
    assert f"skipping checkpoint {last}" in result.stderr
    assert f"train.max_steps: {MAX_STEPS} -> {MAX_STEPS + 1}" in result.stderr
    resumes = [e for e in _events(run_dir) if e["event"] == "resume"]
    assert resumes[-1]["checkpoint"].endswith(f"step_{previous:08d}")
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(previous + 1, MAX_STEPS + 2))
    # The loss of step 16 is computed with the weights restored from step 15: bit-exact.
    assert losses[MAX_STEPS] == _losses(ref_1p)[MAX_STEPS]


def test_resume_with_another_model_shape_is_refused(ref_1p, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("shape") / "run"
    shutil.copytree(ref_1p / "checkpoints", run_dir / "checkpoints")
    result = _run(_command(1, _config(tmp_path_factory), run_dir, 2, "model.hidden_size=32",
                           f"train.max_steps={MAX_STEPS + 2}"))
    assert result.returncode == 1
    assert "refusing to resume" in result.stderr and "model.hidden_size" in result.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # refused before training anything


def test_bad_input_under_torchrun_is_its_line_and_the_failure_summary_not_a_traceback(
        tmp_path_factory):
    # launch/local.sh N > 1: torchrun wraps its report of the failed worker in a Python
    # traceback; local.sh prints the report alone after the trainer's own line.
    config = _config(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("badtok") / "run"
    result = _run(_command(2, config, run_dir, 1, "data.tokenizer=nope.model"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "tape-train: preflight: error: data.tokenizer: tokenizer nope.model: no such file" \
        in result.stderr, result.stderr[-3000:]
    assert "Root Cause (first observed failure)" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_bad_record_met_mid_run_is_one_line_not_a_traceback(tmp_path_factory):
    """A malformed line deep in the corpus passes the preflight (it reads the first documents)
    and is met by the loader mid-run: one error naming file:line, exit 1, no traceback, the
    checkpoint written before it intact."""
    import json

    from tape_train.data.testing import real_text_documents

    config = _config(tmp_path_factory)
    base = tmp_path_factory.mktemp("badrecord")
    docs = real_text_documents()[:12]  # a few steps of reading before the bad line
    lines = [json.dumps({"text": d}) for d in docs]
    bad_line = len(lines) // 2 + 1
    lines.insert(bad_line - 1, '{"text": "unterminated')
    corpus = base / "bad.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    tokenizer = config.parent / "corpus" / "small-bpe.model"
    run_dir = base / "run"
    result = _run(_command(1, config, run_dir, 1, f"data.sources=[{corpus}]",
                           f"data.tokenizer={tokenizer}", "data.shuffle=false",
                           "data.shuffle_buffer=4", "data.eval_fraction=0", "eval.interval=0",
                           "train.max_steps=100000",
                           "checkpoint.interval=2"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"bad.jsonl:{bad_line}: malformed JSON" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    from tape_train.checkpoint_layout import why_incomplete

    tags = sorted((run_dir / "checkpoints").glob("step_*"))
    assert tags and all(why_incomplete(t) is None for t in tags)


@pytest.mark.parametrize("which", ["ref_1p", "ref_2p"])
def test_consolidated_checkpoint_reproduces_logged_perplexity(which, request):
    from tape_train.eval.perplexity import evaluate_perplexity
    from tape_train.model import TransformerLM
    from tape_train.train.checkpoint import load_model_from_checkpoint
    from tape_train.train.metrics import read_metrics
    from tape_train.config import RunConfig
    from tape_train.data import iter_eval_documents, load_tokenizer

    run_dir = request.getfixturevalue(which)
    model_cfg, state, meta = load_model_from_checkpoint(run_dir)
    assert meta["step"] == MAX_STEPS and meta["world_size"] == (1 if which == "ref_1p" else 2)
    model = TransformerLM(model_cfg)
    model.load_state_dict(state, strict=True)
    data_cfg = RunConfig.from_dict(meta["config"]).data
    docs = iter_eval_documents(data_cfg, load_tokenizer(data_cfg.tokenizer))
    results = evaluate_perplexity(model, docs, lengths=[32, 64], protocol="nonoverlap",
                                  max_tokens=128, batch_size=2)
    logged = [r for r in read_metrics(run_dir, "eval") if r["step"] == MAX_STEPS][-1]
    for got in results:
        want = logged[f"eval/ppl/nonoverlap/L{got['length']}"]
        assert got["perplexity"] == pytest.approx(want, rel=1e-5)
    # Negative control: the step-8 evaluation (other weights) differs.
    early = [r for r in read_metrics(run_dir, "eval") if r["step"] == EVAL_EVERY][-1]
    assert early["eval/ppl/nonoverlap/L32"] != pytest.approx(results[0]["perplexity"],
                                                             rel=1e-5)


def test_export_of_a_zero3_checkpoint_loads_without_deepspeed_and_partial_is_refused(
        ref_2p, tmp_path):
    """tape-export on the 2-rank ZeRO-3 run: the exported model gives the consolidated
    checkpoint's logits; tape-generate streams from it; an incomplete checkpoint is refused."""
    import torch

    from tape_train.model import TransformerLM, from_pretrained
    from tape_train.train.checkpoint import find_latest_complete, load_model_from_checkpoint

    out = tmp_path / "export"
    result = _run([sys.executable, "-m", "tape_train.inference.export", str(ref_2p),
                   "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors", "config.json", "tokenizer.model", "export.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}
    cfg, state, _ = load_model_from_checkpoint(ref_2p)
    direct = TransformerLM(cfg).eval()
    direct.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_pretrained(out)(ids).logits, direct(ids).logits)
    gen = _run([sys.executable, "-m", "tape_train.inference.generate", str(out), "--prompt",
                "The", "--max-new-tokens", "8", "--temperature", "0"])
    assert gen.returncode == 0 and gen.stdout.startswith("The"), gen.stderr[-2000:]
    # A checkpoint without its completion marker is refused, and nothing is written.
    partial = tmp_path / "partial_run"
    shutil.copytree(ref_2p, partial)
    tag = find_latest_complete(partial)
    (tag / "COMPLETE.json").unlink()
    bad = _run([sys.executable, "-m", "tape_train.inference.export", str(tag), "--out",
                str(tmp_path / "bad")])
    assert bad.returncode == 1 and "is not complete" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists()


def test_readers_of_a_zero_checkpoint_keep_deepspeed_off_stdout(ref_2p, tmp_path):
    """tape-generate and tape-eval straight from the ZeRO-3 run (not an export): DeepSpeed's
    import warning and its consolidation prints go to stderr, so stdout is the continuation,
    the JSON lines of --prompts --out - and the evaluation table only (they began with
    "[WARNING] ... Setting accelerator to CPU" and "Processing zero checkpoint ...")."""
    import json

    gen = _run([sys.executable, "-m", "tape_train.inference.generate", str(ref_2p), "--prompt",
                "The", "--max-new-tokens", "4", "--temperature", "0"])
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("The"), gen.stdout[:500]
    assert "Processing zero checkpoint" in gen.stderr  # the control: DeepSpeed did print
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "The"}\n{"id": 2, "prompt": "A"}\n')
    many = _run([sys.executable, "-m", "tape_train.inference.generate", str(ref_2p),
                 "--prompts", str(prompts), "--out", "-", "--max-new-tokens", "3"])
    assert many.returncode == 0, many.stderr[-2000:]
    assert [json.loads(line)["id"] for line in many.stdout.splitlines()] == [1, 2]
    ev = _run([sys.executable, "-m", "tape_train.eval.cli", "--checkpoint", str(ref_2p),
               "--lengths", "32", "--max-tokens", "64", "--out", str(tmp_path / "eval"),
               "--no-progress"])
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert ev.stdout.startswith("| model |"), ev.stdout[:500]


RESUME_STEP = 2 * CKPT_EVERY


@pytest.mark.parametrize("source", ["ref_2p", "ref_sp2", "ref_tp2"])
def test_resume_on_another_layout_continues_like_the_run_at_the_new_layout(
        source, ref_1p, request, tmp_path_factory):
    """DP2 → DP1, SP2 → SP1, TP2 → TP1: the step-10 ZeRO-3 checkpoint of the 2-process run,
    resumed by one process (grad_accum 2: the same global batch of 4 sequences), is converted
    to DeepSpeed's universal form once (cached inside the tag) and continues exactly like the
    uninterrupted one-process run: losses of steps 11..16, learning rate, token counter and
    the step-16 evaluation within 1e-5."""
    from tape_train.train.checkpoint import why_incomplete
    from tape_train.train.metrics import read_metrics

    tag = f"step_{RESUME_STEP:08d}"
    run_dir = tmp_path_factory.mktemp(f"relayout_{source}") / "run"
    shutil.copytree(request.getfixturevalue(source) / "checkpoints" / tag,
                    run_dir / "checkpoints" / tag)
    result = _run(_command(1, _config(tmp_path_factory), run_dir, 2, "checkpoint.keep=4"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "resumed on another layout" in result.stderr
    universal = run_dir / "checkpoints" / tag / "universal"
    assert universal.is_dir() and why_incomplete(universal.parent) is None
    ref = {r["step"]: r for r in read_metrics(ref_1p, "train")}
    got = {r["step"]: r for r in read_metrics(run_dir, "train")}
    assert sorted(got) == list(range(RESUME_STEP + 1, MAX_STEPS + 1))
    for step, row in got.items():
        assert row["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6), step
        assert row["lr"] == pytest.approx(ref[step]["lr"], rel=1e-12), step
        assert row["tokens_seen"] == ref[step]["tokens_seen"], step
    ref_eval = [r for r in read_metrics(ref_1p, "eval") if r["step"] == MAX_STEPS][-1]
    got_eval = [r for r in read_metrics(run_dir, "eval") if r["step"] == MAX_STEPS][-1]
    for key in (k for k in ref_eval if k.startswith("eval/ppl")):
        assert got_eval[key] == pytest.approx(ref_eval[key], rel=1e-5), key
    resume = [e for e in _events(run_dir) if e["event"] == "resume"][-1]
    assert resume["relayout_from"]["dp"] * resume["relayout_from"]["sp"] * \
        resume["relayout_from"]["tp"] == 2 and resume["layout"] == {"dp": 1, "sp": 1, "tp": 1}


def test_resume_on_another_layout_with_another_global_batch_is_refused(ref_2p,
                                                                       tmp_path_factory):
    """Negative control: one process with grad_accum 1 would halve the global batch: refused
    before anything is built or converted, naming the fix; the checkpoint is untouched."""
    from tape_train.train.checkpoint import why_incomplete

    tag = f"step_{RESUME_STEP:08d}"
    run_dir = tmp_path_factory.mktemp("relayout_refused") / "run"
    shutil.copytree(ref_2p / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    result = _run(_command(1, _config(tmp_path_factory), run_dir, 1))
    assert result.returncode == 1
    assert "global batch changes from 4 to 2 sequences" in result.stderr, result.stderr[-3000:]
    assert "train.grad_accum_steps=2" in result.stderr
    assert not (run_dir / "checkpoints" / tag / "universal").exists()
    assert why_incomplete(run_dir / "checkpoints" / tag) is None
    assert not (run_dir / "metrics.jsonl").exists()


def test_export_of_a_tensor_parallel_checkpoint_matches_the_one_process_weights(
        ref_1p, ref_tp2, tmp_path):
    """zero_to_fp32 cannot merge TP shards; the universal route does: the TP2 step-10
    weights equal the one-process run's at step 10 (same global batches) to float rounding,
    and differ from its step-5 weights (the comparison has teeth)."""
    from tape_train.train.checkpoint import load_model_from_checkpoint

    def weights(run_dir, step):
        return load_model_from_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")[1]

    tp, one, early = weights(ref_tp2, RESUME_STEP), weights(ref_1p, RESUME_STEP), \
        weights(ref_1p, CKPT_EVERY)
    assert set(tp) == set(one)
    for name in one:
        assert tp[name].shape == one[name].shape, name
        assert (tp[name] - one[name]).abs().max() < 1e-5, name
    assert max((early[n] - one[n]).abs().max() for n in one) > 1e-3
