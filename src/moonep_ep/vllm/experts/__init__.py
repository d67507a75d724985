"""The experts side of vLLM's modular kernel under moonep: own experts first and slot experts after the fill (the slot-fill hand-off), the activation, the GPU quantized experts."""
