"""Model configuration: one dataclass, validated at construction.

Every field is documented; invalid combinations raise ``ValueError`` naming the field, so a
bad YAML key fails before any weight is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from tape_train.hints import check_field_types, choice_error, read_named_yaml, unknown_keys
from tape_train.model.pe import ENCODINGS, EncodingSpec
from tape_train.resources import resource_dir

POSITIONAL_ENCODINGS = tuple(ENCODINGS)
ATTENTION_BACKENDS = ("auto", "eager", "sdpa", "blocked", "flash", "triton")
# Backends that run only on CUDA (flash also needs flash-attn): a choice for one machine.
CUDA_ONLY_BACKENDS = ("flash", "triton")
MODEL_CONFIG_DIR = resource_dir("configs/model")
# What a model config without a base size must give itself: the fields' defaults are a 125M
# shape, so one left out would silently come from there (``model: {pe: rope}``).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size")


@dataclass
class ModelConfig:
    """Shape and positional encoding of a Llama-style decoder.

    Attributes:
        vocab_size: rows of the embedding / LM head.
        hidden_size: C, the residual width.
        num_layers: decoder blocks.
        num_heads: M, query heads; ``hidden_size`` must be divisible by it.
        num_kv_heads: key/value heads (GQA); ``None`` means ``num_heads``. TAPE needs one
            positional state per query head, so it requires ``num_kv_heads == num_heads``.
        intermediate_size: F, SwiGLU width.
        pe: positional encoding, one of ``POSITIONAL_ENCODINGS``.
        rope_theta: θ of the rotary frequencies ω_β = θ^(−2β/D) (TAPE, RoPE, RandPE, xPos).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the embedding matrix with the LM head.
        init_std: standard deviation of every Linear/Embedding weight at init.
        max_seq_len: longest sequence the model is expected to see (sizes cached tables only;
            longer inputs still work for every encoding).
        attn_backend: ``auto`` picks the fastest correct backend for device and encoding.
        tape_position_size: P, width of TAPE's positional MLP gate.
        tape_post_attn: ``headmix`` (W_pa mixes heads, default) or ``rowsum`` (parity with the
            released code: a per-head scalar gate s_m = Σ_m' W_pa[m, m']).
        tape_train_offset: parity with the released code: shift layer-0 positions by a random
            k ∈ [0, 2·N] during training (a mathematical no-op, see spec T2).
        randpe_max_len: L_max of RandPE, the range training positions are sampled from.
        xpos_scale_base: xPos decay scale (ζ^{n/scale_base}).
        fire_hidden: width of FIRE's MLP 1→hidden→M.
        fire_init_c: initial c of FIRE's ψ(x) = log(c·x + 1).
        fire_init_L: initial threshold L of FIRE's normaliser ψ(max(i, L)).
        t5_num_buckets: T5 relative-position buckets.
        t5_max_distance: distance where T5's log-spaced buckets saturate.
    """

    vocab_size: int = 32000
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int | None = None
    intermediate_size: int = 3072
    pe: str = "tape"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    max_seq_len: int = 1024
    attn_backend: str = "auto"
    tape_position_size: int = 48
    tape_post_attn: str = "headmix"
    tape_train_offset: bool = False
    randpe_max_len: int = 16384
    xpos_scale_base: float = 512.0
    fire_hidden: int = 32
    fire_init_c: float = 0.1
    fire_init_L: float = 512.0
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        # Types first: a quoted `tie_embeddings: "no"` is truthy, `norm_eps: "1e-6"` a string.
        check_field_types(self, "model")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "max_seq_len", "tape_position_size", "randpe_max_len",
                    "fire_hidden", "t5_max_distance"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        # T5's buckets: half exact distances, half log-spaced from there to t5_max_distance.
        if not isinstance(self.t5_num_buckets, int) or self.t5_num_buckets < 2:
            raise ValueError(f"model.t5_num_buckets must be an integer >= 2, "
                             f"got {self.t5_num_buckets!r}")
        if self.t5_max_distance <= self.t5_num_buckets // 2:
            raise ValueError(f"model.t5_max_distance ({self.t5_max_distance}) must exceed "
                             f"model.t5_num_buckets // 2 ({self.t5_num_buckets // 2}), the exact "
                             f"distances its log-spaced buckets start after")
        if self.pe not in ENCODINGS:
            raise ValueError(choice_error("model.pe", self.pe, tuple(ENCODINGS)))
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(choice_error("model.attn_backend", self.attn_backend,
                                           ATTENTION_BACKENDS))
        if self.tape_post_attn not in ("headmix", "rowsum"):
            raise ValueError(choice_error("model.tape_post_attn", self.tape_post_attn,
                                           ("headmix", "rowsum")))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                             f"model.num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be divisible by "
                             f"model.num_kv_heads ({self.num_kv_heads})")
        spec = self.encoding
        if not spec.gqa and self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} (GQA) is not supported with "
                f"pe={self.pe}: it keeps one positional state per query head, so num_kv_heads "
                f"must equal num_heads ({self.num_heads})")
        if spec.rotary and self.head_dim % 2:
            raise ValueError(f"model.hidden_size/num_heads = head dim {self.head_dim} is odd; "
                             f"pe={self.pe} rotates channel pairs and needs an even head dim")
        for key in ("rope_theta", "norm_eps", "init_std", "xpos_scale_base", "fire_init_c",
                    "fire_init_L"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.{key} must be > 0, got {getattr(self, key)!r}")

    @property
    def encoding(self) -> EncodingSpec:
        """What ``pe`` is: its capabilities, declared once in ``tape_train.model.pe``."""
        return ENCODINGS[self.pe]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def for_any_device(self) -> "ModelConfig":
        """This config for weights leaving the run that trained them (evaluation, export,
        generation): a CUDA-only ``attn_backend`` becomes ``auto``, which picks it again
        wherever it can run. Every other field, and a device-neutral backend, is kept."""
        if self.attn_backend not in CUDA_ONLY_BACKENDS:
            return self
        return dataclasses.replace(self, attn_backend="auto")

    @classmethod
    def from_dict(cls, data: dict, source: str = "model config") -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown model key(s) {unknown_keys(unknown, known)}")
        return cls(**data)


def load_model_config(name_or_path: str, **overrides) -> ModelConfig:
    """A named size from ``configs/model/<name>.yaml`` or a YAML file path, plus overrides.
    The file gives the shape (``SHAPE_FIELDS``); an empty or partial one is refused."""
    path, data = read_named_yaml(name_or_path, MODEL_CONFIG_DIR, "model", ValueError,
                                 missing=FileNotFoundError)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    missing = [key for key in SHAPE_FIELDS if key not in data]
    if missing and not set(data) - known:  # an unknown key is the clearer message
        raise ValueError(f"{path}: a model config gives the model's shape; missing "
                         f"{', '.join(missing)}")
    data.setdefault("name", path.stem)
    data.update(overrides)
    return ModelConfig.from_dict(data, source=str(path))

