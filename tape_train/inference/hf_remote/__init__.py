"""Hugging Face remote code copied into every non-Llama ``tape-export --hf`` directory.

``configuration_tape.py`` and ``modeling_tape.py`` are standalone: they import torch and
transformers only (never tape_train), so an export loads with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` anywhere.
"""
