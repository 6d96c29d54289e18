"""Entry-point plugins.

Two groups:

- ``customop.platform_plugins``: functions returning a Platform class path or None (read by
  ``customop.platforms`` when the platform is first resolved);
- ``customop.plugins``: general plugins, functions called once per process before the first op is
  built (typically they call ``CustomOp.register_oot``; registration is idempotent, so a plugin
  that runs in many processes, or twice, is safe).

``CUSTOMOP_PLUGINS`` (comma-separated entry-point names) is an allow-list; unset loads all.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from importlib.metadata import entry_points

logger = logging.getLogger("customop")

ENV_PLUGINS = "CUSTOMOP_PLUGINS"
PLATFORM_PLUGINS_GROUP = "customop.platform_plugins"
GENERAL_PLUGINS_GROUP = "customop.plugins"

_general_loaded = False
_general_lock = threading.Lock()


def allowed_plugin_names() -> set[str] | None:
    """The allow-list from ``CUSTOMOP_PLUGINS`` (None when unset: everything is allowed)."""
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def load_plugins_by_group(group: str) -> dict[str, Callable]:
    """Loads the allowed entry points of ``group``; a plugin that fails to load is logged and skipped."""
    allowed = allowed_plugin_names()
    loaded: dict[str, Callable] = {}
    for ep in entry_points(group=group):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            loaded[ep.name] = ep.load()
        except Exception:
            logger.exception("customop: failed to load plugin %r from group %s", ep.name, group)
    return loaded


def load_general_plugins() -> None:
    """Calls every allowed general plugin, once per process."""
    global _general_loaded
    if _general_loaded:
        return
    with _general_lock:
        if _general_loaded:
            return
        _general_loaded = True
        for name, fn in load_plugins_by_group(GENERAL_PLUGINS_GROUP).items():
            try:
                fn()
            except Exception:
                logger.exception("customop: general plugin %r raised", name)


def reset_for_tests() -> None:
    """Lets the next ``load_general_plugins()`` run the plugins again."""
    global _general_loaded
    _general_loaded = False
