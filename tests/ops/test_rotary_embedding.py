"""The rotary family: every row of the table (``customop/samples/rotary.py``) on forward_native and
forward_cpu against the float64 references (``tests/cases/rotary.py``: the rotation as complex
multiplication, independent of customop's math); the compiled CPU branch, the kernel path's
wiring, checks, torch.compile, ApplyRotaryEmb, DualChunkRotaryEmbedding and conformance. The
scaling variants, get_rope and M-RoPE are in test_rope_scaling.py."""

from __future__ import annotations

import pytest
import torch

import customop
from customop.ops.rotary_embedding import (
    ApplyRotaryEmb, DualChunkRotaryEmbedding, RotaryEmbedding, apply_rotary as apply_module, base as rope_base)
from customop.platforms import CudaPlatform
from customop.samples.rotary import APPLY, DTYPES, MAX_POS, SIZES, STYLES, RopeCase, style_id
from customop.testing import assert_conforms, forced_platform, randn
from tests.cases.rotary import EPS32, assert_rotated, check_apply_output, check_rope_outputs, inv_freq64, rope_reference
from tests.ops.rope_helpers import _compile_off_and_fresh_rope_cache  # noqa: F401  (autouse fixture)
from tests.ops.rope_helpers import BASE, D, build, compile_from, dtype_id

# The kernel paths must be asked for explicitly here: with no GPU, an automatic choice falls back.
KERNEL_CONFIG = customop.Config(custom_ops=["all,+rotary_embedding,+apply_rotary_emb"])
SHIPPED_TIERS = (rope_base.ROTARY_CPU_TIERS, apply_module.APPLY_ROTARY_CPU_TIERS)


class CudaWithoutGpu(CudaPlatform):
    """The CUDA platform with its backend declared available, so that ``forward_cuda`` runs on CPU
    tensors (the op's reference kernel) for conformance."""

    @classmethod
    def unavailable_reason(cls):
        return None


def make_inputs(tokens, heads, kv_heads, head, dtype, seed=0):
    return RopeCase("", tokens, heads, kv_heads, head, head).inputs(dtype, generator=torch.Generator().manual_seed(seed))


def build_case(case: RopeCase, is_neox: bool, dtype, config=customop.Config(custom_ops=["all"])):
    with customop.use_config(config):
        return case.build(is_neox, dtype)


# ---- compile off: every row, dtype and style, native and the CPU path ------------------------


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("is_neox", STYLES, ids=style_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", SIZES["small"], ids=lambda c: c.label)
def test_rotary_embedding_eager(case, dtype, is_neox, path):
    op = build_case(case, is_neox, dtype)
    positions, q, k = case.inputs(dtype, generator=torch.Generator().manual_seed(0))
    q0, k0 = q.clone(), None if k is None else k.clone()
    out_q, out_k = getattr(op, path)(positions, q, k)
    check_rope_outputs(op, positions, q0, k0, out_q, out_k)
    assert torch.equal(q, q0) and (k is None or torch.equal(k, k0)), f"{path} must not modify its inputs"


@pytest.mark.parametrize("case", SIZES["small"], ids=lambda c: c.label)
def test_forward_kernel_wiring(case):
    """forward_kernel (what forward_cuda/_xpu/_tpu run) on CPU tensors reaches the library op's
    reference: rotated in place, the same tensors returned (NeoX here; GPT-J's wiring in
    test_kernel_path_is_in_place)."""
    op = build_case(case, True, torch.bfloat16)
    positions, q, k = case.inputs(torch.bfloat16, generator=torch.Generator().manual_seed(0))
    q0, k0 = q.clone(), None if k is None else k.clone()
    out_q, out_k = op.forward_kernel(positions, q, k)
    assert out_q is q and out_k is k
    check_rope_outputs(op, positions, q0, k0, out_q, out_k)


def test_views_and_leading_batch_dims():
    """``[T, H, D]`` views and ``[B, S, H*D]`` with positions ``[B, S]`` rotate like the flat form."""
    op = build(RotaryEmbedding, 64, 32, MAX_POS, 10000.0, False, torch.float32)
    positions, q, k = make_inputs(6, 3, 1, 64, torch.float32)
    want_q, want_k = op.forward_native(positions, q, k)
    got_q, got_k = op.forward_native(positions, q.view(6, 3, 64), k.view(6, 1, 64))
    assert torch.equal(got_q.reshape(6, -1), want_q) and torch.equal(got_k.reshape(6, -1), want_k)
    got_q, got_k = op.forward_cpu(positions.view(2, 3), q.view(2, 3, -1), k.view(2, 3, -1))
    assert torch.equal(got_q.reshape(6, -1), want_q) and torch.equal(got_k.reshape(6, -1), want_k)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_end_to_end_against_exact_angles(is_neox):
    """The whole chain (cache, gather, rotation) against angles ``p * base^(-2i/d)`` in float64;
    the cache's fp32 angles are off by a few ulps of the angle (up to ~4096 rad here)."""
    op = build(RotaryEmbedding, 128, 96, MAX_POS, 500000.0, is_neox, torch.float32)
    positions, q, k = make_inputs(9, 3, 2, 128, torch.float32)
    angles = positions.double()[:, None] * inv_freq64(500000.0, 96)
    for x, got in zip((q, k), op(positions, q, k)):
        want, mag = rope_reference(x, angles.cos(), angles.sin(), 128, is_neox)
        assert_rotated(got, want, mag, torch.float32, extra=8 * EPS32 * MAX_POS + 4 * EPS32)


# ---- compile on: the CPU path's compiled branch ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype,is_neox,kv_heads", [
    (torch.float32, True, 8), (torch.bfloat16, True, 8), (torch.float16, True, 8),
    (torch.float32, False, 8), (torch.bfloat16, True, None)],
    ids=["fp32-neox", "bf16-neox", "fp16-neox", "fp32-gptj", "bf16-neox-key-None"])
def test_rotary_embedding_cpu_compiled(dtype, is_neox, kv_heads, monkeypatch):
    compile_from(monkeypatch, RotaryEmbedding, 0)  # compile on
    op = build(RotaryEmbedding, 128, 128, MAX_POS, 10000.0, is_neox, dtype)
    # fp32-neox runs a second size: the dynamic-shape recompile (which later dtypes then reuse)
    sizes = (33, 17) if (dtype, is_neox, kv_heads) == (torch.float32, True, 8) else (33,)
    with torch._dynamo.config.patch(recompile_limit=64):
        for tokens in sizes:
            positions, q, k = make_inputs(tokens, 32, kv_heads, 128, dtype, seed=tokens)
            out_q, out_k = op.forward_cpu(positions, q, k)
            check_rope_outputs(op, positions, q, k, out_q, out_k)


def test_cpu_path_picks_compiled_code_by_size(monkeypatch):
    monkeypatch.setattr(RotaryEmbedding, "cpu_tiers", SHIPPED_TIERS[0])
    monkeypatch.setattr(ApplyRotaryEmb, "cpu_tiers", SHIPPED_TIERS[1])
    calls = []
    monkeypatch.setattr("customop.backends.cpu.tiering.compiled", lambda fn: calls.append(fn.__name__) or fn)
    # the rotary ops' compiled tier runs without Dynamo first (standalone.run_tokens): counted as compiled
    monkeypatch.setattr("customop.backends.cpu.standalone.run_tokens",
                        lambda fam, *a, **k: calls.append(fam.form.__name__))
    op = build(RotaryEmbedding, 64, 64, MAX_POS, 10000.0, True, torch.float32)
    op.forward_cpu(*make_inputs(1, 2, 1, 64, torch.float32))
    apply = build(ApplyRotaryEmb)
    for tokens in (1, int(SHIPPED_TIERS[1].min_numel) // 128):
        apply.forward_cpu(torch.randn(tokens, 1, 128), torch.randn(tokens, 64), torch.randn(tokens, 64))
    # both: the standalone route says no (the stub returns None), then the Dynamo path
    assert calls == ["rotary_embedding", "rotary_embedding", "apply_rotary_emb", "apply_rotary_emb"]


# ---- the kernel path (forced CUDA platform; the library op's reference runs on CPU) ----------


@pytest.mark.parametrize("platform,kv_heads", [("cuda", 8), ("cuda", None), ("rocm", 8), ("xpu", 8)],
                         ids=["cuda", "cuda-key-None", "rocm", "xpu"])
def test_kernel_path_is_in_place(platform, kv_heads):
    with forced_platform(platform):
        op = build(RotaryEmbedding, 128, 96, MAX_POS, 10000.0, False, torch.bfloat16, config=KERNEL_CONFIG)
        assert op.forward_method_name == {"cuda": "forward_cuda", "rocm": "forward_hip", "xpu": "forward_xpu"}[platform]
        positions, q, k = make_inputs(7, 4, kv_heads, 128, torch.bfloat16)
        q0, k0 = q.clone(), None if k is None else k.clone()
        out_q, out_k = op(positions, q, k)
    assert out_q is q and out_k is k, "the kernel path returns the very tensors it rotated"
    check_rope_outputs(op, positions, q0, k0, out_q, out_k)
    native_q, native_k = op.forward_native(positions, q0, k0)
    assert torch.equal(out_q, native_q) and (k is None or torch.equal(out_k, native_k))


def test_cache_follows_query_dtype_without_degrading_the_shared_fp32_cache():
    op = build(RotaryEmbedding, 64, 64, MAX_POS, 10000.0, True, torch.float32)
    assert "cos_sin_cache" in op._buffers and "cos_sin_cache" not in op.state_dict()
    positions, q, k = make_inputs(3, 2, 1, 64, torch.float32)
    before = op.forward_native(positions, q, k)
    op.forward_native(positions, q.bfloat16(), k.bfloat16())  # a bf16 caller of the same instance
    assert op.cos_sin_cache.dtype == torch.float32 and "cos_sin_cache" not in op.state_dict()
    after = op.forward_native(positions, q, k)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


# ---- input checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_bad_inputs_name_the_op_and_argument(platform):
    with forced_platform(platform):
        op = build(RotaryEmbedding, 64, 64, MAX_POS, 10000.0, True, torch.float32, config=KERNEL_CONFIG)
    positions, q, k = make_inputs(4, 2, 1, 64, torch.float32)
    with forced_platform(platform):
        with pytest.raises(TypeError, match="rotary_embedding: positions"):
            op(positions.float(), q, k)
        with pytest.raises(ValueError, match="rotary_embedding: query's last dim 96"):
            op(positions, q[:, :96], k)
        with pytest.raises(ValueError, match="rotary_embedding: query of shape"):
            op(positions[:3], q, k)
        with pytest.raises(ValueError, match="rotary_embedding: key of shape"):
            op(positions, q, k[:2])
    for rot in (72, 31):
        with pytest.raises(ValueError, match="RotaryEmbedding: rotary_dim"):
            RotaryEmbedding(64, rot, MAX_POS, 10000.0, True, torch.float32)


# ---- torch.library and torch.compile -----------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [2, None], ids=["key", "key-None"])
def test_opcheck(kv_heads):
    positions, q, k = make_inputs(5, 3, kv_heads, 64, torch.float32)
    cache = RotaryEmbedding(64, 32, MAX_POS, 10000.0, True, torch.float32).cos_sin_cache
    torch.library.opcheck(torch.ops.customop.rotary_embedding.default, (positions, q, k, 64, cache, False))


def test_compile_fullgraph_cpu_path_keeps_the_buffer():
    """Enabled on the CPU: one graph; the fp32 cache is cast for the bf16 query inside the graph
    without replacing the module's buffer. (aot_eager: Inductor's code for this math is what the
    compiled-branch tests above check.)"""
    op = build(RotaryEmbedding, 128, 128, MAX_POS, 10000.0, True, torch.float32)
    positions, q, k = make_inputs(33, 32, 8, 128, torch.bfloat16)
    out_q, out_k = torch.compile(op, fullgraph=True, backend="aot_eager")(positions, q, k)
    assert op.cos_sin_cache.dtype == torch.float32
    op.cos_sin_cache = op.cos_sin_cache.bfloat16()  # what the eager path does: compare in bf16
    check_rope_outputs(op, positions, q, k, out_q, out_k)


def test_compile_fullgraph_kernel_path():
    with forced_platform("cuda"):
        op = build(RotaryEmbedding, 64, 64, MAX_POS, 10000.0, False, torch.float32, config=KERNEL_CONFIG)
        positions, q, k = make_inputs(7, 4, 2, 64, torch.float32)
        q0, k0 = q.clone(), k.clone()
        # aot_eager: the question is one graph and a kept mutation, not Inductor's code
        out_q, out_k = torch.compile(op, fullgraph=True, backend="aot_eager")(positions, q, k)
    check_rope_outputs(op, positions, q0, k0, out_q, out_k)
    assert torch.equal(q, out_q) and torch.equal(k, out_k), "the compiled kernel path still writes in place"


# ---- ApplyRotaryEmb ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_cuda"])
@pytest.mark.parametrize("fp32", [False, True], ids=["in-dtype", "fp32-compute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", APPLY, ids=lambda c: c.label)
def test_apply_rotary_emb(case, dtype, fp32, path):
    x, cos, sin = case.inputs(dtype, generator=torch.Generator().manual_seed(1))
    with forced_platform("cuda"), customop.use_config(KERNEL_CONFIG):
        op = case.build(fp32)
        x0 = x.clone()
        got = getattr(op, path)(x, cos, sin)
    assert torch.equal(x, x0)
    check_apply_output(got, x, cos, sin, case.neox, fp32)


@pytest.mark.slow
def test_apply_rotary_emb_cpu_compiled(monkeypatch):
    compile_from(monkeypatch, ApplyRotaryEmb, 0)  # compile on
    gen = torch.Generator().manual_seed(2)
    x = randn(2, 10, 3, 64, dtype=torch.bfloat16, generator=gen)
    angles = torch.rand(10, 32, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = build(ApplyRotaryEmb, False, False).forward_cpu(x, cos, sin)
    want, mag = rope_reference(x.reshape(20, -1), cos.repeat(2, 1), sin.repeat(2, 1), 64, False)
    assert_rotated(got.reshape(20, -1), want, mag, torch.bfloat16)


def test_apply_rotary_emb_checks_and_compile():
    op = build(ApplyRotaryEmb, True)
    assert op._enforce_enable
    x, cos = torch.randn(4, 2, 32), torch.randn(4, 16)
    with pytest.raises(ValueError, match="apply_rotary_emb: cos has 3 positions"):
        op.forward_kernel(x, cos[:3], cos[:3])
    with pytest.raises(ValueError, match="apply_rotary_emb: cos/sin rotate 64 lanes"):
        op.forward_kernel(x, torch.randn(4, 32), torch.randn(4, 32))
    with pytest.raises(TypeError, match="apply_rotary_emb: x must be a floating-point"):
        op.forward_kernel(x.int(), cos, cos)
    with forced_platform("cuda"):
        kernel_op = build(ApplyRotaryEmb, False, False, config=KERNEL_CONFIG)
        got = torch.compile(kernel_op, fullgraph=True, backend="aot_eager")(x, cos, cos)
    assert torch.equal(got, kernel_op.forward_native(x, cos, cos))


# ---- DualChunkRotaryEmbedding ------------------------------------------------------------------


def test_dual_chunk_five_variants():
    chunk, local, tokens, heads, kv_heads = 16, 4, 9, 2, 1
    L = chunk - local
    op = build(DualChunkRotaryEmbedding, D, 48, 64, BASE, True, torch.float32, chunk, local)
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 60, (tokens,), generator=gen)
    offsets = torch.full((tokens,), 2)
    q, k = randn(tokens, heads * D, generator=gen), randn(tokens, kv_heads * D, generator=gen)
    out_q, out_k = op(positions, q, k, offsets)
    p = positions + offsets
    inv = inv_freq64(BASE, 48)
    # the position each variant rotates by, straight from the five cache definitions
    variants = [p % L, torch.clamp(p % L + L, max=chunk), torch.full_like(p, min(2 * L - 1, chunk)),
                p % L + L, p % L + chunk]
    assert out_q.shape == (tokens, 5 * heads * D) and out_k.shape == (tokens, kv_heads * D)
    angle_error = 8 * EPS32 * float(max(v.max() for v in variants + [p % L])) + 4 * EPS32
    for i, pos in enumerate(variants):
        angles = pos.double()[:, None] * inv
        want, mag = rope_reference(q, angles.cos(), angles.sin(), D, True)
        assert_rotated(out_q[:, i * heads * D:(i + 1) * heads * D], want, mag, torch.float32, angle_error, f"variant {i}")
    angles = (p % L).double()[:, None] * inv
    want, mag = rope_reference(k, angles.cos(), angles.sin(), D, True)
    assert_rotated(out_k, want, mag, torch.float32, angle_error, "key")


# ---- conformance through the sample builders ----------------------------------------------------


@pytest.mark.slow  # the 17-token sample takes the compiled CPU branch
@pytest.mark.parametrize("op_cls", [RotaryEmbedding, ApplyRotaryEmb, DualChunkRotaryEmbedding],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("platform", [None, CudaWithoutGpu()], ids=["cpu", "cuda-wiring"])
def test_conforms(op_cls, platform, monkeypatch):
    # Only the 17-token sample takes the compiled CPU branch here (its specializations are the
    # compiled tests' above); compiling every small sample would add ~20 s for no new code path.
    compile_from(monkeypatch, RotaryEmbedding, 16)
    with torch._dynamo.config.patch(recompile_limit=64):
        assert_conforms(op_cls, platform=platform)
