"""The test side of the case tables: one module per op family, holding the float64 references.

Each family has one case table, ``customop/samples/<family>.py``: the op variants with their
constructor arguments, the input sizes of each tier (``SIZES``: "check" for ``customop check``,
"small" for every path emulated on a CPU, "tpu" where Pallas tiling needs multiples of 128,
"real" for the GPU tier) and the dtypes. Every tier's
tests read that table and choose only the path under test and the sizes:

====================================  ==========  ==================================================
tests                                 marker      path
====================================  ==========  ==================================================
tests/ops/test_<family>.py            (none)      ``forward_native``, ``forward_cpu``
tests/backends/triton/test_*_triton   interpret   ``forward_kernel`` -> Triton under TRITON_INTERPRET=1
tests/gpu/test_<family>_cuda.py       cuda        ``forward_kernel`` -> Triton compiled, real sizes
tests/backends/tpu/test_kernels.py    (none)      the xla kernels (Pallas, interpret mode), "tpu" sizes
tests/backends/tpu/test_torch_xla.py  xla         ``forward_tpu`` on torch_xla's XLA CPU device
tests/backends/xpu/test_tables.py     (none/ipex) the XPU provider chain (IPEX's kernels where it has them)
``customop check``, assert_conforms   (CLI)       the resolved forward against ``forward_native``
====================================  ==========  ==================================================

Why the references are here and not in the table: a float64 reference is the tests' oracle,
written from the formulas and deliberately apart from the library's math (``customop/math``).
Shipped next to the spec it would be read, edited and "fixed" together with it, and the two would
stop being independent; vendors' conformance (``assert_conforms``) compares against
``forward_native`` by design. So the library ships what to run (the table), the tests add how to
judge it (``tests/cases/<family>.py``, keyed by the table's labels or op names).
"""
