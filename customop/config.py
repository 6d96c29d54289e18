"""The `custom_ops` grammar, the Config object and where the current config comes from.

Grammar (vLLM's, plus comma forms inside one element)::

    token := "all" | "none" | ("+" | "-") NAME

Precedence when deciding one op, highest first: an instance's ``enforce_enable=True``, then
``-name``, then ``+name``, then the base mode (``all``/``none``). With no base mode given the
default is ``none`` when the model is compiled by Inductor (``backend == "inductor"`` and
``mode != NONE``: Inductor generates better code from ``forward_native``) and ``all`` otherwise.

The current config is, in order: the innermost ``use_config(...)`` block, the one given to
``set_config(...)``, or a default built from ``CUSTOMOP_CUSTOM_OPS`` (comma form).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import enum
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator

logger = logging.getLogger("customop")

ENV_CUSTOM_OPS = "CUSTOMOP_CUSTOM_OPS"
_BASE_MODES = ("all", "none")
_OP_TOKEN = re.compile(r"^[+-][A-Za-z_][A-Za-z0-9_]*$")
_warned_unknown: set[str] = set()


class CompilationMode(enum.IntEnum):
    """How the model around the ops is compiled (vLLM's names, so configs move over unchanged)."""

    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


def parse_custom_ops(custom_ops: list[str] | tuple[str, ...] | str) -> tuple[str, ...]:
    """Splits comma forms and validates every token; returns the flat token tuple.

    Raises ``ValueError`` naming the offending token for: a malformed token, more than one base
    mode (``all`` with ``none``, or either twice), or one op both enabled and disabled.
    """
    if isinstance(custom_ops, str):
        custom_ops = [custom_ops] if custom_ops.strip() else []
    if not isinstance(custom_ops, (list, tuple)) or not all(isinstance(e, str) for e in custom_ops):
        raise TypeError(f"custom_ops must be a list of strings such as ['none', '+rms_norm'] (or one "
                        f"comma-separated string), got {custom_ops!r}")
    tokens = tuple(part.strip() for element in custom_ops for part in str(element).split(","))
    for token in tokens:
        if token not in _BASE_MODES and not _OP_TOKEN.match(token):
            raise ValueError(
                f"custom_ops: invalid token {token!r}; expected 'all', 'none', '+op' or '-op' "
                "(comma forms like 'none,+rms_norm' are accepted)"
            )
    base = [t for t in tokens if t in _BASE_MODES]
    if len(base) > 1:
        raise ValueError(f"custom_ops: only one base mode is allowed, got {base} in {list(tokens)}")
    plus = {t[1:] for t in tokens if t.startswith("+")}
    minus = {t[1:] for t in tokens if t.startswith("-")}
    if both := sorted(plus & minus):
        raise ValueError(
            f"custom_ops: cannot both enable and disable the same op(s): {', '.join(both)}"
        )
    return tokens


@dataclasses.dataclass
class Config:
    """Which custom ops are enabled, and how the surrounding model is compiled.

    ``enabled_custom_ops`` / ``disabled_custom_ops`` count one tick per constructed instance, so a
    serving stack can log what its model actually used.
    """

    custom_ops: list[str] = dataclasses.field(default_factory=list)
    backend: str = "inductor"
    mode: CompilationMode = CompilationMode.NONE
    enabled_custom_ops: Counter = dataclasses.field(default_factory=Counter, init=False, compare=False)
    disabled_custom_ops: Counter = dataclasses.field(default_factory=Counter, init=False, compare=False)

    def __post_init__(self) -> None:
        self.mode = CompilationMode(self.mode)
        tokens = parse_custom_ops(self.custom_ops)
        self._plus = frozenset(t[1:] for t in tokens if t.startswith("+"))
        self._minus = frozenset(t[1:] for t in tokens if t.startswith("-"))
        if "all" in tokens:
            self._default_on = True
        elif "none" in tokens:
            self._default_on = False
        else:
            self._default_on = not (self.backend == "inductor" and self.mode != CompilationMode.NONE)
        self.custom_ops = list(tokens)
        self._warn_unknown_names(self._plus | self._minus)

    @property
    def default_on(self) -> bool:
        """The base mode after defaults: True for ``all``, False for ``none``."""
        return self._default_on

    def is_enabled(self, name: str) -> bool:
        """``-name`` beats ``+name`` beats the base mode (``+x`` with ``-x`` is rejected earlier)."""
        if name in self._minus:
            return False
        return name in self._plus or self._default_on

    def is_explicitly_enabled(self, name: str) -> bool:
        """True for ``+name``: an explicit request, which must never fall back silently."""
        return name in self._plus

    def record(self, name: str, enabled: bool) -> None:
        (self.enabled_custom_ops if enabled else self.disabled_custom_ops)[name] += 1

    @staticmethod
    def _warn_unknown_names(names: frozenset[str]) -> None:
        from customop.custom_op import CustomOp  # registry lives with the base class

        known = set(CustomOp.op_registry)
        for name in sorted(names - known):
            if name in _warned_unknown:
                continue
            _warned_unknown.add(name)
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            logger.warning("custom_ops names unknown op %r (not registered)%s", name, hint)


_scoped: contextvars.ContextVar[Config | None] = contextvars.ContextVar("customop_config", default=None)
_global: Config | None = None
_from_env: tuple[str, Config] | None = None


def _require_config(where: str, config: object, allow_none: bool) -> None:
    if isinstance(config, Config) or (allow_none and config is None):
        return
    expected = "a customop.Config or None" if allow_none else "a customop.Config"
    hint = f"; write {where}(Config(custom_ops={config!r}))" if isinstance(config, (str, list)) else ""
    raise TypeError(f"{where} takes {expected}, got {config!r}{hint}")


def set_config(config: Config | None) -> None:
    """Sets the process-wide config (``None`` goes back to the environment default)."""
    global _global
    _require_config("set_config", config, allow_none=True)
    _global = config


def get_config() -> Config:
    """The innermost ``use_config`` block, else ``set_config``'s, else the environment default."""
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    if _global is not None:
        return _global
    return _env_config()


def _env_config() -> Config:
    # Rebuilt only when the variable changes, so tests and launchers may set it late.
    global _from_env
    raw = os.environ.get(ENV_CUSTOM_OPS, "")
    if _from_env is None or _from_env[0] != raw:
        _from_env = (raw, Config(custom_ops=[raw] if raw.strip() else []))
    return _from_env[1]


@contextlib.contextmanager
def use_config(config: Config) -> Iterator[Config]:
    """Makes ``config`` current inside the block.

    The scope is a ``contextvars`` context: it follows the current thread and asyncio task, but
    threads (and pool workers) started inside the block do NOT inherit it. Build ops in the
    block, or run workers under a copy of the context::

        with use_config(cfg):
            ctx = contextvars.copy_context()
            pool.submit(ctx.run, build_model)
    """
    _require_config("use_config", config, allow_none=False)
    token = _scoped.set(config)
    try:
        yield config
    finally:
        _scoped.reset(token)
