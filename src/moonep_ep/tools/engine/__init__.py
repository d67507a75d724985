"""The vLLM engine runs behind ``vllm-demo`` and ``serve``: harness, demo, reload probe, summary, HF oracle."""
