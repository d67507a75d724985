"""Expert FFN compute over MoonEP's grouped rows: the activations, the grouped GEMM and its dense oracle, the quantized experts and the Triton kernels' block metadata."""
