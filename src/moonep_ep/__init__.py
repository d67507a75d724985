"""moonep_ep: sharded symmetric memory for MoonEP expert parallelism.

Layers, each depending only on the ones above it in this list:

* ``moonep_ep.memory``  – drivers (CUDA VMM, host memfd), handle exchange,
  symmetric allocations;
* ``moonep_ep.layout``  – sharded expert-weight views over symmetric memory;
* ``moonep_ep.ops``     – prefetch, grouped expert compute, reference buffer;
* ``moonep_ep.vllm``    – the vLLM plugin;
* ``moonep_ep.cli``     – the ``moonep-ep`` command.
"""

__version__ = "0.1.0"
