"""Checkpoint I/O: safetensors, public tensor layouts, Hugging Face names, drafter formats, GGUF conversion."""
