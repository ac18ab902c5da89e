"""Checkpoint I/O: Hugging Face safetensors (bf16/f32, FP8 block-scaled, INT4 packed)."""
