"""State-space family: every case of the table (``customop/samples/mamba.py``) on forward_native and
forward_cpu against the float64 references (``tests/cases/mamba.py``): outputs, and every slot of
the caches afterwards (the requests' slots updated, the null slot and the spare untouched); the
forward_kernel wiring (the library ops' reference bodies on CPU tensors); the grouped gated norm's
table; the conformance suite (what ``customop check`` runs).
"""

from __future__ import annotations

import pytest
import torch

from customop.config import Config, use_config
from customop.ops.mamba import MambaMixer, MambaMixer2, Mixer2RMSNormGated, ShortConv
from customop.samples.mamba import BATCHES, CASES, DTYPES, NORM_CASES, NORM_SIZES
from customop.testing import assert_close, assert_conforms
from tests.cases.mamba import assert_matches, norm_reference, reference


def build(case, dtype, seed=0, tier="small"):
    with use_config(Config(custom_ops=["all"])):
        return case.build(tier, dtype, torch.Generator().manual_seed(seed))


def run_case(case, batch, dtype, path):
    """(what the path returned and left in the caches, the float64 expectation)."""
    op = build(case, dtype)
    h, *caches, meta = case.inputs(op, batch, dtype, torch.Generator().manual_seed(1))
    expected = reference(case, op, batch, h, *caches)
    h_before = h.clone()
    out = getattr(op, path)(h, *caches, meta)
    assert torch.equal(h, h_before), "hidden_states must not be written"
    return (out, *caches), expected


PARAMS = [pytest.param(c, b, id=f"{c.label}-{b.label}") for c in CASES for b in BATCHES["small"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("case,batch", PARAMS)
def test_matches_float64_reference(case, batch, path, dtype):
    got, expected = run_case(case, batch, dtype, path)
    assert_matches(got, expected, dtype, what=f"{case.label} {batch.label} {path}")


@pytest.mark.parametrize("case,batch", PARAMS)
def test_forward_kernel_wiring(case, batch):
    """forward_kernel (what forward_cuda/_xpu/_tpu run) on CPU tensors reaches the library ops'
    reference bodies: the arguments it builds give the right outputs and caches."""
    got, expected = run_case(case, batch, torch.bfloat16, "forward_kernel")
    assert_matches(got, expected, torch.bfloat16, what=f"{case.label} {batch.label}")


@pytest.mark.parametrize("chunked_from", [1, 10**9], ids=["chunked", "recurrence"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case,batch", [p for p in PARAMS if p.values[0].op == "mamba_mixer2"])
def test_cpu_mamba2_prefill_both_forms(case, batch, dtype, chunked_from, monkeypatch):
    """forward_cpu's Mamba-2 prefill in both of its forms (the table's requests are shorter than
    the measured switch to the chunked form, so both are forced here)."""
    from customop.backends.cpu import mamba as cpu_steps

    monkeypatch.setattr(cpu_steps, "SSD_CHUNKED_FROM", chunked_from)
    got, expected = run_case(case, batch, dtype, "forward_cpu")
    assert_matches(got, expected, dtype, what=f"{case.label} {batch.label}")


def test_padding_rows_are_zero():
    """Rows past the batch's tokens come back zero on every path (not left undefined)."""
    case, batch = CASES[3], BATCHES["small"][2]
    assert batch.pad_rows
    for path in ("forward_native", "forward_cpu", "forward_kernel"):
        (out, *_), _ = run_case(case, batch, torch.float32, path)
        assert torch.equal(out[-batch.pad_rows:], torch.zeros_like(out[-batch.pad_rows:]))


@pytest.mark.parametrize("cls", [MambaMixer, MambaMixer2, ShortConv], ids=lambda c: c.__name__)
def test_forward_cuda_is_the_kernel_route(cls, monkeypatch):
    calls = []
    monkeypatch.setattr(cls, "forward_kernel", lambda self, *a: calls.append(a) or "kernel")
    op = build(next(c for c in CASES if c.op_class is cls), torch.float32)
    args = (1, 2, 3) if cls is ShortConv else (1, 2, 3, 4)
    assert op.forward_cuda(*args) == op.forward_xpu(*args) == op.forward_tpu(*args) == "kernel"
    assert len(calls) == 3


# ---- the grouped gated norm --------------------------------------------------------------------

NORM_PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}") for c in NORM_CASES
               for s in NORM_SIZES["small"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_kernel"])
@pytest.mark.parametrize("case,size", NORM_PARAMS)
def test_norm_matches_float64_reference(case, size, path, dtype):
    rows, hidden, groups = size
    gen = torch.Generator().manual_seed(0)
    with use_config(Config(custom_ops=["all"])):
        op = case.build(hidden, groups, dtype, gen)
    x, gate = case.inputs(rows, hidden, dtype, gen)
    got = getattr(op, path)(x, gate)
    want_dtype = dtype if op.weight is None else torch.promote_types(dtype, op.weight.dtype)
    assert got.dtype == want_dtype
    # x's dtype bounds the error: with an fp32 weight the output is fp32, but the normalised value
    # was rounded to x's dtype first, where a value within fp32 error of a tie may round either way
    assert_close(got, norm_reference(op, x, gate), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_norm_rounds_before_the_weight(dtype):
    """vLLM's order: the normalised value is rounded to x's dtype, then multiplied by the weight.
    The spec must follow it bit for bit, and multiplying in fp32 first must visibly differ (or
    this test could not tell the orders apart; that is what the norms' rms_norm_gated does)."""
    gen = torch.Generator().manual_seed(3)
    with use_config(Config(custom_ops=["all"])):
        op = NORM_CASES[0].build(512, 4, dtype, gen)
    x, gate = NORM_CASES[0].inputs(64, 512, dtype, gen)
    g = x.double() * torch.nn.functional.silu(gate.double())
    groups = g.unflatten(-1, (4, 128))
    n = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + op.variance_epsilon)).flatten(-2)
    vllm_order = (n.to(dtype) * op.weight).to(dtype)
    fp32_order = (n.float() * op.weight.float()).to(dtype)
    for got in (op.forward_native(x, gate), op.forward_cpu(x, gate), op.forward_kernel(x, gate)):
        assert (got == vllm_order).float().mean() > 0.99
    assert (fp32_order != vllm_order).float().mean() > 0.02


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_cpu_compiled_tier(dtype):
    """Above the threshold forward_cpu runs Inductor's compiled spec: still the reference."""
    case = NORM_CASES[0]
    rows = int(Mixer2RMSNormGated.cpu_tiers.compile_from(dtype)) // 1024 + 3
    with use_config(Config(custom_ops=["all"])):
        op = case.build(1024, 4, dtype, torch.Generator().manual_seed(0))
    x, gate = case.inputs(rows, 1024, dtype, torch.Generator().manual_seed(1))
    assert_close(op.forward_cpu(x, gate), norm_reference(op, x, gate), dtype)


# ---- conformance (customop check's samples) ------------------------------------------------------


@pytest.mark.parametrize("cls", [MambaMixer, MambaMixer2, ShortConv, Mixer2RMSNormGated], ids=lambda c: c.__name__)
def test_conforms_on_cpu(cls):
    assert_conforms(cls, platform="cpu")


def test_conformance_catches_a_write_to_the_padding_slot():
    """The conformance check compares the caches the spec writes, not only the output: a path that
    returns the right output but also writes the padding slot (0) fails."""

    class WritesSlotZero(ShortConv):
        def forward_cpu(self, hidden_states, conv_state, metadata):
            out = self.forward_native(hidden_states, conv_state, metadata)
            conv_state[0].add_(1.0)
            return out

    with pytest.raises(AssertionError, match=r"args\[1\] \(written in place\)"):
        assert_conforms(WritesSlotZero, platform="cpu", dtypes=[torch.float32])


def test_benchmark_flop_count_of_the_chunked_scan():
    """The chunked scan's matmul FLOPs (benchmarks' ``ssd_flops``) equal the matmuls of the chunked
    form counted one by one, and the TFLOP/s table reads a runner's rows."""
    from customop.benchmarks.specs import mamba as mamba_spec

    shape = next(s for spec_ in mamba_spec.SPECS if spec_.name == "ssd_chunk_scan" for s in spec_.shapes)
    H, P, N, G = (shape.extra[k] for k in ("heads", "head_dim", "state", "groups"))
    Q, chunks = mamba_spec.CHUNK, shape.tokens // mamba_spec.CHUNK
    per_chunk = {"C B^T": 2 * Q * Q * N * G, "(L*CB) X": 2 * Q * Q * P * H, "B^T X": 2 * N * Q * P * H,
                 "C h": 2 * Q * N * P * H}
    assert mamba_spec.ssd_flops(shape) == chunks * sum(per_chunk.values())
    rows = [{"op": "ssd_chunk_scan", "shape": shape.label, "impls": {"customop": {"us": 1000.0}, "eager": {}}}]
    table = mamba_spec.tflops_table(rows)
    assert f"| {shape.label} | {mamba_spec.ssd_flops(shape) / 1e9:.1f} | {mamba_spec.ssd_flops(shape) / 1e9:.1f} | - |" in table
