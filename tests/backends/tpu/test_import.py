"""The JAX half imports without torch_xla; the torch half names the extra when torch_xla is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytest.importorskip("jax")


def test_jax_api_needs_no_torch_xla():
    """Importing the JAX API does not import torch_xla, even where it is installed (the CPU is
    the platform here), and JAX-side calls never start torch_xla's runtime."""
    code = ("import sys; from customop.backends import tpu; "
            "assert callable(tpu.rms_norm) and callable(tpu.per_group_quant_fp8); "
            "print(sorted(m for m in ('torch_xla', 'torchax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_missing_torch_xla_names_the_extra():
    from customop.backend_loader import load_backend

    backend = load_backend("tpu")  # jax is enough for the kernels
    with pytest.raises(ImportError, match=r"pip install customop\[tpu\]"):
        backend.torch_ops  # noqa: B018  (the lazy torch_xla bridge)


def test_mrope_keeps_its_native_path_on_tpu():
    """MRotaryEmbedding's [3, T] positions are not the rotary kernel's contract: it must not
    inherit RotaryEmbedding.forward_tpu."""
    from customop.ops.rotary_embedding import MRotaryEmbedding

    assert MRotaryEmbedding.forward_tpu is MRotaryEmbedding.forward_native
