"""What is registered, and what each op would run here: the data behind ``customop info``."""

from __future__ import annotations

import dataclasses

from customop.config import Config, get_config, use_config
from customop.custom_op import CustomOp
from customop.platforms import Platform, current_platform


@dataclasses.dataclass(frozen=True)
class DispatchRow:
    op: str
    op_class: str
    replaced_by: str | None  # the out-of-tree class, if any
    enabled: bool
    method: str  # the method the platform selects (forward_native when disabled)
    runs: str  # the method that really runs after base-class fallbacks


def list_ops() -> list[str]:
    """The registered op names, sorted."""
    return sorted(CustomOp.op_registry.copy())  # a snapshot: registration may run in another thread


def dispatch_report(config: Config | None = None, platform: Platform | None = None) -> list[DispatchRow]:
    """For each registered op: enabled under ``config``? which method on ``platform``?"""
    config = config or get_config()
    platform = platform or current_platform()
    rows = []
    for name in list_ops():
        in_tree = CustomOp.op_registry[name]
        replacement = CustomOp.op_registry_oot.get(name)
        cls = replacement or in_tree
        with use_config(config):  # what construction would decide: an op may override enabled()
            enabled = cls.enabled()
        method = platform.forward_method if enabled else "forward_native"
        rows.append(
            DispatchRow(
                op=name,
                op_class=in_tree.__qualname__,
                replaced_by=replacement.__qualname__ if replacement else None,
                enabled=enabled,
                method=method,
                runs=cls.effective_method(method),
            )
        )
    return rows


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table (no dependency on a table library)."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
