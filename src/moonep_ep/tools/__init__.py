"""What users run, grouped by role: CLI command bodies, the vLLM engine demo, tiny checkpoints, benchmarks.

Nothing below ``cli`` imports this package; ``cli`` calls into it.
"""
