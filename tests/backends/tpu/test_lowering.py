"""Every kernel lowered for TPU (Mosaic) on this CPU machine, without running it.

``jax.export(..., platforms=["tpu"])`` runs the Pallas TPU lowering and serialises the Mosaic
module into a ``tpu_custom_call``: block shapes that break the TPU tiling rule, and primitives
Mosaic has no lowering for, fail here although interpret mode accepts them. It does not compile
the Mosaic module to TPU code (only libtpu on a TPU does that). Needs only jax: main tier.
"""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export as jax_export  # noqa: E402  (jax 0.7.1 does not import the submodule itself)
from jax.experimental import pallas as pl  # noqa: E402

from customop.backends import tpu  # noqa: E402

f32, bf16 = jnp.float32, jnp.bfloat16


def S(shape, dtype=f32):  # noqa: N802  (reads like a type in the tables below)
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_for_tpu(fn, *args) -> str:
    exported = jax_export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return exported.mlir_module()


CASES = {
    # name: (function with interpret=False, argument shapes)
    "rms_norm-64x1024-bf16": (functools.partial(tpu.rms_norm, eps=1e-6, block_rows=32),
                              (S((64, 1024), bf16), S((1024,), bf16))),
    "rms_norm-7x384-odd-rows": (functools.partial(tpu.rms_norm, eps=1e-6), (S((7, 384)), S((384,)))),
    "rms_norm-no-weight-variance": (functools.partial(tpu.rms_norm, weight=None, variance_size=100),
                                    (S((16, 256)),)),
    "fused_add_rms_norm-1x4096": (lambda x, r, w, **kw: tpu.rms_norm(x, w, 1e-6, r, **kw),
                                  (S((1, 4096), bf16), S((1, 4096), bf16), S((4096,), bf16))),
    "gemma_rms_norm-residual": (lambda x, r, w, **kw: tpu.gemma_rms_norm(x, w, 1e-6, r, **kw),
                                (S((20, 512), bf16), S((20, 512), bf16), S((512,)))),
    "rms_norm_gated-groups": (lambda x, w, z, **kw: tpu.rms_norm_gated(x, w, z, group_size=128, **kw),
                              (S((64, 512), bf16), S((512,)), S((64, 512), bf16))),
    "rms_norm_gated-no-gate": (lambda x, w, **kw: tpu.rms_norm_gated(x, w, None, norm_before_gate=True, **kw),
                               (S((7, 1024)), S((1024,)))),
    "rotary-neox-128": (lambda p, q, k, c, **kw: tpu.rotary_embedding(p, q, k, 128, c, True, **kw),
                        (S((64,), jnp.int32), S((64, 8 * 128), bf16), S((64, 2 * 128), bf16), S((4096, 128)))),
    "rotary-gptj-partial": (lambda p, q, c, **kw: tpu.rotary_embedding(p, q, None, 128, c, False, **kw)[0],
                            (S((7,), jnp.int32), S((7, 4 * 128)), S((512, 64)))),
    "silu_and_mul-column-blocks": (tpu.silu_and_mul, (S((64, 2 * 1024), bf16),)),
    "gelu_tanh_and_mul-row-split": (functools.partial(tpu.act_and_mul, activation="gelu_tanh"), (S((7, 192)),)),
    "gelu_and_mul-erf": (functools.partial(tpu.gelu_and_mul, approximate="none"), (S((16, 512)),)),
    "silu_and_mul_with_clamp": (functools.partial(tpu.silu_and_mul_with_clamp, swiglu_limit=7.0, alpha=1.702,
                                                  beta=1.0), (S((16, 2 * 512), bf16),)),
    "situ_and_mul-linear-row-split": (functools.partial(tpu.situ_and_mul, beta=4.0, linear_beta=25.0),
                                      (S((7, 192)),)),
    "per_token_quant_fp8": (tpu.per_token_quant_fp8, (S((64, 1024), bf16),)),
    "per_token_quant_fp8-ub": (tpu.per_token_quant_fp8, (S((7, 512)), S((1,)))),
    "per_group_quant_fp8": (functools.partial(tpu.per_group_quant_fp8, group_size=128),
                            (S((64, 1024), bf16),)),
    "per_group_quant_fp8-ue8m0-224": (functools.partial(tpu.per_group_quant_fp8, group_size=128, use_ue8m0=True,
                                                        fp8_max=224.0), (S((7, 512)),)),
}


@pytest.mark.parametrize("name", CASES)
def test_lowers_to_mosaic(name):
    fn, args = CASES[name]
    text = lower_for_tpu(functools.partial(fn, interpret=False), *args)
    assert "tpu_custom_call" in text, f"{name}: no Mosaic call in the TPU lowering"


def test_lowering_check_catches_bad_tiles():
    """What this file guards against: a (4, 1000) block on a (12, 1000) array is accepted by
    interpret mode but rejected by the TPU lowering."""
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def kernel(x, interpret):
        spec = pl.BlockSpec((4, 1000), lambda i: (i, 0))
        return pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(3,),
                              in_specs=[spec], out_specs=spec, interpret=interpret)(x)

    kernel(jnp.ones((12, 1000)), interpret=True)  # interpret mode does not mind
    with pytest.raises(Exception, match="divisible by 8 and 128"):
        lower_for_tpu(functools.partial(kernel, interpret=False), S((12, 1000)))


@pytest.mark.parametrize("call", [
    lambda x: tpu.rms_norm(x, None, block_rows=12),
    lambda x: tpu.silu_and_mul(x, block_rows=4),
    lambda x: tpu.per_token_quant_fp8(x, block_rows=0),
], ids=["rms_norm", "act_and_mul", "quant"])
def test_bad_block_rows_fail_before_launch(call):
    """A user block that breaks the tiling rule is refused with the kernel's name and the rule,
    at trace time: nothing is compiled or launched."""
    with pytest.raises(ValueError, match=r"customop\.backends\.tpu\.\w+: block_rows"):
        call(jnp.ones((20, 256)))


def test_bad_arguments_name_the_kernel():
    x = jnp.ones((4, 256))
    with pytest.raises(ValueError, match="rms_norm: weight has shape"):
        tpu.rms_norm(x, jnp.ones((128,)))
    with pytest.raises(ValueError, match="group_size=100"):
        tpu.per_group_quant_fp8(x, 100)
    with pytest.raises(ValueError, match="rms_norm_gated: group_size"):
        tpu.rms_norm_gated(x, jnp.ones((256,)), group_size=100)
    with pytest.raises(ValueError, match="rotary_dim"):
        tpu.rotary_embedding(jnp.zeros((4,), jnp.int32), x, None, 128, jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="approximate"):
        tpu.gelu_and_mul(x, approximate="erf")
    with pytest.raises(ValueError, match="must be even"):
        tpu.silu_and_mul(jnp.ones((4, 7)))


@pytest.mark.tpu_hw
def test_runs_on_a_real_tpu():
    """Compiled by Mosaic and run, on a TPU only (never run so far: no TPU was available)."""
    if jax.default_backend() != "tpu":
        pytest.skip("needs a real TPU")
    x, w = jnp.ones((64, 1024), bf16), jnp.ones((1024,), bf16)
    y = tpu.rms_norm(x, w, 1e-6, interpret=False)
    assert jnp.allclose(y.astype(f32), 1.0, atol=1e-2)
