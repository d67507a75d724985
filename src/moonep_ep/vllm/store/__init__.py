"""The model-wide sharded expert store as vLLM's MoE layers see it, and loading weights into it (zero copy, in-place updates)."""
