"""Quantized experts in vLLM's engine over the sharded store, and where vLLM's quantized MoE methods are patched."""
