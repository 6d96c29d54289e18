"""customop: LLM layer operators with a readable PyTorch spec and fast kernels per platform.

``current_platform`` is resolved lazily on first access (module ``__getattr__``), so importing
customop never probes devices or imports an optional backend.
"""

import warnings

# numpy is optional here (not a dependency of the core install), and torch warns at import time
# when it is absent; nothing in customop needs numpy, so that one warning is noise.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from customop.config import CompilationMode, Config, get_config, set_config, use_config
from customop.custom_op import CustomOp
from customop.platforms import Platform, PlatformEnum
from customop.plugins import load_general_plugins
from customop.report import dispatch_report, list_ops
from customop import ops  # noqa: F401  (registers the in-tree ops)
from customop.warmup import warmup  # the function: compiles the CPU path's graphs at start-up

__version__ = "0.1.0"

__all__ = [
    "CompilationMode",
    "Config",
    "CustomOp",
    "Platform",
    "PlatformEnum",
    "current_platform",
    "dispatch_report",
    "get_config",
    "list_ops",
    "load_general_plugins",
    "set_config",
    "use_config",
    "warmup",
]


def __getattr__(name: str):
    if name == "current_platform":
        from customop.platforms import current_platform

        return current_platform()
    raise AttributeError(f"module 'customop' has no attribute {name!r}")
