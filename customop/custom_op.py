"""CustomOp: one LLM layer op with a readable native spec and a forward per platform.

The path of one call (docs/design.md, "The path of one call"):

1. ``RMSNorm(4096)``: ``__new__`` builds the out-of-tree replacement instead, if one is registered.
2. ``__init__`` resolves the forward method once: disabled ops run ``forward_native`` (optionally
   ``torch.compile``d), enabled ones the method the current platform names
   (``Platform.forward_method``).
3. ``forward`` calls that method.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules import module as _module

from customop import plugins
from customop.backend_loader import load_backend
from customop.config import get_config
from customop.platforms import current_platform

logger = logging.getLogger("customop")

#: When a platform method is not overridden it falls back along this chain (the rest go native).
FALLBACK_CHAIN: dict[str, str] = {"forward_hip": "forward_cuda"}
PLATFORM_METHODS = ("forward_cuda", "forward_hip", "forward_xpu", "forward_tpu", "forward_cpu", "forward_oot")

_warned: set[str] = set()

#: Serialises every registry write: check-then-store must be atomic, or two threads registering
#: under one key could both "succeed" and one registration would be lost. Readers iterate over a
#: copy (``dict.copy`` is atomic), so a concurrent registration never breaks an iteration.
_registry_lock = threading.RLock()


def _check_op_name(where: str, name: object) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"CustomOp.{where}: op name must be a Python identifier such as 'rms_norm', got {name!r}")


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


class CustomOp(nn.Module):
    """Base class of every op. Subclasses implement ``forward_native`` and any platform methods.

    Class attributes:
        op_registry: registered op name -> in-tree class.
        op_registry_oot: registered op name -> out-of-tree replacement class.
        name: the registered op name (what ``+name``/``-name`` in ``custom_ops`` refer to).
    """

    op_registry: ClassVar[dict[str, type[CustomOp]]] = {}
    op_registry_oot: ClassVar[dict[str, type[CustomOp]]] = {}
    name: ClassVar[str]

    # ---- construction -------------------------------------------------------------------------

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        plugins.load_general_plugins()  # OOT registrations must land before the first op is built
        replacement = cls._oot_replacement()
        if replacement is None:
            return super().__new__(cls)
        logger.debug("customop: %s replaced by out-of-tree %s", cls.__name__, replacement.__name__)
        op = super().__new__(replacement)
        if not isinstance(op, cls):
            # Python runs __init__ automatically only for instances of ``cls``.
            op.__init__(*args, **kwargs)
        return op

    def __init__(self, *, enforce_enable: bool = False, compile_native: bool = False) -> None:
        super().__init__()
        self._enforce_enable = enforce_enable
        self._compile_native = compile_native
        self._forward_method = self.dispatch_forward()

    @classmethod
    def _oot_replacement(cls) -> type[CustomOp] | None:
        # Only the exact registered class is swapped, never its unregistered subclasses
        # (a scaling-variant RotaryEmbedding is not replaced by a "rotary_embedding" entry).
        name = cls.__dict__.get("name")
        if name is None or CustomOp.op_registry.get(name) is not cls:
            return None
        replacement = CustomOp.op_registry_oot.get(name)
        return None if replacement is cls else replacement

    # ---- enable and dispatch ------------------------------------------------------------------

    @classmethod
    def enabled(cls) -> bool:
        """Whether the current config enables this op (``enforce_enable`` is per instance)."""
        name = getattr(cls, "name", None)
        if name is None:
            _warn_once(f"unregistered:{cls.__qualname__}", "customop: %s is not registered; using the base mode", cls.__qualname__)
            return cls.default_on()
        return get_config().is_enabled(name)

    @classmethod
    def default_on(cls) -> bool:
        """The base mode of the current config: True for ``all``, False for ``none``."""
        return get_config().default_on

    def dispatch_forward(self, compile_native: bool | None = None) -> Callable[..., Any]:
        """Resolves (again) which method ``forward`` runs, stores it and returns it."""
        if compile_native is not None:
            self._compile_native = compile_native
        config = get_config()
        name = getattr(type(self), "name", type(self).__qualname__)
        enabled = self._enforce_enable or type(self).enabled()
        config.record(name, enabled)
        method_name = "forward_native"
        if not enabled:
            method = self.forward_native
            if self._compile_native and config.backend != "eager":
                method = torch.compile(method, dynamic=True)
        else:
            platform = current_platform()
            method_name = platform.forward_method
            method = getattr(self, method_name)
            explicit = self._enforce_enable or config.is_explicitly_enabled(name)
            reason = platform.backend_unavailable()
            if platform.backend is not None and (reason is None or explicit):
                # Load (and register the device kernels of) the backend now, outside any trace;
                # an explicit request whose backend cannot import fails here, loudly.
                try:
                    load_backend(platform.backend)
                except ImportError as err:
                    if explicit:
                        raise
                    reason = str(err)
            if reason and not explicit:
                # An automatic choice may degrade; an explicit one fails loudly (here or at call).
                _warn_once(f"fallback:{name}", "customop: %s runs forward_native: %s", name, reason)
                method, method_name = self.forward_native, "forward_native"
        self._forward_method = method
        #: the name of the method ``forward`` runs (methods may be aliases of one another)
        self.forward_method_name = method_name
        return method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ costs ~1.5 us per call on CI's CPU, mostly hook bookkeeping; ops are
        # called per layer per step, so skip it when no hook of any kind is registered
        # (BENCHMARKS.md, dispatch overhead). With hooks, the full path runs and they fire.
        if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
                or self._backward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks or torch._C._get_tracing_state()):
            return super().__call__(*args, **kwargs)
        return self._forward_method(*args, **kwargs)

    # ---- the per-platform methods (overridden by ops) -----------------------------------------

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The spec: plain PyTorch, runs anywhere. Every op must implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward_native")

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_cuda(*args, **kwargs)

    def forward_xpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    @classmethod
    def effective_method(cls, method: str) -> str:
        """The method that really runs for ``method`` after base-class fallbacks, for reports."""
        while method != "forward_native" and getattr(cls, method) is getattr(CustomOp, method):
            method = FALLBACK_CHAIN.get(method, "forward_native")
        return method

    # ---- registries ---------------------------------------------------------------------------

    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: registers an in-tree op under ``name`` and sets ``cls.name``."""

        _check_op_name("register", name)

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if not (isinstance(op_cls, type) and issubclass(op_cls, CustomOp)):
                raise TypeError(f"CustomOp.register({name!r}) decorates CustomOp subclasses, got {op_cls!r}")
            with _registry_lock:
                existing = CustomOp.op_registry.get(name)
                if existing is not None and existing is not op_cls:
                    raise ValueError(f"CustomOp.register: op name {name!r} is taken by {existing.__qualname__}")
                own_name = op_cls.__dict__.get("name")
                if own_name is not None and own_name != name and CustomOp.op_registry.get(own_name) is op_cls:
                    # one class, one enable name: "-a" must keep disabling it
                    raise ValueError(f"CustomOp.register: {op_cls.__qualname__} is already op {own_name!r}; "
                                     f"it cannot also be {name!r} (subclass it for a second name)")
                op_cls.name = name
                CustomOp.op_registry[name] = op_cls
            return op_cls

        return decorator

    @classmethod
    def register_oot(
        cls,
        _decorated_op_cls: type[CustomOp] | str | None = None,
        name: str | None = None,
        *,
        override: bool = False,
    ) -> Any:
        """Registers an out-of-tree replacement for an in-tree op. Four forms::

            @CustomOp.register_oot("RMSNorm")          # key: in-tree class name or op name
            @CustomOp.register_oot(name="rms_norm")
            @RMSNorm.register_oot                       # key: the class it is called on
            CustomOp.register_oot(_decorated_op_cls=MyNorm, name="RMSNorm")

        Registering the same class again is a no-op; a different class under a taken key raises
        unless ``override=True``. The replacement keeps the in-tree op's name, so ``-rms_norm``
        disables it too.
        """
        if isinstance(_decorated_op_cls, str):
            if name is not None:
                raise TypeError("CustomOp.register_oot: give the key once, positionally or as name=")
            name, _decorated_op_cls = _decorated_op_cls, None

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if not isinstance(op_cls, type):
                raise TypeError(f"CustomOp.register_oot decorates classes, got {op_cls!r}")
            key = name if name is not None else (None if cls is CustomOp else cls.__name__)
            if key is None:
                raise TypeError("CustomOp.register_oot needs name= when called on CustomOp itself")
            with _registry_lock:
                CustomOp._store_oot(CustomOp.resolve_op_name(key), op_cls, override)
            return op_cls

        if _decorated_op_cls is None:
            return decorator
        return decorator(_decorated_op_cls)

    @staticmethod
    def _store_oot(op_name: str, op_cls: type[CustomOp], override: bool) -> None:
        if not issubclass(op_cls, CustomOp):
            raise TypeError(f"CustomOp.register_oot: {op_cls.__qualname__} must subclass CustomOp")
        own_name = op_cls.__dict__.get("name")
        replaced = [n for n, c in CustomOp.op_registry_oot.items() if c is op_cls and n != op_name]
        if (own_name is not None and own_name != op_name) or replaced:
            raise ValueError(
                f"CustomOp.register_oot: {op_cls.__qualname__} is already op {own_name or replaced[0]!r}; "
                f"it cannot also replace {op_name!r} (one class keeps one enable name: register a subclass)"
            )
        existing = CustomOp.op_registry_oot.get(op_name)
        if existing is op_cls:
            return  # plugins load in many processes, sometimes twice in one
        if existing is not None and not override:
            raise ValueError(
                f"CustomOp.register_oot: {op_name!r} is already replaced by {existing.__qualname__}; "
                "pass override=True to replace it"
            )
        if getattr(op_cls, "name", None) != op_name:
            op_cls.name = op_name  # keep the in-tree enable name: -rms_norm disables it too
        CustomOp.op_registry_oot[op_name] = op_cls

    @staticmethod
    def unregister_oot(key: str) -> type[CustomOp] | None:
        """Removes the replacement registered under ``key`` (class or op name); returns it."""
        with _registry_lock:
            return CustomOp.op_registry_oot.pop(CustomOp.resolve_op_name(key), None)

    @staticmethod
    def resolve_op_name(key: str) -> str:
        """Maps an op name or an in-tree class name to the registered op name."""
        registry = CustomOp.op_registry.copy()  # a snapshot: another thread may register meanwhile
        if key in registry:
            return key
        for op_name, op_cls in registry.items():
            if op_cls.__name__ == key:
                return op_name
        known = sorted(registry) + sorted(c.__name__ for c in registry.values())
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"CustomOp: no registered op or class named {key!r}{hint}")
