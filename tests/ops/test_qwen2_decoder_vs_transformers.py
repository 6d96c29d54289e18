"""``qwen2_decoder`` against ``transformers``' own ``Qwen2Model`` built from a tiny random
``Qwen2Config`` (no download) and loaded with the same weights, in fp32.

* Plain Qwen2 math (causal attention, RoPE at positions 0..S-1): customop's layers, given a causal
  mask, against ``Qwen2Model``, which builds its own causal (and padding) mask.
* The decoder's contract (image half bidirectional, query half causal on itself, padded keys
  hidden): the whole ``CustomQwen2Decoder`` against ``Qwen2Model`` given that mask as a custom 4-D
  additive mask (transformers passes a 4-D mask through as is), the mask written here from
  ``token_type_ids`` (0 = image, 1 = query) the way vLLM's module derives it.
* The mask follows ``token_type_ids`` as vLLM's does, for any layout (image tokens after queries,
  interleaved, a type other than 0/1), with padding ADDED as vLLM adds it (a padded key that is also
  not allowed is -inf); without types, the half split (vLLM's encoder's layout).

customop keeps q/k/v and gate/up unfused with HF's names under ``model.``, so the weights map by
dropping that prefix; ``Qwen2Model``'s token embedding is the only parameter left unloaded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen2Config  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model  # noqa: E402

from customop.config import Config, use_config  # noqa: E402
from customop.ops.qwen2_decoder import CustomQwen2Decoder  # noqa: E402
from customop.samples.qwen2_decoder import DecoderCase  # noqa: E402
from customop.testing import randn  # noqa: E402

INIT = {"decoder_layer": 2, "max_position_embeddings": 64, "hidden_dimension": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
#: fp32 against fp32: both sides round at the same points; what remains is summation order
TOL = {"rtol": 1e-5, "atol": 1e-5}
#: (batch, seq, padded keys at the end of row 0): odd/even lengths, a single token, padding
SHAPES = [(1, 8, 0), (2, 7, 0), (1, 1, 0), (2, 10, 3)]
#: customop's sub-ops on their native forwards, and on their CPU paths
CUSTOM_OPS = [["none"], ["all"]]


def build(custom_ops: list[str], attn: str, seed: int = 0) -> tuple[CustomQwen2Decoder, Qwen2Model]:
    with use_config(Config(custom_ops=custom_ops)):
        op = CustomQwen2Decoder(**INIT, params_dtype=torch.float32)
    op.requires_grad_(False)
    state = DecoderCase("vs transformers", INIT, {}).state(torch.float32, generator=torch.Generator().manual_seed(seed))
    op.load_state_dict(state, strict=True)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=64, vocab_size=16, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu")
    config._attn_implementation = attn
    hf = Qwen2Model(config).eval().requires_grad_(False)
    result = hf.load_state_dict({name.removeprefix("model."): t for name, t in state.items()}, strict=False)
    assert result.missing_keys == ["embed_tokens.weight"] and not result.unexpected_keys, result
    return op, hf


def inputs(batch: int, seq: int, padded: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = randn(batch, seq, 64, generator=torch.Generator().manual_seed(seed))
    if not padded:
        return x, None
    keep = torch.ones(batch, seq, dtype=torch.long)
    keep[0, seq - padded:] = 0
    return x, keep


def vllm_style_mask(token_type_ids: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``[B, 1, S, S]`` additive fp32 mask: image tokens (type 0) see the image tokens; a query token
    (type 1) sees the image tokens and the query tokens up to itself; padded keys are hidden."""
    b, s = token_type_ids.shape
    allow = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for r in range(b):
        image = [j for j in range(s) if token_type_ids[r, j] == 0]
        query = [j for j in range(s) if token_type_ids[r, j] == 1]
        for i in image:
            allow[r, 0, i, image] = True
        for k, i in enumerate(query):
            allow[r, 0, i, image + query[: k + 1]] = True
    lowest = torch.finfo(torch.float32).min
    mask = torch.where(allow, 0.0, lowest)
    if keep is not None:  # vLLM adds the padding mask: padded and not allowed sums to -inf
        mask = mask + torch.where(keep.bool()[:, None, None, :], 0.0, lowest)
    return mask


def split_types(batch: int, seq: int, n_image: int) -> torch.Tensor:
    types = torch.ones(batch, seq, dtype=torch.long)
    types[:, :n_image] = 0
    return types


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("custom_ops", CUSTOM_OPS, ids=lambda c: c[0])
@pytest.mark.parametrize("batch,seq,padded", SHAPES)
def test_layers_match_causal_qwen2(batch, seq, padded, custom_ops, attn):
    op, hf = build(custom_ops, attn)
    x, keep = inputs(batch, seq, padded)
    expected = hf(inputs_embeds=x, attention_mask=keep).last_hidden_state
    allow = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    if keep is not None:
        allow = allow & keep.bool()[:, None, None, :]
    mask = torch.where(allow, 0.0, torch.finfo(torch.float32).min)
    positions = torch.arange(seq).repeat(batch)
    with use_config(Config(custom_ops=custom_ops)):
        h = x
        for layer in op.model.layers:
            h = layer(h, positions, op.rotary_emb, mask)
        got = op.model.norm(h)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("custom_ops", CUSTOM_OPS, ids=lambda c: c[0])
@pytest.mark.parametrize("batch,seq,padded", SHAPES)
def test_decoder_matches_qwen2_with_its_4d_mask(batch, seq, padded, custom_ops, attn):
    op, hf = build(custom_ops, attn)
    x, keep = inputs(batch, seq, padded)
    types = split_types(batch, seq, seq // 2)
    expected = hf(inputs_embeds=x, attention_mask=vllm_style_mask(types, keep)).last_hidden_state
    with use_config(Config(custom_ops=custom_ops)):
        (got,) = op(x, token_type_ids=types, attention_mask=keep)
    torch.testing.assert_close(got, expected, **TOL)
    # the mask matters: plain causal Qwen2 differs on these inputs (past one token)
    if seq > 1:
        causal = hf(inputs_embeds=x, attention_mask=keep).last_hidden_state
        assert not torch.allclose(got, causal, **TOL)


@pytest.mark.parametrize("layout", ["3 image first", "queries first", "interleaved", "a type-2 token"])
def test_token_type_ids_drive_the_mask(layout):
    op, hf = build(["none"], "sdpa")
    x, keep = inputs(2, 8, 3)
    types = {"3 image first": split_types(2, 8, 3),
             "queries first": 1 - split_types(2, 8, 5),
             "interleaved": (torch.arange(8) % 2).expand(2, 8).clone(),
             "a type-2 token": split_types(2, 8, 4).index_fill_(1, torch.tensor([6]), 2)}[layout]
    for pad in (None, keep):
        expected = hf(inputs_embeds=x, attention_mask=vllm_style_mask(types, pad)).last_hidden_state
        torch.testing.assert_close(op(x, token_type_ids=types, attention_mask=pad)[0], expected, **TOL)


def test_token_type_ids_are_checked():
    op, _ = build(["none"], "sdpa")
    x, _ = inputs(1, 8, 0)
    for bad in (torch.zeros(1, 7, dtype=torch.long), torch.zeros(1, 8), [0] * 8):
        with pytest.raises(ValueError, match="qwen2_decoder.*token_type_ids must be an integer tensor of shape"):
            op(x, token_type_ids=bad)
