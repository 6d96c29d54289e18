"""The state-space kernels (backends/triton/mamba_*.py) under the Triton interpreter: every case of
the table (``customop/samples/mamba.py``) through ``forward_kernel`` (the launchers as the CPU
kernels of their ``customop::`` ops) against the float64 references (``tests/cases/mamba.py``),
outputs and every cache slot; then the launchers directly against the spec run in float64:
padding and null slots (NaN-poisoned, never read or written), conv windows wider than needed and
kernel widths 2-5, the chunked SSD at chunk sizes around the requests' lengths, the Mamba-2
decode form, the gated norm's looped variant; opcheck of each op with its Triton kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from customop.backends.triton import mamba_conv, mamba_norm, mamba_scan, mamba_ssd
from customop.math import mamba as spec
from customop.samples.mamba import BATCHES, CASES, DTYPES, NORM_CASES, NORM_SIZES
from customop.testing import assert_close, oracle
from tests.backends.triton import aot_subprocess
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.mamba import assert_matches, norm_reference, reference

pytestmark = pytest.mark.interpret

LAUNCHERS = {name.removeprefix("customop::"): fn for module in (mamba_conv, mamba_scan, mamba_ssd, mamba_norm)
             for name, fn in module.KERNELS.items()}


@contextlib.contextmanager
def triton_kernels():
    """Every state-space op runs its Triton launcher on CPU tensors; yields {op: calls}."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(as_cpu_kernel(name, fn)) for name, fn in LAUNCHERS.items()}


# ---- the table, through forward_kernel -----------------------------------------------------------

#: The first case of each op on every batch and dtype; the variants on the mixed batch (decodes,
#: padding and prefills at once) in fp32 and bf16: the interpreter costs ~0.5-3 s a case, and the
#: variants change constructor arguments, not kernel code paths the base cases leave out. The GPU
#: tier runs everything.
BASE = ("mamba_mixer", "mamba_mixer2", "short_conv")
PARAMS = [pytest.param(c, b, d, id=f"{c.label}-{b.label}-{d}") for c in CASES for b in BATCHES["small"]
          for d in DTYPES if c.label in BASE or (b.label == "mixed" and d != torch.float16)]


@pytest.mark.parametrize("case,batch,dtype", PARAMS)
def test_kernels_match_float64_reference(case, batch, dtype, poison_empty):
    op = case.build("small", dtype, torch.Generator().manual_seed(0))
    if case.op == "mamba_mixer2":  # the norm sub-op as on an accelerator (here it dispatched to forward_cpu)
        op.norm._forward_method = op.norm.forward_kernel
    h, *caches, meta = case.inputs(op, batch, dtype, torch.Generator().manual_seed(1))
    expected = reference(case, op, batch, h, *caches)
    with triton_kernels() as calls:
        out = op.forward_kernel(h, *caches, meta)
    ran = {name for name, c in calls.items() if c}
    want = set()
    if batch.decodes + batch.pad_decodes:
        want |= {"causal_conv1d_update"} | ({"selective_state_update"} if case.op != "short_conv" else set())
    if batch.prefill_lens:
        want |= {"causal_conv1d_fn"} | {"mamba_mixer": {"selective_scan"}, "mamba_mixer2": {"ssd_chunk_scan"}}.get(
            case.op, set())
    if case.op == "mamba_mixer2" and case.init.get("use_rms_norm", True) is not False:
        want.add("mixer2_gated_rms_norm")
    assert want <= ran, f"the Triton launchers of {sorted(want - ran)} did not run"
    assert_matches((out, *caches), expected, dtype, what=f"{case.label} {batch.label}")


NORM_PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}") for c in NORM_CASES
               for s in NORM_SIZES["small"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,size", NORM_PARAMS)
def test_norm_kernel_matches_float64_reference(case, size, dtype, poison_empty):
    rows, hidden, groups = size
    op = case.build(hidden, groups, dtype, torch.Generator().manual_seed(0))
    x, gate = case.inputs(rows, hidden, dtype, torch.Generator().manual_seed(1))
    with as_cpu_kernel("mixer2_gated_rms_norm", mamba_norm.mixer2_gated_rms_norm) as calls:
        got = op.forward_kernel(x, gate)
    assert calls, "forward_kernel did not reach the Triton launcher"
    assert_close(got, norm_reference(op, x, gate), dtype)  # x's dtype bounds it (see tests/ops/test_mamba.py)


# ---- the launchers directly, against the spec in float64 ------------------------------------------


def _rand(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _poisoned_slots(cache: torch.Tensor, *slots: int) -> torch.Tensor:
    for slot in slots:
        cache[slot] = float("nan")
    return cache


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_conv_launchers(K, poison_empty):
    """Requests of 1, K - 2, 0 and 9 tokens plus a padding one; x a column slice of a wider
    buffer (as the mixers pass it); a conv window wider than K - 1 whose extra column must stay;
    the null slot and the padding's NaN never reach an output or change."""
    gen = torch.Generator().manual_seed(K)
    C, lens = 37, [1, max(K - 2, 1), 0, 9, 3]
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    T = int(qsl[-1])
    x = _rand(T, C + 5, gen=gen)[:, 2:2 + C]
    weight, bias = _rand(C, K, gen=gen), _rand(C, gen=gen)
    cache = _poisoned_slots(_rand(6, K, C, gen=gen), 0).transpose(1, 2)  # (slots, C, K): one extra column
    slots, init = torch.tensor([3, 1, 2, 5, spec.PAD_SLOT_ID]), torch.tensor([True, False, True, True, True])
    want_cache = cache.double()
    want = oracle(spec.causal_conv1d_varlen, x, weight, bias, want_cache, qsl, slots, init, True)
    got = mamba_conv.causal_conv1d_fn(x, weight, bias, cache, qsl, slots, init, True, 0)
    assert_close(got, want, torch.float32)
    assert_close(cache, want_cache, torch.float32)  # (NaN == NaN there: slot 0 untouched)
    assert cache[0].isnan().all() and not got.isnan().any()

    decode_slots = torch.tensor([4, 0, 1, spec.PAD_SLOT_ID])
    xd = _rand(4, C, gen=gen)
    want_d = oracle(spec.causal_conv1d_update, xd, want_cache, weight, None, decode_slots, False)
    got_d = mamba_conv.causal_conv1d_update(xd, cache, weight, None, decode_slots, False, 0)
    assert_close(got_d, want_d, torch.float32)
    assert_close(cache, want_cache, torch.float32)
    assert cache[0].isnan().all() and not got_d.isnan().any()


def test_selective_scan_launchers_mamba1_form(poison_empty):
    """Mamba-1's one-head form (D channels, z gate): varlen prefill, then a decode step with a
    padding row on the NaN null slot."""
    gen = torch.Generator().manual_seed(0)
    D_, N, lens = 40, 16, [5, 0, 1, 12]
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    T = int(qsl[-1])
    x, dt, z = (_rand(T, 1, D_, gen=gen) for _ in range(3))
    A, D, bias = -(0.5 + torch.rand(1, D_, N, generator=gen)), _rand(1, D_, gen=gen), _rand(1, D_, gen=gen)
    B, C = _rand(T, 1, N, gen=gen), _rand(T, 1, N, gen=gen)
    states = _poisoned_slots(_rand(6, 1, D_, N, gen=gen), 0)
    slots, init = torch.tensor([2, 3, 4, 1]), torch.tensor([True, True, False, True])
    want_states = states.double()
    want = oracle(spec.selective_scan_varlen, x, dt, A, B, C, D, z, bias, want_states, qsl, slots, init, True)
    got = mamba_scan.selective_scan(x, dt, A, B, C, D, z, bias, states, qsl, slots, init, True, 0)
    assert_close(got, want, torch.float32)
    assert_close(states, want_states, torch.float32)
    dslots = torch.tensor([1, 0, 4])
    args = (_rand(3, 1, D_, gen=gen), _rand(3, 1, D_, gen=gen), A, _rand(3, 1, N, gen=gen), _rand(3, 1, N, gen=gen), D,
            _rand(3, 1, D_, gen=gen), bias)
    want = oracle(spec.selective_state_update, want_states, *args, dslots, True)
    got = mamba_scan.selective_state_update(states, *args, dslots, True, 0)
    assert_close(got, want, torch.float32)
    assert_close(states, want_states, torch.float32)
    assert states[0].isnan().all() and not got.isnan().any()


_DC = mamba_scan.DecodeConfig
DECODE_CONFIGS = [  # every knob of the decode launch, on and off
    _DC(), _DC(4, 2, per_head=True, unmasked=True, offsets32=True, evict_first=True),
    _DC(2, 1, 2, per_head=True, unmasked=True), _DC(8, 4, 4, offsets32=True), _DC(1, 1, evict_first=True),
    _DC(4, 4, 2, unmasked=True), _DC(2, 2, per_head=True, unmasked=True, offsets32=True, state_major=True),
    _DC(4, 1, 2, state_major=True)]


@pytest.mark.parametrize("cfg", DECODE_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("P,N,softplus,bias,with_d", [(8, 16, True, True, True), (6, 12, False, False, False),
                                                       (8, 16, False, True, False)],
                         ids=["even", "masked-nobias", "even-nosoftplus"])
def test_decode_configs_mamba2_form(cfg, P, N, softplus, bias, with_d, poison_empty):
    """The decode kernel at each config (rows per program, warps, d_state tiles, per-head
    scalars, unmasked tiles, 32-bit offsets, evict-first) against the spec in float64: 5 requests
    (one padding, one on the NaN null slot) of 3 heads in 1 group, Mamba-2's head form (per-head
    dt, A, D, dt_bias expanded with stride 0); head_dim 8 / d_state 16 (the unmasked path where
    block_p divides 8) and 6 / 12 (masked)."""
    gen = torch.Generator().manual_seed(P * N)
    Bt, H, G = 5, 3, 1
    x, dt = _rand(Bt, H, P, gen=gen), _rand(Bt, H, gen=gen)
    B, C = _rand(Bt, G, N, gen=gen), _rand(Bt, G, N, gen=gen)
    A, D, b = -(0.5 + torch.rand(H, generator=gen)), _rand(H, gen=gen), _rand(H, gen=gen)
    dt4, A4, D4, b4 = spec.ssd_head_form(dt, A, D if with_d else None, b if bias else None, P, N)
    states = _poisoned_slots(_rand(7, H, P, N, gen=gen), 0)
    slots = torch.tensor([3, spec.PAD_SLOT_ID, 6, 0, 1])
    want_states = states.double()
    want = oracle(spec.selective_state_update, want_states, x, dt4, A4, B, C, D4, None, b4, slots, softplus)
    meta = mamba_scan.decode_meta(cfg, P, N, per_head_layout=True, offsets_fit_32=True)
    assert meta["EVEN"] == (cfg.unmasked and P == 8) and meta["PER_HEAD"] == cfg.per_head
    assert meta["OFF64"] == (not cfg.offsets32) and meta["N_TILES"] * meta["BLOCK_N"] == 16
    with mamba_scan.override_decode_config(cfg):
        got = mamba_scan.selective_state_update(states, x, dt4, A4, B, C, D4, None, b4, slots, softplus, 0)
    assert_close(got, want, torch.float32)
    assert_close(states, want_states, torch.float32)
    assert states[0].isnan().all() and not got.isnan().any()


@pytest.mark.parametrize("cfg", [_DC(8, 2, 2, per_head=True, unmasked=True, offsets32=True),
                                 _DC(4, 1, unmasked=True)], ids=lambda c: c.label().replace(" ", "-"))
def test_decode_configs_mamba1_form(cfg, poison_empty):
    """Per-channel A, dt, D (Mamba-1): ``per_head`` must not engage; the z gate; 40 channels
    (unmasked where block_p divides 40); bf16 activations and an fp32 cache."""
    gen = torch.Generator().manual_seed(1)
    Bt, D_, N = 3, 40, 16
    x, dt, z = (_rand(Bt, 1, D_, gen=gen).bfloat16() for _ in range(3))
    A, D, bias = -(0.5 + torch.rand(1, D_, N, generator=gen)), _rand(1, D_, gen=gen), _rand(1, D_, gen=gen)
    B, C = _rand(Bt, 1, N, gen=gen).bfloat16(), _rand(Bt, 1, N, gen=gen).bfloat16()
    states = _poisoned_slots(_rand(4, 1, D_, N, gen=gen), 0)
    slots = torch.tensor([2, 0, 3])
    want_states = states.double()
    want = oracle(spec.selective_state_update, want_states, x, dt, A, B, C, D, z, bias, slots, True)
    assert not mamba_scan.decode_meta(cfg, D_, N, per_head_layout=False, offsets_fit_32=True)["PER_HEAD"]
    with mamba_scan.override_decode_config(cfg):
        got = mamba_scan.selective_state_update(states, x, dt, A, B, C, D, z, bias, slots, True, 0)
    assert_close(got, want, torch.bfloat16)
    assert_close(states, want_states, torch.float32)
    assert states[0].isnan().all()


def test_decode_config_default_and_override():
    """The default is the H200 sweep's pick (1K-value tiles, 4 warps, every code variant on); the
    override nests and unwinds; 32-bit offsets only when they fit; bad values are refused."""
    on = dict(per_head=True, unmasked=True, offsets32=True, evict_first=True)
    assert mamba_scan.decode_config(64, 128) == _DC(8, 4, **on)
    assert mamba_scan.decode_config(40, 16) == _DC(64, 4, **on)
    assert mamba_scan.decode_config(64, 128, batch=15) == _DC(8, 4, **on)
    assert mamba_scan.decode_config(64, 128, batch=16) == _DC(8, 4, **on, state_major=True)
    with mamba_scan.override_decode_config(_DC(2, 1)):
        with mamba_scan.override_decode_config(_DC(4, 2)):
            assert mamba_scan.decode_config(64, 128) == _DC(4, 2)
        assert mamba_scan.decode_config(64, 128) == _DC(2, 1)
    assert mamba_scan.decode_config(64, 128) == _DC(8, 4, **on)
    assert mamba_scan.decode_meta(_DC(offsets32=True), 64, 128, True, offsets_fit_32=False)["OFF64"]
    assert mamba_scan.decode_meta(_DC(128, n_tiles=256), 64, 100, True, True) == dict(
        BLOCK_P=64, BLOCK_N=1, N_TILES=128, PER_HEAD=False, EVEN=False, OFF64=True, EVICT="", STATE_MAJOR=False)
    for bad in (dict(block_p=3), dict(n_tiles=0), dict(num_warps=3)):
        with pytest.raises(ValueError):
            _DC(**bad)


@pytest.mark.parametrize("chunk", [2, 8])
def test_ssd_chunk_scan_launcher_against_the_recurrence(chunk, poison_empty):
    """The chunked kernels against the spec's recurrence in float64: lengths 1, chunk - 1, chunk,
    chunk + 1, 3 chunks + 1 and 0; 2 groups of 3 heads; some requests from the cache; a padding
    request on slot -1; the null slot NaN."""
    gen = torch.Generator().manual_seed(chunk)
    lens = [1, max(chunk - 1, 1), chunk, chunk + 1, 3 * chunk + 1, 0, 2]
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    T, H, P, N, G = int(qsl[-1]), 6, 5, 12, 2
    x, dt, B, C = _rand(T, H, P, gen=gen), _rand(T, H, gen=gen), _rand(T, G, N, gen=gen), _rand(T, G, N, gen=gen)
    A, D, bias = -(0.5 + torch.rand(H, generator=gen)), _rand(H, gen=gen), _rand(H, gen=gen)
    states = _poisoned_slots(_rand(9, H, P, N, gen=gen), 0)
    slots = torch.tensor([1, 2, 3, 4, 5, 6, spec.PAD_SLOT_ID])
    init = torch.tensor([True, False, True, True, False, True, True])
    want_states = states.double()
    want = oracle(spec.ssd_recurrent, x, dt, A, B, C, D, bias, want_states, qsl, slots, init)
    got = mamba_ssd.ssd_chunk_scan(x, dt, A, B, C, D, bias, states, qsl, slots, init, chunk, True, 0)
    scale = float(want.abs().max())
    assert_close(got, want, torch.float32, atol=2e-5 * scale, rtol=2e-5)
    assert_close(states, want_states, torch.float32, atol=2e-5 * float(want_states[1:].abs().max()), rtol=2e-5)
    assert states[0].isnan().all() and not got.isnan().any()


def test_norm_launcher_looped_groups(monkeypatch, poison_empty):
    """Groups wider than the widest tile take the two-pass variant."""
    monkeypatch.setattr(mamba_norm, "MAX_TILE", 32)
    gen = torch.Generator().manual_seed(0)
    x, gate, w = _rand(5, 200, gen=gen), _rand(5, 200, gen=gen), _rand(200, gen=gen)
    for weight in (w, None):
        want = oracle(spec.mixer2_gated_rms_norm, x, gate, weight, 1e-5, 100)
        assert_close(mamba_norm.mixer2_gated_rms_norm(x, gate, weight, 1e-5, 100), want, torch.float32)


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_opcheck_with_the_triton_kernel(name):
    """The Triton launcher as the op's CPU kernel passes opcheck's schema test (it writes exactly
    the inputs the schema declares mutable) and its fake-tensor test (its outputs' shapes, dtypes
    and strides are the fake's). The other opcheck tests exercise the op, not the kernel: they run
    on the reference bodies in tests/ops/test_mamba_state.py."""
    from tests.ops.test_mamba_state import SAMPLES

    args = dict(SAMPLES)[name]
    with as_cpu_kernel(name, LAUNCHERS[name]) as calls:
        torch.library.opcheck(getattr(torch.ops.customop, name).default, args,
                              test_utils=("test_schema", "test_faketensor"))
    assert calls


# ---- compiled for the GPUs (no GPU needed) --------------------------------------------------------
# The interpreter accepts programs the GPU compiler rejects and says nothing of registers; this
# compiles every kernel at the configurations the launchers pick for the real shapes, for the
# H200 (sm_90: no register spills) and MI300 (gfx942), in a subprocess with TRITON_INTERPRET=0.


#: the strides the GPU JIT specialises to 1 (Triton makes integer arguments equal to 1 constants)
#: in the decode kernel's Mamba-2 launch: contiguous x, B, C and state rows
_DECODE_UNIT_STRIDES = ("sx_p", "sb_n", "sc_n", "ss_n", "sdt_h", "sa_h", "sd_h", "sbias_h")
#: what the JIT also knows of that launch: 16-byte aligned pointers, strides that are multiples of 16
_DECODE_ALIGNED = ("x_ptr", "dt_ptr", "a_ptr", "b_ptr", "c_ptr", "d_ptr", "z_ptr", "bias_ptr", "state_ptr", "out_ptr",
                   "slot_ptr", "head_dim", "state_size", "heads_per_group", "sx_t", "sx_h", "sdt_t", "sdt_p", "sa_p",
                   "sa_n", "sb_t", "sb_g", "sc_t", "sc_g", "sd_p", "sbias_p", "ss_s", "ss_h", "ss_p", "so_t", "so_h")


def _decode_aot_configs():
    """(label, DecodeConfig, N, mamba-2 layout): the default at Mamba-1's N = 16 (one head of 40
    channels, z gate) and every sweep candidate at Mamba-2's 64 x 128."""
    yield "mamba-1 N=16 default", mamba_scan.decode_config(40, 16), 16, False
    for cfg in mamba_scan.decode_candidates():
        yield f"mamba-2 N=128 {cfg.label()}", cfg, 128, True


def _decode_constexprs(cfg, N, head_dim, per_head_layout, has_z):
    const = dict(HAS_D=True, HAS_Z=has_z, HAS_BIAS=True, SOFTPLUS=True,
                 **mamba_scan.decode_meta(cfg, head_dim, N, per_head_layout, offsets_fit_32=True))
    if per_head_layout:
        const.update(dict.fromkeys(_DECODE_UNIT_STRIDES, 1))
    return const


def _aot_cases(P="*bf16", S="*fp32"):
    """(label, kernel, {pointer arg: type}, constexprs, warps); other arguments are i32."""
    i32, i8, f32 = "*i32", "*i8", "*fp32"
    dot = mamba_ssd.dot_mode(torch.float32 if P == "*fp32" else torch.bfloat16)
    conv = {"x_ptr": P, "w_ptr": P, "b_ptr": P, "out_ptr": P, "state_ptr": P, "qsl_ptr": i32, "slot_ptr": i32,
            "init_ptr": i8, "seq_ptr": i32}
    for K in (2, 4):
        yield (f"conv fwd K={K}", mamba_conv._conv_fwd_kernel, conv,
               dict(K=K, HAS_BIAS=True, SILU=True, BLOCK_T=mamba_conv.BLOCK_T, BLOCK_C=128), 8)
        yield f"conv state K={K}", mamba_conv._conv_state_kernel, conv, dict(K=K, BLOCK_C=128), 4
        yield f"conv update K={K}", mamba_conv._conv_update_kernel, conv, dict(K=K, HAS_BIAS=True, SILU=True,
                                                                               BLOCK_C=128), 4
    scan = {"x_ptr": P, "dt_ptr": P, "a_ptr": f32, "b_ptr": P, "c_ptr": P, "d_ptr": P, "z_ptr": P, "bias_ptr": P,
            "state_ptr": S, "out_ptr": P, "qsl_ptr": i32, "slot_ptr": i32, "init_ptr": i8}
    flags = dict(HAS_D=True, HAS_BIAS=True, SOFTPLUS=True)
    yield "scan mamba-2 N=128", mamba_scan._scan_kernel, scan, dict(flags, HAS_Z=False, BLOCK_P=16, BLOCK_N=128), 4
    yield "scan mamba-1 N=16", mamba_scan._scan_kernel, scan, dict(flags, HAS_Z=True, BLOCK_P=64, BLOCK_N=16), 4
    for label, cfg, N, mamba2 in _decode_aot_configs():
        yield (f"decode {label}", mamba_scan._decode_kernel, scan,
               _decode_constexprs(cfg, N, head_dim=64 if mamba2 else 40, per_head_layout=mamba2, has_z=not mamba2),
               cfg.num_warps)
    ssd = {"x_ptr": P, "dt_ptr": P, "bias_ptr": P, "a_ptr": f32, "b_ptr": P, "c_ptr": P, "d_ptr": P, "out_ptr": P,
           "delta_ptr": f32, "acum_ptr": f32, "states_ptr": f32, "h_in_ptr": f32 if P == "*fp32" else P,
           "cache_ptr": S, "cstart_ptr": i32, "cend_ptr": i32, "first_ptr": i32, "count_ptr": i32, "slot_ptr": i32, "init_ptr": i8, "cb_ptr": f32}
    yield "ssd cumsum 256", mamba_ssd._cumsum_kernel, ssd, dict(HAS_BIAS=True, SOFTPLUS=True, CHUNK=256,
                                                                  BLOCK_H=16), 4
    cfg = mamba_ssd.SSDConfig()
    yield ("ssd chunk state N=128", mamba_ssd._chunk_state_kernel, ssd,
           dict(BLOCK_P=cfg.state_p, BLOCK_N=128, BLOCK_L=cfg.state_l, DOT=dot, STAGES=cfg.stages), cfg.state_warps)
    yield "ssd state passing", mamba_ssd._state_passing_kernel, ssd, dict(BLOCK=cfg.pass_block), 4
    yield ("ssd C B^T", mamba_ssd._chunk_cb_kernel, ssd, dict(BLOCK_M=cfg.cb_m, BLOCK_K=cfg.cb_k, DOT=dot,
                                                              STAGES=cfg.stages), cfg.cb_warps)
    yield ("ssd chunk scan N=128", mamba_ssd._chunk_scan_kernel, ssd,
           dict(HAS_D=True, BLOCK_M=cfg.scan_m, BLOCK_P=cfg.scan_p, BLOCK_DS=cfg.scan_ds, BLOCK_K=cfg.scan_k, DOT=dot,
                STAGES=cfg.scan_stages), cfg.scan_warps)
    norm = {"x_ptr": P, "gate_ptr": P, "w_ptr": P, "out_ptr": P, "eps": "fp32"}
    yield "norm 4 x 1024", mamba_norm._mixer2_norm_kernel, norm, dict(HAS_WEIGHT=True, BLOCK_M=4, BLOCK_N=1024,
                                                                       SINGLE_TILE=True), 8
    yield "norm looped", mamba_norm._mixer2_norm_kernel, norm, dict(HAS_WEIGHT=True, BLOCK_M=1, BLOCK_N=8192,
                                                                     SINGLE_TILE=False), 8


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_kernels_compile_for_the_gpus(target):
    # the chunk scan's default (64 x 32 tiles, d_state in steps of 64, one stage) spills ~600
    # bytes on sm_90 and was still the H200 sweep's fastest: 258.8 us against 287.9 for the
    # spill-free 32-wide d_state steps (Mamba-2 2.7B, 4096 tokens; mamba_ssd.SSDConfig)
    aot_subprocess.assert_compiles_for("tests.backends.triton.test_mamba_triton", target, len(list(_aot_cases())),
                                       spill_ok={"ssd chunk scan N=128": 1024})


def decode_registers(target: str = "cuda:90") -> str:
    """A table of the decode candidates compiled as the GPU JIT sees Mamba-2-2.7B's launch
    (unit strides constant, aligned pointers and strides): registers, spills, 16-byte accesses.
    ``TRITON_INTERPRET=0 python -m tests.backends.triton.test_mamba_triton --decode-registers``."""
    rows = ["config                     regs  spill  ld(v4)  st(v4)"]
    for label, cfg, N, mamba2 in _decode_aot_configs():
        if not mamba2:
            continue
        types = {"x_ptr": "*bf16", "dt_ptr": "*bf16", "a_ptr": "*fp32", "b_ptr": "*bf16", "c_ptr": "*bf16",
                 "d_ptr": "*bf16", "z_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*fp32", "out_ptr": "*bf16",
                 "slot_ptr": "*i32"}
        case = [(label, mamba_scan._decode_kernel, types,
                 _decode_constexprs(cfg, N, head_dim=64, per_head_layout=True, has_z=False), cfg.num_warps)]
        info = aot_subprocess.report(case, target, _DECODE_ALIGNED)[label]
        if "error" in info:
            rows.append(f"{cfg.label():26s} {info['error'][:100]}")
            continue
        rows.append(f"{cfg.label():26s} {info['regs']:4d}  {info['spill_bytes'] or 0:5d}  {info['ld']:3d}({info['ld_v4']:2d})"
                    f"  {info['st']:3d}({info['st_v4']:2d})")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    if "--decode-registers" in sys.argv:
        print(decode_registers())
    else:
        aot_subprocess.main(_aot_cases())
