"""Bad inputs get the same clear error on every path this machine has (native, CPU tiers, the
accelerator call's validation), never a silently wrong result."""

from __future__ import annotations

import re

import pytest
import torch

from customop.ops.activation import GeluAndMul, SiluAndMul, SwigluOAIAndMul
from customop.ops.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
from customop.ops.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from customop.ops.rotary_embedding import RotaryEmbedding
from customop.testing import ERROR_PATHS, assert_same_error

H = 8


def _norm(cls):
    return cls(H)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("residual_shape", [(2, 4, H), (1, H), (4, H - 1)])
def test_norm_residual_of_another_shape(cls, residual_shape):
    paths = assert_same_error(_norm(cls), (torch.randn(4, H), torch.randn(residual_shape)), ValueError,
                              re.escape(f"{cls.name}: residual has shape {tuple(residual_shape)}"))
    assert paths == list(ERROR_PATHS)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm, RMSNormGated], ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", [(4096, 1), (2, 1), ()], ids=["last-dim-1-large", "last-dim-1", "0-d"])
def test_norm_x_of_another_hidden_size(cls, shape):
    assert_same_error(_norm(cls), (torch.randn(shape),), ValueError, rf"{cls.name}: x has shape")


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm, RMSNormGated], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_norm_of_an_integer_tensor(cls, dtype):
    assert_same_error(_norm(cls), (torch.ones(3, H, dtype=dtype),), TypeError,
                      rf"{cls.name}: x must be a floating-point tensor")


@pytest.mark.parametrize("cls", [SiluAndMul, GeluAndMul, SwigluOAIAndMul], ids=lambda c: c.__name__)
def test_activation_of_an_integer_tensor(cls):
    """A disabled SiluAndMul compiles its native path: it must still refuse int64 input."""
    assert_same_error(cls(), (torch.ones(3, 8, dtype=torch.int64),), TypeError, r"x has dtype torch.int64")


@pytest.mark.parametrize("cls", [SiluAndMul, GeluAndMul], ids=lambda c: c.__name__)
def test_gated_activation_of_an_odd_width(cls):
    assert_same_error(cls(), (torch.randn(3, 7),), ValueError, r"last dimension must be even")


def _rope():
    return RotaryEmbedding(16, 16, 32, 10000.0, True, torch.float32)


@pytest.mark.parametrize("positions", [[-1, 0], [0, 32], [31, 40]], ids=["negative", "at-max", "past-max"])
def test_rotary_position_outside_the_cache(positions):
    q, k = torch.randn(2, 2 * 16), torch.randn(2, 16)
    assert_same_error(_rope(), (torch.tensor(positions), q, k), IndexError, r"positions must be in \[0, 32\)")


def test_rotary_positions_that_do_not_match_the_token_count():
    """2 tokens with 1 position: never two tokens rotated by one position (or a token as a head)."""
    q, k = torch.randn(2, 2 * 16), torch.randn(2, 16)
    assert_same_error(_rope(), (torch.tensor([5]), q, k), ValueError, r"must start with positions' shape \(1,\)")
    with pytest.raises(ValueError, match="must start with positions' shape"):
        torch.ops.customop.rotary_embedding(torch.tensor([5]), q, k, 16, _rope().cos_sin_cache, True)


# ---- linear layers: the width is checked before oneDNN / F.linear ---------------------------------


def _linear(cls, **kwargs):
    from customop import Config, use_config

    with use_config(Config(custom_ops=["all"])):
        layer = cls(H, 4, **kwargs)
    for p in layer.parameters():
        p.data.normal_()
    return layer


@pytest.mark.parametrize("cls, kwargs, want", [
    (ReplicatedLinear, {}, rf"expected \[\.\.\., {H}\] \(input_size\)"),
    (ColumnParallelLinear, {}, rf"expected \[\.\.\., {H}\] \(input_size\)"),
    (RowParallelLinear, {}, rf"expected \[\.\.\., {H}\] \(input_size_per_partition: input_is_parallel=True"),
    (RowParallelLinear, {"input_is_parallel": False}, rf"expected \[\.\.\., {H}\] \(input_size: input_is"),
], ids=["replicated", "column", "row", "row-not-parallel"])
@pytest.mark.parametrize("shape", [(3, H - 1), (2, 5, H + 1), (3, 1), ()], ids=str)
def test_linear_input_of_another_width(cls, kwargs, want, shape):
    """oneDNN said "could not create a primitive descriptor" (fp32, 2+ rows), F.linear a shape
    mismatch, and a 1-wide input broadcast; now one message on every path."""
    paths = assert_same_error(_linear(cls, **kwargs), (torch.randn(shape),), ValueError,
                              re.escape(f"customop.{cls.name}: x has shape {shape}, ") + want)
    assert paths == ["forward_native", "forward_cpu"]


# ---- fp8 quant: the per-token cap has one element ---------------------------------------------------


def test_quant_fp8_scale_ub_of_two_elements():
    from customop.ops.quantization import GroupShape, QuantFP8

    op = QuantFP8(False, GroupShape.PER_TOKEN)
    paths = assert_same_error(op, (torch.randn(3, H), None, torch.ones(2)), ValueError,
                              r"QuantFP8: scale_ub must be a floating tensor with one element, got torch.float32 "
                              r"of shape \(2,\)")
    assert paths == list(ERROR_PATHS)


@pytest.mark.parametrize("entry, args", [
    ("dynamic_per_token_scaled_fp8_quant", lambda x, ub: (x, ub, torch.float8_e4m3fn, 448.0, 1e-5)),
    ("rms_norm_dynamic_per_token_fp8_quant", lambda x, ub: (x, None, 1e-6, ub, torch.float8_e4m3fn, 448.0, 1e-5)),
])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fake"])
def test_per_token_entry_point_scale_ub_of_two_elements(entry, args, compiled):
    """Was ``shape '[]' is invalid``: the entry points (and their fakes, what a compiled caller
    traces) name themselves and the argument."""
    op = getattr(torch.ops.customop, entry)
    call = (lambda *a: torch.compile(op, backend="eager", fullgraph=True, dynamic=False)(*a)) if compiled else op
    err = Exception if compiled else ValueError  # Dynamo wraps what the fake raises
    with pytest.raises(err, match=rf"customop::{entry}: scale_ub must have one element, got shape \(2,\)"):
        call(*args(torch.randn(3, H), torch.ones(2)))


@pytest.mark.interpret
def test_quant_fp8_scale_ub_on_the_triton_path():
    """The op's check runs before the Triton launcher is reached."""
    from customop.backends.triton import quant as triton_quant
    from customop.ops.quantization import GroupShape, QuantFP8
    from tests.backends.triton.conftest import as_cpu_kernel

    op = QuantFP8(False, GroupShape.PER_TOKEN)
    with as_cpu_kernel("customop::dynamic_per_token_scaled_fp8_quant",
                       triton_quant.dynamic_per_token_scaled_fp8_quant) as calls:
        with pytest.raises(ValueError, match="QuantFP8: scale_ub must be a floating tensor with one element"):
            op.forward_kernel(torch.randn(3, H), None, torch.ones(2))
        op.forward_kernel(torch.randn(3, H), None, torch.ones(1))  # the kernel is wired: a good call reaches it
    assert calls == [1]


def test_the_helper_fails_on_a_path_that_returns_a_result():
    class Lenient(RMSNorm):
        def forward_cpu(self, x, residual=None):
            return x

    with pytest.raises(AssertionError, match="forward_cpu returned a result"):
        assert_same_error(Lenient(H), (torch.randn(2, H - 1),), ValueError, "x has shape")
