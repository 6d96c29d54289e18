"""get_rope's rope types (``customop/samples/rotary.py``, ``ROPE_TYPES``) on every path this tier
has: forward_native and forward_cpu in every dtype, forward_kernel (the library op's reference)
and forward_cuda on a forced CUDA platform, the Triton kernel under the interpreter; each against
the float64 rotation by the op's cache rows (``tests/cases/rotary.py``; the caches themselves are
checked against vLLM 0.33's formulas in test_rope_scaling.py). Also: vLLM 0.33's forward
signatures and their ``offsets``, Llama 4's vision rotation, and empty batches on every path."""

from __future__ import annotations

import inspect

import pytest
import torch

import customop
from customop.ops.rotary_embedding import (
    ApplyRotaryEmb, BailingMRotaryEmbedding, DeepseekScalingRotaryEmbedding, DeepseekV4ScalingRotaryEmbedding,
    DualChunkRotaryEmbedding, FourierRotaryEmbedding,
    DynamicNTKAlphaRotaryEmbedding, DynamicNTKScalingRotaryEmbedding, Gemma4RotaryEmbedding,
    LinearScalingRotaryEmbedding, Llama3RotaryEmbedding, Llama4VisionRotaryEmbedding, MRotaryEmbedding,
    MRotaryEmbeddingInterleaved, NTKScalingRotaryEmbedding, Phi3LongRoPEScaledRotaryEmbedding, RotaryEmbedding,
    YaRNScalingRotaryEmbedding, get_rope)
from customop.samples.rotary import DTYPES, ROPE_TYPES
from customop.testing import forced_platform, randn
from tests.cases.rotary import assert_rotated, inv_freq64, rope_reference
from tests.ops.rope_helpers import _compile_off_and_fresh_rope_cache  # noqa: F401  (autouse fixture)
from tests.ops.rope_helpers import BASE, D, build, dtype_id

KERNEL_CONFIG = customop.Config(custom_ops=["all,+rotary_embedding"])


def inputs(case, dtype, tokens=7, heads=3, kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, case.positions, (tokens,), generator=gen)
    q = randn(tokens, heads * case.head_size, dtype=dtype, generator=gen)
    k = randn(tokens, kv_heads * case.head_size, dtype=dtype, generator=gen)
    return positions, q, k


def cache_rows(op, positions, offsets=None):
    """The cache row of each token, written from vLLM 0.33's forwards (not from the op's code)."""
    rows = positions + (offsets if offsets is not None else 0)
    if isinstance(op, Phi3LongRoPEScaledRotaryEmbedding) and op.use_long_rope:
        rows = rows + op.original_max_position_embeddings
    return rows


def check(op, rows, q, k, out_q, out_k, products_rounded=True):
    """out_q/out_k against the float64 rotation by ``op``'s cache rows ``rows``, rounded to the
    query's dtype first (as the paths cast the cache)."""
    cos, sin = op.cos_sin_cache.to(q.dtype).double()[rows].chunk(2, dim=-1)
    for name, x, got in (("query", q, out_q), ("key", k, out_k)):
        if x is None:
            assert got is None
            continue
        want, mag = rope_reference(x, cos, sin, op.head_size, op.is_neox_style)
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert_rotated(got, want, mag, x.dtype, what=name, products_rounded=products_rounded)


# ---- every row, native and the CPU path, every dtype --------------------------------------------


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ROPE_TYPES, ids=lambda c: c.label)
def test_rope_type_eager(case, dtype, path):
    with customop.use_config(customop.Config(custom_ops=["all"])):
        op = case.build(dtype)
    positions, q, k = inputs(case, dtype)
    q0, k0 = q.clone(), k.clone()
    out_q, out_k = getattr(op, path)(positions, q, k)
    check(op, cache_rows(op, positions), q0, k0, out_q, out_k)
    assert torch.equal(q, q0) and torch.equal(k, k0), f"{path} must not modify its inputs"


@pytest.mark.parametrize("case", ROPE_TYPES, ids=lambda c: c.label)
def test_rope_type_kernel_path(case):
    """forward_cuda on a forced CUDA platform: the library op (its reference on CPU tensors), in
    place, the same bits as forward_native."""
    with forced_platform("cuda"), customop.use_config(KERNEL_CONFIG):
        op = case.build(torch.bfloat16)
        assert op.forward_method_name == "forward_cuda"
        positions, q, k = inputs(case, torch.bfloat16, seed=1)
        q0, k0 = q.clone(), k.clone()
        out_q, out_k = op(positions, q, k)
    assert out_q is q and out_k is k
    native_q, native_k = op.forward_native(positions, q0, k0)
    assert torch.equal(out_q, native_q) and torch.equal(out_k, native_k)
    check(op, cache_rows(op, positions), q0, k0, out_q, out_k)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", ROPE_TYPES, ids=lambda c: c.label)
def test_rope_type_triton_interpreter(case, dtype):
    """The Triton kernel (launched by forward_kernel as the op's CPU kernel): in place, from the
    type's cache; the kernel rotates in fp32 and rounds once."""
    from customop.backends.triton import rotary
    from tests.backends.triton.conftest import as_cpu_kernel

    op = case.build(dtype)
    positions, q, k = inputs(case, dtype, tokens=5, heads=2, kv_heads=1, seed=2)
    q0, k0 = q.clone(), k.clone()
    with as_cpu_kernel("rotary_embedding", rotary.rotary_embedding) as calls:
        out_q, out_k = op.forward_kernel(positions, q, k)
    assert len(calls) == 1 and out_q is q and out_k is k
    check(op, cache_rows(op, positions), q0, k0, out_q, out_k, products_rounded=False)


# ---- vLLM 0.33's forward signatures ---------------------------------------------------------------

BASE_FORM = ("positions", "query", "key")
FORMS = {
    RotaryEmbedding: BASE_FORM, LinearScalingRotaryEmbedding: BASE_FORM, DynamicNTKScalingRotaryEmbedding: BASE_FORM,
    DynamicNTKAlphaRotaryEmbedding: BASE_FORM, NTKScalingRotaryEmbedding: BASE_FORM,
    YaRNScalingRotaryEmbedding: BASE_FORM, Llama3RotaryEmbedding: BASE_FORM, Gemma4RotaryEmbedding: BASE_FORM,
    DeepseekScalingRotaryEmbedding: BASE_FORM + ("offsets",),
    Phi3LongRoPEScaledRotaryEmbedding: BASE_FORM + ("offsets",),
    MRotaryEmbedding: BASE_FORM + ("offsets",), BailingMRotaryEmbedding: BASE_FORM + ("offsets",),
    DualChunkRotaryEmbedding: BASE_FORM + ("offsets",), MRotaryEmbeddingInterleaved: BASE_FORM,
    Llama4VisionRotaryEmbedding: ("query", "key"), ApplyRotaryEmb: ("x", "cos", "sin"),
    DeepseekV4ScalingRotaryEmbedding: BASE_FORM + ("offsets", "inverse"),
    FourierRotaryEmbedding: BASE_FORM + ("offsets",),
}
PATHS = ("forward_native", "forward_cpu", "forward_cuda", "forward_hip", "forward_xpu", "forward_tpu")


@pytest.mark.parametrize("cls", list(FORMS), ids=lambda c: c.__name__)
def test_forward_signatures(cls):
    from customop.custom_op import CustomOp

    for path in PATHS:
        if getattr(cls, path) is getattr(CustomOp, path):
            continue  # CustomOp's pass-through (forward_hip -> forward_cuda)
        params = tuple(inspect.signature(getattr(cls, path)).parameters)[1:]
        assert params == FORMS[cls], f"{cls.__name__}.{path}{params}"


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_deepseek_offsets(platform):
    """forward(positions, query, key, offsets): rows positions + offsets, on every path."""
    with forced_platform(platform), customop.use_config(KERNEL_CONFIG):
        op = DeepseekScalingRotaryEmbedding(D, 32, 128, BASE, False, 4.0, torch.float32, mscale=0.707,
                                            mscale_all_dim=1.0)
        positions, q, k = inputs(ROPE_TYPES[0], torch.float32, seed=3)
        offsets = torch.arange(7) * 20
        q0, k0 = q.clone(), k.clone()
        out = op(positions, q, k, offsets)
        check(op, positions + offsets, q0, k0, *out)
        keyword = op(positions=positions, query=q0.clone(), key=k0.clone(), offsets=offsets)
        assert torch.equal(keyword[0], out[0]) and torch.equal(keyword[1], out[1])
        none = op(positions + offsets, q0.clone(), None)
        assert none[1] is None and torch.equal(none[0], out[0])


def test_longrope_offsets_and_short_switch():
    short_factor, long_factor = [1.0 + 0.05 * i for i in range(32)], [1.0 + 0.9 * i for i in range(32)]
    long = Phi3LongRoPEScaledRotaryEmbedding(D, D, 256, 64, BASE, True, torch.float32, short_factor, long_factor)
    short = Phi3LongRoPEScaledRotaryEmbedding(D, D, 256, 64, BASE, True, torch.float32, short_factor, long_factor,
                                              max_model_len=64)
    assert long.use_long_rope and not short.use_long_rope
    positions, q, k = inputs(ROPE_TYPES[0], torch.float32, seed=4)
    positions = positions % 60
    offsets = torch.full((7,), 3)
    for op in (long, short):
        check(op, cache_rows(op, positions, offsets), q, k, *op(positions, q, k, offsets))
    with pytest.raises(ValueError, match="only NeoX"):
        Phi3LongRoPEScaledRotaryEmbedding(D, D, 256, 64, BASE, False, torch.float32, short_factor, long_factor)
    with pytest.raises(IndexError, match="positions must be in \\[0, 320\\)"):
        long(torch.full((7,), 300), q, k)  # 300 + 64 is past the stacked cache


def test_mrope_accepts_and_ignores_offsets():
    op = build(MRotaryEmbedding, D, D, 64, BASE, True, torch.float32, [8, 12, 12])
    positions = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(5))
    q, k = randn(4, 2 * D), randn(4, D)
    with_offsets = op(positions, q, k, torch.full((4,), 9))
    plain = op(positions, q, k)
    assert torch.equal(with_offsets[0], plain[0]) and torch.equal(with_offsets[1], plain[1])
    bailing = build(BailingMRotaryEmbedding, D, D, 64, BASE, False, torch.float32, [8, 12, 12])
    with pytest.raises(ValueError, match="BailingMRotaryEmbedding: key is required"):
        bailing(positions, q, None)
    with pytest.raises(TypeError, match="BailingMRotaryEmbedding: positions must be int32 or int64"):
        bailing(positions.short(), q, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_llama4_vision_rotation(dtype):
    """forward(query, key): lane pairs (2j, 2j+1) as complex numbers times the patch's row, fp32."""
    patches, rd, heads = 16, 16, 3
    rope = get_rope(2 * rd, patches, False, {"rope_type": "mllama4", "partial_rotary_factor": 0.5}, torch.complex64)
    assert type(rope) is Llama4VisionRotaryEmbedding
    gen = torch.Generator().manual_seed(6)
    q = randn(2, patches + 1, heads, 2 * rd, dtype=dtype, generator=gen)
    k = randn(2, patches + 1, 1, 2 * rd, dtype=dtype, generator=gen)
    p = torch.arange(patches)
    f = inv_freq64(BASE, rd)
    angles = torch.cat(((p % 4 + 1).double()[:, None] * f, (p // 4 + 1).double()[:, None] * f), -1)
    angles = torch.cat((angles, torch.zeros(1, rd, dtype=torch.float64)))  # CLS: identity
    got_q, got_k = rope(q, k)
    with forced_platform("cuda"), customop.use_config(KERNEL_CONFIG):
        assert torch.equal(rope.forward_cuda(q, k)[0], got_q)
    for x, got in ((q, got_q), (k, got_k)):
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], rd, 2).contiguous())
        want = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]).flatten(3)
        mag = x.double().reshape(*x.shape[:-1], rd, 2).abs().sum(-1, keepdim=True).expand(-1, -1, -1, -1, 2).flatten(3)
        assert got.dtype == dtype and got.shape == x.shape
        # computed in fp32 and rounded once to the dtype
        assert_rotated(got, want, mag, dtype, extra=4 * torch.finfo(torch.float32).eps, products_rounded=False)
    with pytest.raises(ValueError, match="Llama4VisionRotaryEmbedding: query must be"):
        rope(q[:, :-1], k[:, :-1])


# ---- empty batches (issue 16): empty outputs of the right shapes on every path ---------------------

EMPTY_OPS = {
    "default": lambda: RotaryEmbedding(D, 48, 64, BASE, True, torch.float32),
    "deepseek_yarn": lambda: DeepseekScalingRotaryEmbedding(D, D, 64, BASE, False, 2.0, torch.float32),
    "longrope": lambda: Phi3LongRoPEScaledRotaryEmbedding(D, D, 128, 64, BASE, True, torch.float32, [1.0] * 32,
                                                          [2.0] * 32),
    "proportional": lambda: Gemma4RotaryEmbedding(D, 32, 64, BASE, True, torch.float32),
    "mrope": lambda: MRotaryEmbedding(D, D, 64, BASE, True, torch.float32, [8, 12, 12]),
    "dual_chunk": lambda: DualChunkRotaryEmbedding(D, D, 64, BASE, True, torch.float32, 16, 4),
}


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(EMPTY_OPS))
def test_empty_batch(name, platform):
    config = customop.Config(custom_ops=["all,+rotary_embedding,+apply_rotary_emb,+dual_chunk_rotary_embedding"])
    with forced_platform(platform), customop.use_config(config):
        op = EMPTY_OPS[name]()
        q, k = torch.empty(0, 3 * D), torch.empty(0, D)
        positions = torch.empty((3, 0) if name == "mrope" else (0,), dtype=torch.long)
        wide = 5 if name == "dual_chunk" else 1
        paths = ["__call__", "forward_native", "forward_cpu"]
        if hasattr(op, "forward_kernel"):
            paths.append("forward_kernel")
        for path in paths:
            out_q, out_k = getattr(op, path)(positions, q, k)
            assert out_q.shape == (0, 3 * D * wide) and out_k.shape == (0, D), path
            if name != "dual_chunk":
                assert op.forward_native(positions, q, None)[1] is None
        x = torch.empty(2, 0, 3, D)
        apply = ApplyRotaryEmb()
        for path in ("__call__", "forward_native", "forward_cpu", "forward_kernel"):
            assert getattr(apply, path)(x, torch.empty(0, 16), torch.empty(0, 16)).shape == x.shape


@pytest.mark.interpret
def test_empty_batch_triton_interpreter():
    from customop.backends.triton import rotary
    from tests.backends.triton.conftest import as_cpu_kernel

    op = RotaryEmbedding(D, D, 64, BASE, True, torch.bfloat16)
    q, k = torch.empty(0, 2 * D, dtype=torch.bfloat16), torch.empty(0, D, dtype=torch.bfloat16)
    with as_cpu_kernel("rotary_embedding", rotary.rotary_embedding) as calls:
        out_q, out_k = op.forward_kernel(torch.empty(0, dtype=torch.long), q, k)
        apply = ApplyRotaryEmb().forward_kernel(torch.empty(0, 2, D), torch.empty(0, 32), torch.empty(0, 32))
    assert len(calls) == 2 and out_q is q and out_k is k and apply.shape == (0, 2, D)


# ---- DeepSeek-V4 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_deepseek_v4(dtype, is_neox):
    """The last rotary_dim lanes rotate, in fp32 from an fp32 cache, cast back once; offsets;
    ``inverse`` undoes the rotation; key optional; the head size is the query's last dim."""
    params = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
              "mscale_all_dim": 1.0, "is_deepseek_v4": True, "rope_dim": 16}
    with forced_platform("cuda"), customop.use_config(KERNEL_CONFIG):
        op = get_rope(D, 256, is_neox, params, dtype)
    assert type(op) is DeepseekV4ScalingRotaryEmbedding and op.cos_sin_cache.dtype == torch.float32
    assert op.cos_sin_cache.shape == (256, 16)
    gen = torch.Generator().manual_seed(7)
    positions, offsets = torch.randint(0, 200, (5,), generator=gen), torch.full((5,), 50)
    q, k = randn(5, 3, D, dtype=dtype, generator=gen), randn(5, 1, 32, dtype=dtype, generator=gen)
    out_q, out_k = op(positions, q, k, offsets)
    cos, sin = op.cos_sin_cache.double()[positions + offsets].chunk(2, dim=-1)
    for x, got in ((q, out_q), (k, out_k)):
        head = x.shape[-1]
        assert torch.equal(got[..., : head - 16], x[..., : head - 16])  # the leading lanes pass through
        want, mag = rope_reference(x[..., head - 16:].reshape(5, -1), cos, sin, 16, is_neox)
        assert_rotated(got[..., head - 16:].reshape(5, -1), want, mag, dtype, products_rounded=False)
    only_q, none = op(positions, q, None, offsets, inverse=False)
    assert none is None and torch.equal(only_q, out_q)
    back, _ = op.forward_native(positions + offsets, out_q.float(), None, inverse=True)
    m2 = torch.ones(D, dtype=torch.float64)
    m2[D - 16:] = op.mscale ** 2  # the rotated lanes carry the magnitude twice
    assert torch.allclose(back.double(), q.double() * m2, atol=8 * torch.finfo(dtype).eps, rtol=0)


# ---- FoPE --------------------------------------------------------------------------------------------

FOPE = {"use_fope": True, "num_key_value_heads": 2, "num_inv_freq": None, "fope_sep_head": True,
        "fope_init_factor": 0.1}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fope(dtype):
    """Loaded coefficients mix the frequencies per KV head; float64 cache and rotation written here."""
    L, heads = 256, 4
    op = get_rope(D, L, True, FOPE, dtype)
    assert type(op) is FourierRotaryEmbedding
    inv = inv_freq64(BASE, D)
    inv = inv[inv > 2 * torch.pi / L]  # the frequencies that turn at least once over the context
    n = inv.shape[0]
    assert op.inv_freq.shape == (n,) and op.cos_coef.shape == (2, n, n)
    gen = torch.Generator().manual_seed(8)
    coef = {name: torch.randn(2, n, n, generator=gen) * 0.3 for name in ("cos_coef", "sin_coef")}
    for name, value in coef.items():
        param = getattr(op, name)
        param.weight_loader(param, value)
    positions = torch.randint(0, L, (6,), generator=gen)
    q, k = randn(6, heads * D, dtype=dtype, generator=gen), randn(6, 2 * D, dtype=dtype, generator=gen)
    out_q, out_k = op(positions, q, k, torch.full((6,), 100))  # offsets are not used
    assert out_q.shape == (6, heads, D) and out_k.shape == (6, 2, D)
    angles = positions.double()[:, None] * inv  # [T, F]
    c = torch.einsum("tf,hfg->thg", angles.cos(), coef["cos_coef"].double())
    s = torch.einsum("tf,hfg->thg", angles.sin(), coef["sin_coef"].double())
    c = torch.cat((c, torch.ones(6, 2, D // 2 - n, dtype=torch.float64)), -1)
    s = torch.cat((s, torch.zeros(6, 2, D // 2 - n, dtype=torch.float64)), -1)
    # the op rounds its fp32 cache to the dtype: compare against that rounding of the float64 table
    c, s = c.to(dtype).double(), s.to(dtype).double()
    for x, got, group in ((q, out_q, heads // 2), (k, out_k, 1)):
        xs = x.reshape(6, 2, group, D)
        want, mag = rope_reference(xs.reshape(12, group * D), c.reshape(12, -1), s.reshape(12, -1), D, True)
        assert_rotated(got.reshape(12, -1), want, mag, dtype, extra=64 * torch.finfo(torch.float32).eps)
    with pytest.raises(ValueError, match="FourierRotaryEmbedding: key is required"):
        op(positions, q, None)


def test_fope_loader_slices_heads(monkeypatch):
    """Each rank keeps its KV heads; with fewer heads than ranks, ranks share a head."""
    import types

    from customop.ops.rotary_embedding import fope

    op = get_rope(D, 64, True, {**FOPE, "num_key_value_heads": 1, "num_inv_freq": 4})
    full = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 4, 4)
    monkeypatch.setattr(fope, "get_tp_group", lambda: types.SimpleNamespace(tp_size=4, tp_rank=3))
    op.cos_coef.weight_loader(op.cos_coef, full)
    assert torch.equal(op.cos_coef.data, full[1:])  # ranks 2 and 3 share head 1
    with pytest.raises(ValueError, match="weight_loader: this rank's slice"):
        op.sin_coef.weight_loader(op.sin_coef, torch.zeros(8, 4, 4))
