"""A Hugging Face fast tokenizer that gives exactly the ids training gave.

Training tokenises with sentencepiece (``tape_train.data.tokenizer``): no special-token
parsing (a literal ``<s>`` in text is three ordinary pieces), ``add_dummy_prefix`` as recorded
in the model ("Hello world" → ``▁Hello ▁world``), only U+0020 escaped to "▁", byte fallback,
and every document wrapped as ``[BOS] + tokens + [EOS]`` by the packer. This module rebuilds
that with the ``tokenizers`` library from the ``.model`` proto itself (no conversion at load
time, no sentencepiece/protobuf needed by users) and writes the files ``AutoTokenizer`` reads:

    tokenizer.json            the fast tokenizer (BOS prepended by its post-processor)
    tokenizer_config.json     special tokens, add_bos_token=true, add_eos_token=false,
                              split_special_tokens=true, clean_up_tokenization_spaces=false
    special_tokens_map.json
    generation_config.json    bos/eos/pad ids: ``generate`` stops at EOS, pads with PAD
                              (and suppresses ids past the tokenizer's, if the model has any)

Prompts get BOS and no EOS (training's documents start with BOS; a prompt is an unfinished
document). PAD is the model's ``<pad>`` (our tokenizers: id 0), else UNK as in training.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tape_train.data.tokenizer import load_tokenizer

log = logging.getLogger("tape_train.export")

# sentencepiece ModelProto.SentencePiece.Type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# Unigram scores of pieces sentencepiece never matches in text (control, byte, unused):
# low enough that the Viterbi search never prefers them.
_NEVER_MATCHED = -1e9


def _proto(path: str):
    """The parsed sentencepiece ModelProto (sentencepiece ships its own protobuf module)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def _bpe_merges(pieces) -> list[tuple[str, str]]:
    """Merges in sentencepiece's order: a pair merges when its concatenation is a normal piece,
    the highest-scoring (lowest-id) result first; ties among splits of one piece by id."""
    vocab = {p.piece: i for i, p in enumerate(pieces) if p.type == _NORMAL}
    merges = []
    for piece, piece_id in sorted(vocab.items(), key=lambda kv: kv[1]):
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend(splits)
    return merges


def _uncovered_characters(pieces, byte_fallback: bool) -> str:
    """A regex (Oniguruma) of what no piece sentencepiece matches in text (normal and
    user-defined pieces) contains: each such character alone with byte fallback, else each
    run of them (sentencepiece gives a run one ``<unk>``).

    Sentencepiece starts and ends a piece around such a character (its unknown or byte
    pieces), so a pre-tokenizer that isolates it changes no segmentation, and keeps the
    ``tokenizers`` Unigram model, which matches every vocabulary entry, from matching a
    control or byte piece's spelling there: ``<s>`` as BOS, ``<0x41>`` as ``A``, where
    ``<`` is not in the vocabulary (its unknown-character score is below theirs)."""
    covered = sorted({ord(ch) for p in pieces if p.type in (_NORMAL, _USER_DEFINED)
                      for ch in p.piece})
    ranges: list[list[int]] = []
    for code in covered:
        if ranges and code == ranges[-1][1] + 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    spans = "".join(f"\\x{{{a:x}}}" + (f"-\\x{{{b:x}}}" if b > a else "") for a, b in ranges)
    return f"[^{spans}]" + ("" if byte_fallback else "+")


def unsupported(model_path: str | Path) -> str | None:
    """Why the sentencepiece model at ``model_path`` has no exact Hugging Face tokenizer here
    (a normalization rule other than identity, remove_extra_whitespaces, whitespace not
    escaped or as a suffix, a model type other than BPE or unigram), or None. Tokenizers
    trained by ``tape-tokenizer`` always have one."""
    proto = _proto(str(model_path))
    norm = proto.normalizer_spec
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        return (f"tokenizer {model_path}: normalization rule {norm.name!r} is not supported "
                f"by the Hugging Face tokenizer files (identity only)")
    settings = (("remove_extra_whitespaces=true", norm.remove_extra_whitespaces),
                ("escape_whitespaces=false", not norm.escape_whitespaces),
                ("treat_whitespace_as_suffix=true",
                 proto.trainer_spec.treat_whitespace_as_suffix))
    for setting, present in settings:
        if present:
            return (f"tokenizer {model_path}: {setting} is not supported by the Hugging Face "
                    f"tokenizer files")
    if proto.trainer_spec.model_type not in (1, 2):
        return (f"tokenizer {model_path}: model type {proto.trainer_spec.model_type} is not "
                f"bpe or unigram (the Hugging Face tokenizer files support those only)")
    return None


def build_fast_tokenizer(model_path: str | Path):
    """A ``tokenizers.Tokenizer`` equivalent to the sentencepiece model at ``model_path``
    (ValueError, with :func:`unsupported`'s reason, when there is none)."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, normalizers,
                            pre_tokenizers, processors)
    from tokenizers.models import BPE, Unigram

    tok = load_tokenizer(model_path)
    problem = unsupported(model_path)
    if problem:
        raise ValueError(problem)
    proto = _proto(str(model_path))
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = list(proto.pieces)
    byte_fallback = bool(trainer.byte_fallback)
    if trainer.model_type == 2:  # BPE
        model = BPE(vocab={p.piece: i for i, p in enumerate(pieces)}, merges=_bpe_merges(pieces),
                    unk_token=pieces[tok.unk_id].piece, byte_fallback=byte_fallback,
                    fuse_unk=True)
    elif trainer.model_type == 1:  # unigram
        scores = [(p.piece, p.score if p.type in (_NORMAL, _USER_DEFINED) else _NEVER_MATCHED)
                  for p in pieces]
        model = Unigram(scores, unk_id=tok.unk_id, byte_fallback=byte_fallback)
    else:  # unreachable: unsupported() names other model types
        raise ValueError(f"tokenizer {model_path}: model type {trainer.model_type}")
    fast = Tokenizer(model)
    steps = [normalizers.Replace(" ", "▁")]
    if norm.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    fast.normalizer = normalizers.Sequence(steps)
    # BPE merges only into normal pieces; a Unigram model needs the characters it has no
    # piece for set apart (_uncovered_characters).
    fast.pre_tokenizer = None if trainer.model_type == 2 else pre_tokenizers.Split(
        Regex(_uncovered_characters(pieces, byte_fallback)), behavior="isolated")
    fast.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []))
    specials = [pieces[i].piece for i, p in enumerate(pieces) if p.type in (_CONTROL, _UNKNOWN)]
    fast.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    # Training never parses special-token strings in text: neither does this tokenizer.
    fast.encode_special_tokens = True
    bos = pieces[tok.bos_id].piece
    fast.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.bos_id)])
    return fast


def special_token_ids(model_path: str | Path) -> dict[str, int]:
    """``bos``/``eos``/``pad``/``unk`` ids as training used them (PAD falls back to UNK)."""
    tok = load_tokenizer(model_path)
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "unk": tok.unk_id}


def write_hf_tokenizer(model_path: str | Path, out_dir: str | Path,
                       model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json for the sentencepiece model into ``out_dir``; returns the special
    ids (for config.json)."""
    out_dir = Path(out_dir)
    tok = load_tokenizer(model_path)
    ids = special_token_ids(model_path)
    fast = build_fast_tokenizer(model_path)
    fast.save(str(out_dir / "tokenizer.json"))
    if _proto(str(model_path)).trainer_spec.model_type == 1:
        log.warning("tokenizer %s is a unigram model: the exported tokenizer.json gives other "
                    "ids than training for some text (a few tokens in long documents: "
                    "sentencepiece scores in float32, tokenizers in float64); docs/evaluation.md, "
                    "Known limits. BPE tokenizers give the same ids", model_path)
    names = {key: tok.id_to_piece(i) for key, i in ids.items()}
    special_map = {f"{key}_token": name for key, name in names.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        # no token_type_ids (transformers 4.x would return them and generate() refuses them)
        "model_input_names": ["input_ids", "attention_mask"],
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return ids


def write_generation_config(out_dir: str | Path, ids: dict[str, int], tokenizer_size: int,
                            vocab_size: int) -> None:
    """generation_config.json: generation stops at EOS and pads with PAD; a model whose
    vocabulary is larger than the tokenizer's never generates the ids no piece decodes
    (``suppress_tokens``, as tape-generate samples only the tokenizer's ids)."""
    config = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
              "pad_token_id": ids["pad"], "do_sample": False}
    if vocab_size > tokenizer_size:
        config["suppress_tokens"] = list(range(tokenizer_size, vocab_size))
    _write_json(Path(out_dir) / "generation_config.json", config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
