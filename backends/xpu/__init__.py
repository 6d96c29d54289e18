"""Intel GPUs: IPEX fused kernels when present, else the Triton kernels on XPU tensors."""
