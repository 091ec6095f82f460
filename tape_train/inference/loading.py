"""Load a model (and its tokenizer) from an export directory or a training checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from tape_train.model import TransformerLM


def load_for_inference(path: str | Path, dtype: torch.dtype | None = None
                       ) -> tuple[TransformerLM, str | None, dict]:
    """(model in eval mode, tokenizer path or None, provenance) from either kind of path.

    A checkpoint path may be a run dir (its latest complete checkpoint) or a tag dir; partial
    checkpoints are refused. The one loading API is ``tape_train.loading.load_model``.
    """
    from tape_train.loading import load_model

    return load_model(path, dtype)
