"""CPU benchmarks, one module per op family (run with ``python -m benchmarks.cpu.<family>``)."""
