"""Moved to :mod:`tape_train.data.synthetic` (eval uses it too; data sits below train and
eval). This name stays for existing callers."""

from tape_train.data.synthetic import (SyntheticLoader, synthetic_eval_documents,  # noqa: F401
                                       synthetic_sample)
