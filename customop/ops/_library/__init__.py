"""The ``torch.ops.customop.*`` kernel entry points: schemas, reference implementations and fakes.

Torch-only. Each module defines one family's ops with ``torch.library.custom_op`` (the body is
the reference, so the op runs on any device) and ``register_fake`` (shapes only). Backends add
device kernels with ``torch.library.register_kernel``.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
