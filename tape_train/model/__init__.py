"""Pure-PyTorch model code: decoder, positional encodings, attention dispatch, generation."""

from tape_train.model.config import POSITIONAL_ENCODINGS, ModelConfig, load_model_config
from tape_train.model.pretrained import from_pretrained, save_pretrained
from tape_train.model.transformer import IGNORE_INDEX, KVCache, ModelOutput, TransformerLM

__all__ = ["IGNORE_INDEX", "POSITIONAL_ENCODINGS", "KVCache", "ModelConfig", "ModelOutput",
           "TransformerLM", "from_pretrained", "load_model_config", "save_pretrained"]
