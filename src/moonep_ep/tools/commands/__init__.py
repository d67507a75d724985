"""The bodies of ``moonep-ep`` commands (demo, selftest, footprint --measure) and vLLM's ``vllm`` command line with the plugin."""
