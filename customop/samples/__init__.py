"""Random-input builders per op family, for ``assert_conforms`` and ``customop check``.

Every module in this package is imported, and registers its builders with
``customop.testing.register_samples``.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
