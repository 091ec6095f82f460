"""Using trained models: export to safetensors / Hugging Face, and text generation."""
