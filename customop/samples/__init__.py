"""One case table per op family (``<family>.py``): the op variants with their constructor
arguments, the input sizes of each test tier and the dtypes. The project's tests read them in
every tier (their float64 references are in ``tests/cases/``); ``customop check`` and
``customop.testing.assert_conforms`` run their ``"check"`` sizes.

Every module in this package is imported, and registers its sample builders with
``customop.testing.register_samples``.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
