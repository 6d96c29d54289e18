"""State-space family: the cache contract on every path here (forward_native, forward_cpu, and
forward_kernel reaching the library ops' reference bodies): prefill then token-by-token decode ==
one prefill; a chunked prefill continuing from the cached state == one prefill; a varlen batch ==
each request alone; padding and other requests' slots untouched (NaN-poisoned); chunked SSD ==
the recurrence. Then the ``customop::`` ops under opcheck and torch.compile(fullgraph=True), and
bad inputs.
"""

from __future__ import annotations

import re

import pytest
import torch

from customop.config import Config, use_config
from customop.math import mamba as spec
from customop.ops.mamba import MambaMetadata
from customop.samples.mamba import BY_LABEL, mixer_compare
from customop.testing import assert_close, assert_same_error

PATHS = ["forward_native", "forward_cpu", "forward_kernel"]
CASES = [BY_LABEL[label] for label in ("mamba_mixer", "mamba_mixer2", "mamba_mixer2[1 group]", "short_conv")]
IDS = [c.label for c in CASES]
SLOTS = 6


def layer(case, dtype=torch.float32):
    with use_config(Config(custom_ops=["all"])):
        return case.build("small", dtype, torch.Generator().manual_seed(0))


def fresh_caches(op, case, dtype=torch.float32, seed=2):
    """Random caches with SLOTS slots (one more column of conv width than needed)."""
    from customop.samples.mamba import Batch

    return case.caches(op, Batch("x", decodes=SLOTS - 2), dtype, torch.Generator().manual_seed(seed))


def call(op, path, h, caches, meta):
    return getattr(op, path)(h, *caches, meta)


def assert_caches_equal(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, g.dtype, atol=2e-5, rtol=2e-5, what=f"{what} cache {i}")


def hidden(op, tokens, seed=1, dtype=torch.float32):
    width = op.conv_dim if hasattr(op, "L_cache") else op.hidden_size
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prefill_then_decode_equals_one_prefill(case, path):
    """11 tokens in one prefill == 6 in a prefill, then 5 single-token decode steps, the state
    carried through the caches; the caches end the same."""
    op = layer(case)
    h = hidden(op, 11)
    whole_caches = fresh_caches(op, case)
    whole = call(op, path, h, whole_caches, MambaMetadata.build((), (11,), (3,), (False,), chunk_size=4))
    caches = fresh_caches(op, case)
    outs = [call(op, path, h[:6], caches, MambaMetadata.build((), (6,), (3,), (False,), chunk_size=4))]
    for t in range(6, 11):
        outs.append(call(op, path, h[t:t + 1], caches, MambaMetadata.build((3,))))
    mixer_compare(torch.cat(outs), whole, torch.float32)
    assert_caches_equal(caches, whole_caches, case.label)


@pytest.mark.parametrize("split", [1, 2, 5, 7], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_chunked_prefill_continues_from_the_cache(case, path, split):
    """A prefill of 13 tokens == a prefill of ``split`` tokens, then one of the rest with
    ``has_initial_state`` (a continuing chunked prefill), whatever the split (shorter than the
    conv window, across Mamba-2's 4-token chunks); and without ``has_initial_state`` the second
    part must start from zero, not from the cache."""
    op = layer(case)
    h = hidden(op, 13)
    whole_caches = fresh_caches(op, case)
    whole = call(op, path, h, whole_caches, MambaMetadata.build((), (13,), (2,), (False,), chunk_size=4))
    caches = fresh_caches(op, case)
    first = call(op, path, h[:split], caches, MambaMetadata.build((), (split,), (2,), (False,), chunk_size=4))
    rest = call(op, path, h[split:], caches, MambaMetadata.build((), (13 - split,), (2,), (True,), chunk_size=4))
    mixer_compare(torch.cat([first, rest]), whole, torch.float32)
    assert_caches_equal(caches, whole_caches, case.label)
    fresh = call(op, path, h[split:], fresh_caches(op, case),
                 MambaMetadata.build((), (13 - split,), (2,), (False,), chunk_size=4))
    assert not torch.allclose(fresh, rest, atol=1e-3), "has_initial_state made no difference"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_varlen_batch_equals_each_request_alone(case, path):
    op = layer(case)
    lens, slots, inits = (5, 9, 2), (1, 4, 3), (True, False, True)
    h = hidden(op, 2 + sum(lens))
    batch_caches = fresh_caches(op, case)
    batched = call(op, path, h, batch_caches, MambaMetadata.build((5, 2), lens, slots, inits, chunk_size=4))
    caches = fresh_caches(op, case)
    outs = [call(op, path, h[:2], caches, MambaMetadata.build((5, 2)))]
    start = 2
    for n, slot, init in zip(lens, slots, inits):
        outs.append(call(op, path, h[start:start + n], caches,
                         MambaMetadata.build((), (n,), (slot,), (init,), chunk_size=4)))
        start += n
    mixer_compare(torch.cat(outs), batched, torch.float32)
    assert_caches_equal(caches, batch_caches, case.label)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_padding_and_unused_slots_are_never_read_or_written(case, path):
    """The null slot 0 and an unused slot 5 hold NaN: nothing of them reaches an output, and they
    come back bit for bit. Padding decode rows (slot 0, and PAD_SLOT_ID) and a padding prefill
    (slot -1) run from zero states."""
    op = layer(case)
    caches = fresh_caches(op, case)
    for c in caches:
        c[0], c[5] = float("nan"), float("nan")
    before = [c.clone() for c in caches]
    meta = MambaMetadata.build((1, 0, spec.PAD_SLOT_ID), (4, 3), (2, spec.PAD_SLOT_ID), (True, True), chunk_size=4)
    out = call(op, path, hidden(op, 10), caches, meta)
    assert not out.isnan().any()
    for c, b in zip(caches, before):
        assert c[0].isnan().all() and c[5].isnan().all()
        assert not torch.equal(c[1], b[1]) and not torch.equal(c[2], b[2]), "the real requests' slots must change"
        assert torch.equal(c[3], b[3]) and torch.equal(c[4], b[4]), "a slot no request owns changed"


@pytest.mark.parametrize("path", PATHS)
def test_mamba2_mup_vector(path):
    """Falcon-H1's ``mup_vector`` scales the input projection's output (z, xBC and dt alike)."""
    from customop.samples.mamba import BATCHES
    from tests.cases.mamba import assert_matches, reference

    case, batch = BY_LABEL["mamba_mixer2"], BATCHES["small"][2]
    op = layer(case)
    h, *caches, meta = case.inputs(op, batch, torch.float32, torch.Generator().manual_seed(1))
    mup = 0.5 + torch.rand(op.in_proj.output_size_per_partition, generator=torch.Generator().manual_seed(4))
    expected = reference(case, op, batch, h, *caches, mup_vector=mup)
    plain = reference(case, op, batch, h, *caches)
    out = getattr(op, path)(h, *caches, meta, mup_vector=mup)
    assert_matches((out, *caches), expected, torch.float32, what=path)
    assert not torch.allclose(expected[0], plain[0], atol=1e-3), "mup_vector made no difference"


# ---- the chunked SSD form == the recurrence ------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_chunked_ssd_equals_the_recurrence(chunk, dtype):
    """Lengths 1, chunk - 1, chunk, chunk + 1, 3 chunks + 1 and an empty request; 2 groups of 3
    heads; some requests continue from the cache, one is padding."""
    g = torch.Generator().manual_seed(chunk)
    lens = [1, max(chunk - 1, 0), chunk, chunk + 1, 3 * chunk + 1, 0]
    qsl = torch.tensor([0, *lens]).cumsum(0)
    T, H, P, N, G = int(qsl[-1]), 6, 4, 5, 2

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    x, dt, B, C = r(T, H, P), r(T, H), r(T, G, N), r(T, G, N)
    A, D, bias = -(0.5 + torch.rand(H, generator=g, dtype=torch.float64)), r(H), r(H)
    states = r(8, H, P, N)
    slots = torch.tensor([1, 2, 3, 4, 5, spec.PAD_SLOT_ID])
    init = torch.tensor([True, False, True, True, False, True])
    s1, s2 = states.clone(), states.clone()
    y1 = spec.ssd_recurrent(x, dt, A, B, C, D, bias, s1, qsl, slots, init)
    y2 = spec.ssd_chunk_scan(x, dt, A, B, C, D, bias, s2, qsl, slots, init, chunk)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert_close(y2, y1, dtype, atol=tol * float(y1.abs().max()), rtol=tol)
    assert_close(s2, s1, dtype, atol=tol * float(s1.abs().max()), rtol=tol)
    assert torch.equal(s1[0], states[0]) and torch.equal(s1[6:], states[6:])


# ---- torch.library: opcheck, compile ---------------------------------------------------------------


def _library_samples():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    qsl, slots, init = torch.tensor([0, 3, 3, 7], dtype=torch.int32), torch.tensor([2, 1, 0]), \
        torch.tensor([True, False, True])
    conv = r(4, 5, 6).transpose(1, 2)  # (slots, C=6, width=5): the transposed view of vLLM's layout
    H, P, N = 3, 4, 5
    yield "causal_conv1d_fn", (r(7, 6), r(6, 4), r(6), conv, qsl, slots, init, True, 0)
    yield "causal_conv1d_update", (r(3, 6), conv.clone(), r(6, 4), None, torch.tensor([3, 0, 1]), False, 0)
    yield "selective_scan", (r(7, H, P), r(7, H, P), -r(H, P, N).abs(), r(7, 1, N), r(7, 1, N), r(H, P), r(7, H, P),
                             r(H, P), r(4, H, P, N), qsl, slots, init, True, 0)
    dt4, A4, D4, b4 = spec.ssd_head_form(r(2, H), -r(H).abs(), r(H), r(H), P, N)
    yield "selective_state_update", (r(4, H, P, N), r(2, H, P), dt4, A4, r(2, 3, N), r(2, 3, N), D4, None, b4,
                                     torch.tensor([1, 3]), True, 0)
    yield "ssd_chunk_scan", (r(7, H, P), r(7, H), -r(H).abs(), r(7, 3, N), r(7, 3, N), r(H), r(H), r(4, H, P, N), qsl,
                             slots, init, 2, True, 0)
    yield "mixer2_gated_rms_norm", (r(3, 8), r(3, 8), r(8).to(torch.bfloat16), 1e-5, 4)


SAMPLES = list(_library_samples())


@pytest.mark.parametrize("name,args", SAMPLES, ids=[n for n, _ in SAMPLES])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.customop, name).default, args)


@pytest.mark.slow
def test_library_ops_compile_without_graph_breaks():
    """One compiled graph calling every cache-writing op on views of the caches: the writes land
    in the callers' tensors, as in eager."""
    (_, conv_args), (_, upd_args), (_, scan_args), _, (_, ssd_args), _ = SAMPLES

    def step(conv_fn, conv_upd, scan, ssd):
        ops = torch.ops.customop
        return (ops.causal_conv1d_fn(*conv_fn), ops.causal_conv1d_update(*conv_upd), ops.selective_scan(*scan),
                ops.ssd_chunk_scan(*ssd))

    def clone(args):
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    eager_args = [clone(a) for a in (conv_args, upd_args, scan_args, ssd_args)]
    compiled_args = [clone(a) for a in (conv_args, upd_args, scan_args, ssd_args)]
    torch._dynamo.reset()
    want = step(*eager_args)
    got = torch.compile(step, fullgraph=True)(*compiled_args)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
    for e, c in zip(eager_args, compiled_args):
        for a, b in zip(e, c):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                assert_close(b, a, torch.float32, what="a cache written in place")


@pytest.mark.slow
def test_forward_kernel_compiles_without_graph_breaks():
    """The whole Mamba-2 layer's kernel route in one graph (the batch description is host data,
    the cache writes happen on views of the callers' caches): same outputs and caches as eager."""
    from customop.samples.mamba import BATCHES

    case = BY_LABEL["mamba_mixer2"]
    op = layer(case)
    h, *caches, meta = case.inputs(op, BATCHES["small"][2], torch.float32, torch.Generator().manual_seed(1))
    eager_caches, compiled_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    want = op.forward_kernel(h, *eager_caches, meta)
    torch._dynamo.reset()
    got = torch.compile(op.forward_kernel, fullgraph=True)(h, *compiled_caches, meta)
    mixer_compare(got, want, torch.float32)
    assert_caches_equal(compiled_caches, eager_caches, case.label)
    assert not torch.equal(compiled_caches[1], caches[1]), "the compiled call wrote no state"


# ---- bad inputs: one clear error on every path -----------------------------------------------------


def _mixer2():
    op = layer(BY_LABEL["mamba_mixer2"])
    return op, fresh_caches(op, BY_LABEL["mamba_mixer2"])


def test_bad_inputs_raise_the_same_clear_error():
    op, (conv, ssm) = _mixer2()
    h, meta = torch.randn(4, 32), MambaMetadata.build((1, 2), (2,), (3,), (False,), chunk_size=4)
    cases = [
        ((torch.randn(4, 31), conv, ssm, meta), ValueError, r"hidden_states has shape \(4, 31\)"),
        ((h.long(), conv, ssm, meta), TypeError, "hidden_states must be a floating-point tensor"),
        ((h[:3], conv, ssm, meta), ValueError, "describes 2 decode \\+ 2 prefill tokens but hidden_states has 3 rows"),
        ((h, conv[:, :2], ssm, meta), ValueError, r"conv_state has shape \(6, 2, 80\), expected \(slots, >=3, 80\)"),
        ((h, conv.transpose(1, 2), ssm, meta), ValueError, "conv_state has shape"),
        ((h, conv, ssm[:, :, :4], meta), ValueError, "ssm_state has shape"),
        ((h, conv, ssm[:5], meta), ValueError, "conv_state has 6 slots, ssm_state 5"),
        ((h, conv, ssm, MambaMetadata.build((1, 2), (2,), (3,), (False,), chunk_size=6)), ValueError,
         "chunk_size=6 must be a power of two"),
        ((h, conv, ssm, MambaMetadata(num_decodes=2, state_indices_tensor_d=torch.tensor([[1, 2], [3, 4]]))),
         NotImplementedError, "speculative decoding"),
        ((h, conv, ssm, MambaMetadata(num_decodes=2, state_indices_tensor_d=torch.tensor([1.0, 2.0]))), TypeError,
         "state_indices_tensor_d has dtype torch.float32"),
        ((h, conv, ssm, MambaMetadata(num_prefills=1, num_prefill_tokens=2, query_start_loc_p=torch.tensor([0, 2]),
                                      state_indices_tensor_p=torch.tensor([1]))), ValueError,
         "has_initial_states_p is None"),
        ((h, conv, ssm, {"num_decodes": 1}), TypeError, "metadata must be a customop.math.mamba.MambaMetadata"),
    ]
    for args, error, match in cases:
        assert_same_error(op, args, error, match)


def test_bad_norm_input_and_constructor_arguments():
    from customop.ops.mamba import MambaMixer, MambaMixer2, Mixer2RMSNormGated

    norm = Mixer2RMSNormGated(96, 4)
    assert_same_error(norm, (torch.randn(3, 96), torch.randn(3, 95)), ValueError, "gate .* must match x")
    assert_same_error(norm, (torch.randn(3, 95), torch.randn(3, 95)), ValueError, r"x has shape \(3, 95\)")
    assert_same_error(norm, (torch.tensor(1.0), torch.tensor(1.0)), ValueError, r"x has shape \(\)")
    assert_same_error(norm, (torch.ones(3, 96, dtype=torch.int32), torch.randn(3, 96)), TypeError,
                      "x must be a floating-point tensor")
    assert_same_error(norm, (torch.randn(3, 96), torch.ones(3, 96, dtype=torch.int64)), TypeError,
                      "gate must be a floating-point tensor")
    # forward_cpu's one-pass test of the same conditions: good inputs skip the full check
    assert norm._inputs_pass(torch.randn(2, 96), torch.randn(2, 96).bfloat16())
    assert not norm._inputs_pass(torch.randn(2, 96), torch.randn(2, 1, 96))
    with pytest.raises(ValueError, match="full_n_groups=5 must divide full_hidden_size=96"):
        Mixer2RMSNormGated(96, 5)
    with pytest.raises(ValueError, match=re.escape("intermediate_size=40 must be num_heads * head_dim = 6 * 8")):
        MambaMixer2(32, 8, 4, 40, True, False, n_groups=2, num_heads=6, head_dim=8)
    with pytest.raises(ValueError, match="conv supports 'silu'"):
        MambaMixer(32, 8, 4, 40, 4, True, False, False, activation="gelu")


def test_n_groups_that_do_not_split_over_the_tp_ranks_raise(monkeypatch):
    """3 groups on 2 ranks cannot be split; 1 group is replicated instead (checked before any
    weight is built, so no process group is needed here)."""
    import types

    from customop.ops.mamba import MambaMixer2, mixer2

    monkeypatch.setattr(mixer2, "get_tp_group", lambda: types.SimpleNamespace(tp_size=2, tp_rank=0))
    with pytest.raises(ValueError, match="n_groups=3 must be 1 or a multiple of tp_size=2"):
        MambaMixer2(32, 8, 4, 48, True, False, n_groups=3, num_heads=6, head_dim=8)
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by tp_size=2"):
        MambaMixer2(32, 8, 4, 24, True, False, n_groups=1, num_heads=3, head_dim=8)
