"""The test side of the case tables: one module per op family, holding the float64 references.

Each family has one case table, ``customop/samples/<family>.py``: the op variants with their
constructor arguments, the input sizes of each tier (``SIZES``: "check" for ``customop check``,
"small" for every path emulated on a CPU, "real" for the GPU tier) and the dtypes. Every tier's
tests read that table and choose only the path under test and the sizes:

====================================  ==========  ==================================================
tests                                 marker      path
====================================  ==========  ==================================================
tests/ops/test_<family>.py            (none)      ``forward_native``, ``forward_cpu``
tests/backends/triton/test_*_triton   interpret   ``forward_kernel`` -> Triton under TRITON_INTERPRET=1
tests/gpu/test_<family>_cuda.py       cuda        ``forward_kernel`` -> Triton compiled, real sizes
``customop check``, assert_conforms   (CLI)       the resolved forward against ``forward_native``
====================================  ==========  ==================================================

Why the references are here and not in the table: a float64 reference is the tests' oracle,
written from the formulas and deliberately apart from the library's math (``customop/math``).
Shipped next to the spec it would be read, edited and "fixed" together with it, and the two would
stop being independent; vendors' conformance (``assert_conforms``) compares against
``forward_native`` by design. So the library ships what to run (the table), the tests add how to
judge it (``tests/cases/<family>.py``, keyed by the table's labels or op names).
"""
