"""lm-evaluation-harness scores an export on the shipped local tasks; its bits per byte on the
held-out documents equals tape-eval's (evaluate_perplexity) on the same documents."""

from __future__ import annotations

import math
import random

import pytest
import torch

from model_utils import small_model
from tape_train.data.tokenizer import TokenizerTrainSpec, train_tokenizer
from tape_train.eval.perplexity import evaluate_perplexity
from tape_train.inference.hf_export import save_hf
from tape_train.inference.lm_eval_tasks import continuation_items, write_tasks

pytestmark = pytest.mark.slow
L = 512  # longer than every document: one window per document in both tools


def _texts(n: int = 10) -> list[str]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(2, 7)))
             for _ in range(200)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(40, 90))) for _ in range(n)]


def test_continuation_items_hold_the_true_continuation_once():
    texts = _texts()
    items = continuation_items(texts, 60, 25)
    assert len(items) == len(texts)
    for text, item in zip(texts, items):
        assert len(item["choices"]) == 4
        assert text.startswith(item["context"] + item["choices"][item["label"]])
        assert sum(text.startswith(item["context"] + c) for c in item["choices"]) == 1


@pytest.mark.parametrize("pe", ["tape", "rope"])
def test_lm_eval_bits_per_byte_equal_tape_eval(tmp_path, pe, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed "
                                                    "(pip install 'tape-train[lm-eval]')")
    pytest.importorskip("accelerate", reason="lm_eval's HF model needs accelerate")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    texts = _texts()
    tok = train_tokenizer(texts * 3, tmp_path / "tok", TokenizerTrainSpec(vocab_size=320,
                                                                         num_threads=1))
    model = small_model(pe, dtype=torch.float32, vocab_size=320, max_seq_len=L)
    export = save_hf(model.state_dict(), model.cfg, tmp_path / "export",
                     tokenizer=tmp_path / "tok.model")
    docs = [([tok.bos_id] + tok.encode(t), len(t.encode("utf-8"))) for t in texts]
    assert max(len(ids) for ids, _ in docs) < L
    # Every document fits one window: both tools score whole documents, so L is a bound here,
    # not a length being measured (its perplexity is NaN); the raw sums are what we compare.
    row = evaluate_perplexity(model, docs, lengths=[L], allow_unmeasured=True)[0]
    ours = row["nll_sum"] / (math.log(2) * row["bytes"])

    tasks = write_tasks(tmp_path / "tasks", texts, 60, 25)
    manager = TaskManager(include_path=str(tasks))
    # add_bos_token=False: lm-eval's rolling windows already start with BOS (its prefix
    # token); with the tokenizer's BOS as well, BOS itself would be scored once per document.
    lm = HFLM(pretrained=str(export), trust_remote_code=True, dtype="float32", max_length=L,
              batch_size=4, device="cpu", add_bos_token=False)
    heldout = lm_eval.simple_evaluate(model=lm, tasks=["tape_heldout"], task_manager=manager)
    assert heldout["results"]["tape_heldout"]["bits_per_byte,none"] == pytest.approx(
        ours, rel=1e-5)
    lm = HFLM(pretrained=str(export), trust_remote_code=True, dtype="float32", max_length=L,
              batch_size=4, device="cpu")  # contexts start with BOS, as in training
    mc = lm_eval.simple_evaluate(model=lm, tasks=["tape_continuation_mc"], task_manager=manager)
    assert 0.0 <= mc["results"]["tape_continuation_mc"]["acc,none"] <= 1.0
    assert mc["n-samples"]["tape_continuation_mc"]["effective"] == len(texts)
