"""``qwen2_decoder`` (DeepSeek-OCR-2's Qwen2 vision decoder): every case of its table
(``customop/samples/qwen2_decoder.py``) on forward_native and forward_cpu, and built on the kernel
route of a forced CUDA platform (its sub-ops then run their ``torch.ops.customop`` calls), against
the float64 reference (``tests/cases/qwen2_decoder.py``); the mask; the parameter names of vLLM's
module; bad inputs; torch.compile; conformance.

fp32 is compared elementwise under its usual tolerance. bf16/fp16 are compared by normwise relative
error, at most four unit roundoffs: two layers store ~20 intermediate results in the dtype, and the
reference, though it rounds at the same points, rounds slightly different values, so elementwise
errors of a few ulps are expected; a real fault (a dropped mask, bias or rotation) is >= 25x larger
(``test_bounds_catch_a_dropped_mask``)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from customop.config import Config, use_config
from customop.math.qwen2_decoder import allowed
from customop.ops.qwen2_decoder import CustomQwen2Decoder
from customop.samples.qwen2_decoder import BY_LABEL, CASES, DTYPES, DecoderCase
from customop.testing import assert_close, assert_conforms, forced_platform, randn
from tests.cases.qwen2_decoder import ref_decoder, ref_mask

PARAMS = [pytest.param(c, s, id=f"{c.label}-{s[0]}x{s[1]}") for c in CASES for s in c.shapes["small"]]
GEN = lambda seed=0: torch.Generator().manual_seed(seed)  # noqa: E731
#: normwise relative bound: 4 unit roundoffs (2^-8 for bf16, 2^-11 for fp16)
NORMWISE = {torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_close(got, expected, dtype, what=what)
        return
    err = float((got.double().cpu() - expected).norm() / expected.norm())
    assert err <= NORMWISE[dtype], f"{what}: normwise relative error {err:.2e} > {NORMWISE[dtype]:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "kernel route"])
@pytest.mark.parametrize("case,shape", PARAMS)
def test_matches_float64_reference(case, shape, path, dtype):
    platform = "cuda" if path == "kernel route" else "cpu"
    with forced_platform(platform), use_config(Config(custom_ops=["all"] if platform == "cpu" else
                                                    ["+rms_norm", "+rotary_embedding", "+silu_and_mul"])):
        op = case.build(dtype, generator=GEN())
    x, mask = case.inputs(*shape, dtype, generator=GEN(1))
    fn = op.forward_native if path == "kernel route" else getattr(op, path)
    got = fn(x, attention_mask=mask)
    assert isinstance(got, tuple) and len(got) == 1
    assert_matches(got[0], ref_decoder(op, x, mask), dtype, f"{case.label} {path}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bounds_catch_a_dropped_mask(dtype):
    case = BY_LABEL["tiny gqa padded"]
    op = case.build(dtype, generator=GEN())
    x, mask = case.inputs(*case.shapes["small"][0], dtype, generator=GEN(1))
    with pytest.raises(AssertionError, match="normwise relative error"):
        assert_matches(op.forward_native(x)[0], ref_decoder(op, x, mask), dtype, "no attention_mask")


@pytest.mark.parametrize("seq", range(1, 10))
def test_mask(seq):
    assert torch.equal(allowed(seq), ref_mask(seq, None, 1)[0])


def test_vllm_constructor_and_parameter_names():
    with torch.device("meta"):
        op = CustomQwen2Decoder()
    names = {n for n, _ in op.named_parameters()}
    assert {n: tuple(p.shape) for n, p in op.named_parameters()} == \
        DecoderCase("vLLM defaults", {}, {}).shapes_of_parameters()
    assert len(op.model.layers) == 24 and op.hidden_size == 896
    assert "model.layers.23.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    assert "model.norm.weight" in names and not any("embed_tokens" in n for n in names)
    attn = op.model.layers[0].self_attn
    assert (attn.heads, attn.kv_heads, attn.head_dim, op.rotary_emb.base) == (14, 2, 64, 1000000.0)
    assert op.model.layers[0].mlp.gate_proj.weight.shape == (4864, 896)


def test_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match="num_attention_heads=5 must divide hidden_dimension=64"):
        CustomQwen2Decoder(1, 16, 64, 5, 1, 32)
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        CustomQwen2Decoder(1, 16, 64, 4, 2, 32, hidden_act="gelu")
    op = CASES[0].build(torch.float32, generator=GEN())
    for args, error, match in (((randn(8, 64),), ValueError, r"inputs_embeds has shape \(8, 64\)"),
                               ((randn(1, 8, 64, dtype=torch.bfloat16),), TypeError, "inputs_embeds has dtype"),
                               ((randn(1, 65, 64),), ValueError, "65 tokens exceed max_position_embeddings=64"),
                               ((randn(2, 8, 64), None, torch.ones(2, 7)), ValueError, "attention_mask has shape"),
                               ((None,), TypeError, "inputs_embeds must be a torch.Tensor")):
        for path in ("forward_native", "forward_cpu"):
            with pytest.raises(error, match=f"customop.qwen2_decoder: {match}"):
                getattr(op, path)(*args)


def test_compiles_fullgraph():
    case = CASES[0]
    op = case.build(torch.float32, generator=GEN())
    x, _ = case.inputs(1, 8, torch.float32, generator=GEN(1))
    counter = torch._dynamo.testing.CompileCounter()
    got = torch.compile(lambda x: op(x)[0], backend=counter, fullgraph=True)(x)
    assert_close(got, ref_decoder(op, x), torch.float32)
    assert counter.frame_count == 1


def test_conforms():
    assert_conforms(CustomQwen2Decoder)
