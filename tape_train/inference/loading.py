"""Load a model (and its tokenizer) from an export directory or a training checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from tape_train.model import TransformerLM
from tape_train.model.pretrained import CONFIG, TOKENIZER, WEIGHTS, from_pretrained


def is_export_dir(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / CONFIG).is_file()


def load_for_inference(path: str | Path, dtype: torch.dtype | None = None
                       ) -> tuple[TransformerLM, str | None, dict]:
    """(model in eval mode, tokenizer path or None, provenance) from either kind of path.

    A checkpoint path may be a run dir (its latest complete checkpoint) or a tag dir; partial
    checkpoints are refused by the checkpoint layer.
    """
    path = Path(path)
    if is_export_dir(path):
        tok = path / TOKENIZER
        return from_pretrained(path, dtype=dtype), str(tok) if tok.is_file() else None, {
            "source": str(path)}
    from tape_train.train.checkpoint import load_model_from_checkpoint

    cfg, state, meta = load_model_from_checkpoint(path)
    model = TransformerLM(cfg)
    model.load_state_dict(state)
    model = model.to(dtype or torch.float32).eval()
    tokenizer = (meta.get("config") or {}).get("data", {}).get("tokenizer")
    return model, tokenizer, meta
