"""Tiny random checkpoints written to disk: Qwen3-MoE, DeepSeek-V3, and quantized DeepSeek-V3 formats."""
