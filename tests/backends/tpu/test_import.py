"""How the TPU backend loads: the JAX API needs no torch_xla; the xla kernels register without
importing it; a missing bridge module names the extra on first use; every kernel takes its op's
schema arguments exactly."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest
import torch

pytest.importorskip("jax")

from customop.backends.tpu import xla_kernels  # noqa: E402


def test_jax_api_needs_no_torch_xla():
    """Importing the backend (which registers the xla kernels where torch_xla is installed) and
    calling the JAX API import neither torch_xla nor torchax: a JAX-only process never starts
    torch_xla's runtime."""
    code = ("import sys, jax.numpy as jnp; from customop.backends import tpu; "
            "tpu.rms_norm(jnp.ones((8, 128)), None, interpret=True); "
            "print(sorted(m for m in ('torch_xla', 'torchax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["torch_xla", "torchax"])
def test_missing_bridge_module_names_the_extra(module, monkeypatch):
    """The first kernel call imports the bridge; a missing module becomes an error naming the extra
    (``None`` in ``sys.modules`` makes ``import`` raise as if it were not installed)."""
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    # the first missing one is named: here the other may be missing too (the main tier has neither)
    others_present = all(importlib.util.find_spec(m) for m in ("torch_xla", "torchax") if m != module)
    named = module if others_present else "(torch_xla|torchax)"
    xla_kernels._call_jax.cache_clear()
    try:
        with pytest.raises(ImportError, match=rf"needs '{named}'.*pip install customop\[tpu\]"):
            xla_kernels.rms_norm(torch.ones(8, 128), None, 1e-6)
    finally:
        xla_kernels._call_jax.cache_clear()


def test_registration_imports_nothing_from_torch_xla():
    """``register()`` needs torch only (it is what importing the backend runs when torch_xla is
    installed), and puts a kernel on the XLA key of every op it names."""
    code = ("import sys, torch; from customop.backends.tpu import xla_kernels; xla_kernels.register(); "
            "has = torch._C._dispatch_has_kernel_for_dispatch_key; "
            "assert all(has(f'customop::{n}', 'XLA') for n in xla_kernels.KERNELS); "
            "assert all(has(f'customop::{n}', 'AutogradXLA') for n in xla_kernels.IN_PLACE); "
            "print(sorted(m for m in ('torch_xla', 'torchax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(xla_kernels.KERNELS))
def test_kernels_take_the_schema_arguments(name):
    """One contract: each kernel is registered for an existing ``customop::`` op and takes that
    op's arguments, by name and in order (the gated activations' generic kernels: x first)."""
    schema = getattr(torch.ops.customop, name).default._schema
    expected = [a.name for a in schema.arguments]
    params = list(inspect.signature(xla_kernels.KERNELS[name]).parameters.values())
    if params[-1].kind is inspect.Parameter.VAR_POSITIONAL:
        assert name in xla_kernels.GATED_ACTIVATIONS and [p.name for p in params[:-1]] == expected[:1]
    else:
        assert [p.name for p in params] == expected
    assert set(xla_kernels.IN_PLACE) == {n for n in xla_kernels.KERNELS
                                         if getattr(torch.ops.customop, n).default._schema.is_mutable}


def test_mrope_keeps_its_native_path_on_tpu():
    """MRotaryEmbedding's [3, T] positions are not the rotary kernel's contract: it must not
    inherit RotaryEmbedding.forward_tpu."""
    from customop.ops.rotary_embedding import MRotaryEmbedding

    assert MRotaryEmbedding.forward_tpu is MRotaryEmbedding.forward_native
