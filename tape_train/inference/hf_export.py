"""``tape-export --hf``: a directory every Hugging Face tool loads, for every encoding.

RoPE exports to plain ``LlamaForCausalLM`` (Hugging Face names and config). Every other
encoding exports our own weights (tape-train's parameter names) with ``configuration_tape.py``
and ``modeling_tape.py`` copied in and ``auto_map`` in config.json, so
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads it without
tape-train installed. Both kinds carry the tokenizer files of
:mod:`tape_train.inference.hf_tokenizer` and bos/eos/pad ids in config.json.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from tape_train.model.config import ModelConfig
from tape_train.model.pretrained import (CONFIG, PROVENANCE, TOKENIZER, WEIGHTS, cast_state,
                                         export_integrity, save_weights,
                                         write_dir_atomically)

REMOTE_CODE_DIR = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_tape.py", "modeling_tape.py", "export_check.py")
# Copied into every --hf export, RoPE's plain Llama too: `python export_check.py DIR` checks it.
CHECK_FILE = "export_check.py"
CHECK_SOURCE = Path(__file__).resolve().parents[1] / CHECK_FILE  # tape_train/export_check.py


def hf_architecture(cfg: ModelConfig) -> str:
    """``llama`` when transformers has the encoding's architecture built in (its
    ``EncodingSpec.hf_architecture``), else ``tape`` (the remote code shipped in the export)."""
    return "llama" if cfg.encoding.hf_architecture == "LlamaForCausalLM" else "tape"


def _tape_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["TapeForCausalLM"], "model_type": "tape_lm",
        "auto_map": {"AutoConfig": "configuration_tape.TapeConfig",
                     "AutoModelForCausalLM": "modeling_tape.TapeForCausalLM"},
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "pe": cfg.pe, "rotary_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "tape_position_size": cfg.tape_position_size, "tape_post_attn": cfg.tape_post_attn,
        "xpos_scale_base": cfg.xpos_scale_base, "fire_hidden": cfg.fire_hidden,
        "t5_num_buckets": cfg.t5_num_buckets, "t5_max_distance": cfg.t5_max_distance,
        # Tied models are stored with both matrices: the remote code needs no tying logic,
        # which differs between transformers 4.x and 5.x.
        "tie_word_embeddings": False,
    }


def write_remote_code(out_dir: Path) -> None:
    """Copy the remote code into ``out_dir``; configuration_tape.py ends with the sha256 of
    modeling_tape.py and export_check.py. transformers keys the config class it loads by that
    file's bytes and directory name alone and maps a known config class to the model class
    loaded first, so two exports in directories of the same name (``*/export``) with
    different modelling code (an older export) would otherwise both run whichever was loaded
    first in a process."""
    suffix = ""
    for name, source in (("modeling_tape.py", REMOTE_CODE_DIR / "modeling_tape.py"),
                         (CHECK_FILE, CHECK_SOURCE)):
        code = source.read_bytes()
        (out_dir / name).write_bytes(code)
        suffix += f"# {name} sha256 {hashlib.sha256(code).hexdigest()}\n"
    (out_dir / "configuration_tape.py").write_text(
        (REMOTE_CODE_DIR / "configuration_tape.py").read_text() + "\n" + suffix)


def write_tokenizer_files(out_dir: Path, tokenizer: str | Path | None, cfg: ModelConfig
                          ) -> dict[str, int] | None:
    """The Hugging Face tokenizer and generation files of the sentencepiece model (the
    ``.model`` itself is copied by the caller); returns the special ids, or None without a
    tokenizer."""
    if tokenizer is None:
        return None
    from tape_train.data.tokenizer import load_tokenizer
    from tape_train.inference.hf_tokenizer import write_generation_config, write_hf_tokenizer

    ids = write_hf_tokenizer(tokenizer, out_dir, model_max_length=cfg.max_seq_len)
    write_generation_config(out_dir, ids, load_tokenizer(tokenizer).vocab_size, cfg.vocab_size)
    return ids


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
            dtype: torch.dtype = torch.float32, tokenizer: str | Path | None = None,
            provenance: dict | None = None) -> Path:
    """Write a Hugging Face directory for ``state`` (our names, consolidated)."""
    arch = hf_architecture(cfg)
    if arch == "llama":
        from tape_train.model.hf import llama_config_dict, to_hf_llama_state_dict

        weights = to_hf_llama_state_dict(state)
        if cfg.tie_embeddings:
            weights.pop("lm_head.weight", None)
        config = llama_config_dict(cfg)
    else:
        weights = dict(state)
        if cfg.tie_embeddings and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["embed.weight"]
        config = _tape_config(cfg)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if tokenizer is not None:
        from tape_train.data.tokenizer import load_model_tokenizer
        from tape_train.inference.hf_tokenizer import unsupported

        load_model_tokenizer(tokenizer, cfg.vocab_size)
        problem = unsupported(tokenizer)
        if problem:  # before any weight is written
            raise ValueError(f"{problem}; a Hugging Face export needs them (the plain "
                             f"export, without --hf, bundles the tokenizer.model alone)")

    def write(tmp: Path) -> None:
        save_weights(cast_state(weights, dtype), tmp / WEIGHTS)
        ids = write_tokenizer_files(tmp, tokenizer, cfg)
        if ids is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
            config.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                          pad_token_id=ids["pad"])
        if arch == "tape":
            write_remote_code(tmp)
        else:
            shutil.copyfile(CHECK_SOURCE, tmp / CHECK_FILE)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / PROVENANCE).write_text(json.dumps({"format": f"hf-{arch}", **(provenance or {}),
                                                  **export_integrity(tmp)},
                                                 indent=2, default=str) + "\n")

    return write_dir_atomically(Path(out_dir), write)
