"""TPUs: JAX Pallas kernels called from torch through torch_xla."""
