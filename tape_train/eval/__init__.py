"""Perplexity at growing context lengths (spec §7): protocols, reports and plots, `tape-eval`.

Names are imported lazily so that ``tape-eval --help`` and the config code do not load torch.
"""

from tape_train.eval.config import PROTOCOLS, EvalConfig

_PERPLEXITY_NAMES = ("evaluate_perplexity", "evaluate_schedule", "materialize_documents",
                     "scalar_metrics", "window_spans")

__all__ = ["PROTOCOLS", "EvalConfig", *_PERPLEXITY_NAMES]


def __getattr__(name: str):
    if name in _PERPLEXITY_NAMES:
        from tape_train.eval import perplexity

        return getattr(perplexity, name)
    raise AttributeError(f"module 'tape_train.eval' has no attribute {name!r}")
