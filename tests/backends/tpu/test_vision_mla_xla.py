"""``forward_tpu`` end to end on the XLA CPU device (the tpu tier: ``bash .ci/tpu.sh``) for the
ops whose ``customop::`` calls have no ``xla`` kernel: ``multi_head_latent_attention``
(``customop::mla_decode`` and ``customop::varlen_attn``), ``conv2d``/``conv3d``
(``customop::conv2d``/``conv3d``) and ``rel_pos_attention`` (plain torch in ``forward_kernel``).
Each op is built with the TPU platform forced, run on XLA tensors and judged by the float64
references of ``tests/cases``, on one or two rows of its case table; what ran on the CPU instead
of XLA (torch_xla's fallback counter) is asserted too.

Without an ``xla`` kernel a ``customop::`` op runs its reference body below functionalization, on
raw XLA tensors. Two bodies failed there in torch_xla 2.9 and were rewritten for it: the MLA
decode reference filled its output row by row (``out[b] = ...``; the writes were lost, every
decode row came back zero) and now stacks the rows; the conv linear form called ``x.unfold`` (no
XLA kernel) and now splits the spatial dims with reshapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("torchax")

import torch_xla.debug.metrics as xla_metrics  # noqa: E402

import customop  # noqa: E402
from customop.backends.tpu import xla_kernels  # noqa: E402, F401  (importing the backend registers the kernels)
from customop.ops.mla import MultiHeadLatentAttentionWrapper  # noqa: E402
from customop.samples import attention as attention_table  # noqa: E402
from customop.samples import conv as conv_table  # noqa: E402
from customop.samples.mla import BATCHES, build_modules, init_kwargs  # noqa: E402
from customop.testing import assert_close, forced_platform, randn  # noqa: E402
from tests.cases.attention import ref_rel_pos_attention  # noqa: E402
from tests.cases.conv import reference as conv_reference  # noqa: E402
from tests.cases.mla import reference as mla_reference  # noqa: E402

pytestmark = pytest.mark.xla

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
FP32 = [pytest.param(torch.float32, id="fp32")]


@pytest.fixture(scope="module")
def dev():
    return torch_xla.device()


#: bf16 judged normwise, at most four unit roundoffs (as tests/ops/test_mla.py judges MLA): the
#: float64 references round where the spec stores a bf16 result on the CPU, and XLA rounds
#: elsewhere (measured on torch_xla 2.9: a bf16 ``F.linear`` with bias rounds the product, then
#: the sum, where the CPU's addmm rounds once; softmax is not rounded once either)
NORMWISE = {torch.bfloat16: 4 * 2.0 ** -8}


def close(got, expected, dtype, what):
    if dtype == torch.float32:
        assert_close(got, expected, dtype, what=what)
        return
    err = float((got.double() - expected).norm() / expected.norm())
    assert err <= NORMWISE[dtype], f"{what}: normwise relative error {err:.2e} > {NORMWISE[dtype]:.2e}"


def build_tpu(make):
    """``make()`` with the TPU platform forced and every op enabled: ``forward_tpu`` throughout."""
    with forced_platform("tpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = make()
    assert op.forward_method_name == "forward_tpu"
    return op


def no_xla_kernel(*names: str) -> None:
    for name in names:
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"customop::{name}", "XLA"), \
            f"customop::{name} now has an xla kernel: update this test and docs/tpu.md"


def run_on_xla(op, dev, *args):
    """``op`` moved to ``dev`` and called on XLA copies of ``args``: the output on the CPU and the
    ops torch_xla ran on the CPU instead."""
    xla_metrics.clear_all()
    with torch.no_grad():
        out = op.to(dev)(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args))
    return out.cpu(), set(xla_metrics.executed_fallback_ops())


# ---- conv2d / conv3d -----------------------------------------------------------------------------------


def _conv_params():
    params = []
    for label, dtypes in (("k4 s2 p1 groups2", DTYPES), ("k3 p1", DTYPES), ("patch14", FP32),
                          ("qwen2-vl (2,14,14)", FP32)):
        case = conv_table.BY_LABEL[label]
        params += [pytest.param(case, d.values[0], id=f"{case.op}-{label}-{d.id}") for d in dtypes]
    return params


@pytest.mark.parametrize("case,dtype", _conv_params())
def test_conv_forward_tpu(case, dtype, dev):
    """customop::conv2d/conv3d have no xla kernel: the reference body (``F.conv*`` for these rows,
    the linear form for the patch projections) runs on the XLA device, with no CPU fallback."""
    no_xla_kernel(case.op)
    op = build_tpu(lambda: case.build(dtype, generator=torch.Generator().manual_seed(0)))
    x = case.input(case.shapes["small"][0], dtype, generator=torch.Generator().manual_seed(1))
    expected = conv_reference(op, x)
    out, fallbacks = run_on_xla(op, dev, x)
    assert out.dtype == dtype
    assert_close(out, expected, dtype, what=case.label)
    assert not fallbacks, f"ran on the CPU: {sorted(fallbacks)}"


# ---- rel_pos_attention --------------------------------------------------------------------------------

#: rows whose forward_tpu leaves the XLA device: label -> the ops torch_xla 2.9 runs on the CPU
REL_POS_FALLBACKS = {
    # resizing the position tables (F.interpolate, linear): no XLA lowering of the 1-d upsample
    "rel_pos interpolated": {"aten::upsample_linear1d"},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label", ["rel_pos 7x5", "rel_pos interpolated"])
def test_rel_pos_attention_forward_tpu(label, dtype, dev):
    """forward_tpu = forward_kernel: the blocked spec in plain torch, on XLA tensors (one block:
    ``bias_block`` has no ``xla`` entry)."""
    case = next(c for c in attention_table.REL_POS_CASES if c.label == label)
    op = build_tpu(lambda: case.build(dtype, generator=torch.Generator().manual_seed(0)))
    x = randn(*case.shapes["small"][0], dtype=dtype, generator=torch.Generator().manual_seed(1))
    expected = ref_rel_pos_attention(op, x)
    out, fallbacks = run_on_xla(op, dev, x)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, expected, dtype, label)
    assert fallbacks == REL_POS_FALLBACKS.get(label, set()), f"ran on the CPU: {sorted(fallbacks)}"


# ---- multi_head_latent_attention ----------------------------------------------------------------------

#: the host reads of the batch metadata (the layer's checks, the per-request walk) and
#: write_cache's boolean mask: the metadata is read on the host by design
MLA_HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero"}

def _mla_params():
    prefills, decodes = BATCHES[2], BATCHES[1]
    return [pytest.param(prefills, d.values[0], id=f"{prefills.label}-{d.id}") for d in DTYPES] + \
           [pytest.param(decodes, torch.float32, id=f"{decodes.label}-fp32")]


@pytest.mark.parametrize("batch,dtype", _mla_params())
def test_mla_forward_tpu(batch, dtype, dev):
    """forward_tpu = forward_kernel on XLA tensors: fresh prefills through one causal
    customop::varlen_attn, chunked prefills by the spec, decodes through customop::mla_decode
    (each its reference body here); the submodules' own forward_tpu (Pallas RMSNorm and RoPE).
    The output and the cache rows written, against the float64 reference."""
    no_xla_kernel("mla_decode", "varlen_attn")
    op = build_tpu(lambda: MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(True, dtype), True)))
    positions, hidden, cache, meta = batch.build(dtype)
    expected, rows = mla_reference(op, positions, hidden, cache.clone(), meta)
    meta_xla = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(dev) for f in dataclasses.fields(meta)
                                            if isinstance(getattr(meta, f.name), torch.Tensor)})
    cache_xla = cache.to(dev)
    out, fallbacks = run_on_xla(op, dev, positions, hidden, cache_xla, meta_xla)
    assert out.dtype == dtype and out.shape == hidden.shape
    close(out, expected, dtype, batch.label)
    written = cache_xla.cpu().view(-1, cache.shape[-1])
    close(written[meta.slot_mapping], rows, dtype, "cache rows")
    untouched = torch.ones(written.shape[0], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    before = cache.view(-1, cache.shape[-1])
    assert torch.allclose(written[untouched], before[untouched], rtol=0, atol=0, equal_nan=True), \
        "a cache row outside slot_mapping was written"
    assert fallbacks <= MLA_HOST_READS, f"ran on the CPU: {sorted(fallbacks - MLA_HOST_READS)}"
