"""Configuration of decoder-only models trained with tape-train (TAPE and the baselines).

Standalone: imports transformers only. Written next to ``modeling_tape.py`` by
``tape-export --hf``; ``auto_map`` in config.json points at both.
"""

from transformers import PretrainedConfig

ENCODINGS = ("tape", "nope", "alibi", "randpe", "fire", "xpos", "t5", "rope")


class TapeConfig(PretrainedConfig):
    """Llama shape plus the positional encoding ``pe`` and its settings.

    pe: tape | rope | randpe | nope | alibi | fire | xpos | t5 (randpe decodes as rope).
    rotary_theta: θ of the rotary frequencies ω_β = θ^(−2β/D).
    tape_position_size / tape_post_attn: TAPE's gate width P and W_pa form (headmix|rowsum).
    xpos_scale_base, fire_hidden, t5_num_buckets, t5_max_distance: as in training.
    """

    model_type = "tape_lm"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, vocab_size=32000, hidden_size=768, intermediate_size=3072,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=None,
                 pe="tape", rotary_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=1024, initializer_range=0.02,
                 tape_position_size=48, tape_post_attn="headmix", xpos_scale_base=512.0,
                 fire_hidden=32, t5_num_buckets=32, t5_max_distance=128,
                 use_cache=True, tie_word_embeddings=False, **kwargs):
        if pe not in ENCODINGS:
            raise ValueError(f"pe={pe!r} is not one of {', '.join(ENCODINGS)}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.pe = pe
        self.rotary_theta = rotary_theta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.tape_position_size = tape_position_size
        self.tape_post_attn = tape_post_attn
        self.xpos_scale_base = xpos_scale_base
        self.fire_hidden = fire_hidden
        self.t5_num_buckets = t5_num_buckets
        self.t5_max_distance = t5_max_distance
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
