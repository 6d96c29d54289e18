"""AMD GPUs: the shared Triton launchers as the kernels of ``customop::`` ops on HIP devices
(which torch calls "cuda"). ROCm specifics (the fnuz fp8 dtype with max 224, wave-64 tuning) live
in modules beside this one. Written for ROCm; not run on AMD hardware here (no AMD GPU reachable).
"""

from customop.backends import triton as _triton

_triton.register_for("cuda")
