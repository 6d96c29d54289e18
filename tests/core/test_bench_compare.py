"""benchmarks/compare.py flags a slower row and only that."""

from customop.benchmarks.compare import compare


def test_compare_flags_rows_past_the_tolerance():
    old = {("rms_norm", "16x4096"): 2.0, ("rms_norm", "4096x4096"): 10.0, ("relu2", "1x14336"): 1.0}
    new = {("rms_norm", "16x4096"): 2.05, ("rms_norm", "4096x4096"): 11.0, ("silu", "1x2"): 1.0}
    lines, slower, compared = compare(old, new, tolerance=0.03)
    assert (slower, compared) == (1, 2)
    assert any("4096x4096" in line and "**slower**" in line for line in lines)
    assert not any("16x4096" in line and "slower" in line for line in lines)
    assert sum("only one run" in line for line in lines) == 2
