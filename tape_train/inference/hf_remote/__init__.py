"""Hugging Face remote code copied into every non-Llama ``tape-export --hf`` directory.

``configuration_tape.py`` and ``modeling_tape.py`` are standalone: they import torch and
transformers only (never tape_train), so an export loads with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` anywhere. The third
file an export carries, ``export_check.py`` (stdlib only), is ``tape_train/export_check.py``,
shared with tape-train's own loaders: it is made this package's ``export_check`` here, so that
``modeling_tape.py``'s ``from .export_check import ...`` finds it in the source tree too.
"""

import sys

from tape_train import export_check

sys.modules[f"{__name__}.export_check"] = export_check
