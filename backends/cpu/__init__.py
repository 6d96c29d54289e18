"""CPUs: Inductor-compiled native code above a measured size per op, the spec's own kernels with
fewer temporaries below it (``eager.py``), oneDNN through PyTorch where it wins (docs/cpu.md).

Torch only; imports no op class (the ops import this package, never the reverse).
"""

from customop.backends.cpu.compile_cache import EMULATE_CASTS, compiled
from customop.backends.cpu.tiering import CpuTiers, for_this_cpu, run_tiered

__all__ = ["EMULATE_CASTS", "CpuTiers", "compiled", "for_this_cpu", "run_tiered"]
