"""``customop.integrations.transformers``: patch / unpatch on tiny random Hugging Face models built
from configs (no downloads), one per supported architecture.

The reference is the unpatched model itself (Hugging Face's own math); the models are 2 layers
of width 64 with random weights large enough that the logits spread (greedy decoding then has no
near-ties)."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch

from customop import Config, CustomOp, use_config
from customop.testing import forced_platform

transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (the test and hf extras bring it)")

from customop.integrations import transformers as hf  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=128, max_position_embeddings=128)

#: arch -> (config class, model class, config overrides)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # partial rotary: Phi-3's apply_rotary_pos_emb passes the lanes past cos.shape[-1] through
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                               "partial_rotary_factor": 0.5}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # layer 1 is a dense MLP (Qwen3MoeMLP) next to layer 0's sparse block
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                                            "head_dim": 16}),
}

#: what patch replaces in each layer, by the module's path under model.layers.<i>
LAYER_PARTS = {
    "llama": ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"],
    "qwen3": ["self_attn", "self_attn.q_norm", "self_attn.k_norm", "mlp", "input_layernorm",
              "post_attention_layernorm"],
    "gemma3": ["self_attn", "self_attn.q_norm", "self_attn.k_norm", "mlp", "input_layernorm",
               "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
    "mixtral": ["self_attn", "mlp.experts", "input_layernorm", "post_attention_layernorm"],
}
LAYER_PARTS.update(mistral=LAYER_PARTS["llama"], qwen2=LAYER_PARTS["llama"], phi3=LAYER_PARTS["llama"],
                   gemma=LAYER_PARTS["llama"], gemma2=[p for p in LAYER_PARTS["gemma3"] if "_norm" not in p])

#: the kind of replacement each report entry names, per arch (class names in the report's text)
KINDS = {
    "llama": {"RMSNorm", "GatedMLP", "SiluAndMul", "ApplyRotaryEmb"},
    "phi3": {"RMSNorm", "FusedGateUpMLP", "SiluAndMul", "ApplyRotaryEmb"},
    "gemma": {"GemmaRMSNorm", "GatedMLP", "GeluAndMul", "ApplyRotaryEmb"},
    "mixtral": {"RMSNorm", "TransformersMoERunner", "ApplyRotaryEmb"},
    "qwen3_moe": {"RMSNorm", "TransformersMoERunner", "GatedMLP", "SiluAndMul", "ApplyRotaryEmb"},
}
KINDS.update(mistral=KINDS["llama"], qwen2=KINDS["llama"], qwen3=KINDS["llama"], gemma2=KINDS["gemma"],
             gemma3=KINDS["gemma"])

#: every op patch may build, enabled explicitly (the kernel route on a forced CUDA platform)
ALL_OPS = ["none", *(f"+{name}" for name in hf.OP_NAMES)]


@pytest.fixture(autouse=True)
def _release_rotary():
    """A failed test must not leave a modeling module's rotary function replaced for the next."""
    yield
    from customop.integrations import _hf_rotary

    for modeling, state in list(_hf_rotary._installed.items()):
        for token in list(state.holders):
            _hf_rotary.release(modeling, token)


def expected_paths(arch: str) -> set[str]:
    if arch == "qwen3_moe":
        layer0 = LAYER_PARTS["qwen3"][:3] + ["mlp.experts"] + LAYER_PARTS["qwen3"][4:]
        parts = [layer0, LAYER_PARTS["qwen3"]]
    else:
        parts = [LAYER_PARTS[arch]] * 2
    return {f"model.layers.{i}.{p}" for i, layer in enumerate(parts) for p in layer} | {"model.norm"}


def build(arch: str, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    offset = 0.0 if arch.startswith("gemma") else 1.0  # Gemma's norms store w - 1
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(offset + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model.to(dtype)


def inputs(batch: int = 2, seq: int = 9) -> torch.Tensor:
    return torch.randint(3, BASE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=torch.ones_like(ids)).logits


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    scale = float(want.float().abs().max())
    # fp32: the ops' math is Hugging Face's; bf16: the MoE runner accumulates experts in fp32
    limit = (1e-5 if want.dtype == torch.float32 else 2e-2) * scale
    err = float((got.float() - want.float()).abs().max())
    assert err <= limit, f"{what}: max |logits diff| {err:.3g} > {limit:.3g}"


# ---- every architecture -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_patch_matches_the_model_and_unpatch_restores_it(arch, dtype):
    model = build(arch, dtype)
    ids = inputs()
    want = logits(model, ids)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    keys = list(model.state_dict())

    report = hf.patch(model)
    assert set(report) == expected_paths(arch)
    named = {word.strip("(),") for text in report.values() for word in text.split()}
    assert KINDS[arch] <= named and "forward_cpu" in named, report
    # the same parameter objects under the same names: nothing copied, the state dict unchanged
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert list(model.state_dict()) == keys
    assert_logits_close(logits(model, ids), want, f"{arch} patched")

    restored = hf.unpatch(model)
    assert len(restored) == len(report) - 1  # one hold on the rotary function per modeling module
    assert all(dict(model.named_modules())[p] is m for p, m in modules.items())
    assert torch.equal(logits(model, ids), want)
    assert hf.unpatch(model) == {}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_is_unchanged(arch):
    model = build(arch)
    ids = inputs(seq=6)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        hf.patch(model)
        try:
            got = model.generate(ids, **kwargs)
        finally:
            hf.unpatch(model)
    assert got.shape == (2, 14)
    assert torch.equal(got, want), f"{arch}: {got[:, 6:].tolist()} != {want[:, 6:].tolist()}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3", "qwen3_moe"])
def test_kernel_route(arch):
    """On a forced CUDA platform with every op enabled explicitly the replacements run
    forward_cuda -> forward_kernel -> torch.ops.customop (their reference bodies on CPU tensors):
    the layouts and in-place contracts of the library route, on the model's own tensors."""
    model = build(arch)
    ids = inputs()
    want = logits(model, ids)
    with forced_platform("cuda"), use_config(Config(custom_ops=ALL_OPS)):
        report = hf.patch(model)
    try:
        assert all("forward_cuda" in text for text in report.values()), report
        assert_logits_close(logits(model, ids), want, f"{arch} kernel route")
    finally:
        hf.unpatch(model)


# ---- options, notes and edge cases --------------------------------------------------------------


def test_ops_limits_what_is_replaced():
    model = build("qwen3_moe")
    report = hf.patch(model, ops=["rms_norm"])
    assert report and all(text.startswith("RMSNorm") for text in report.values())
    # class names work as in customop check --ops; an earlier patch's modules are not replaced again
    report = hf.patch(model, ops=["SiluAndMul", "transformers_fused_moe"])
    assert set(report) == {"model.layers.0.mlp.experts", "model.layers.1.mlp"}
    assert set(hf.patch(model)) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    hf.unpatch(model)
    with pytest.raises(ValueError, match="'fused_moe'.*patch uses only"):
        hf.patch(model, ops=["fused_moe"])
    with pytest.raises(ValueError, match="'no_such_op'"):
        hf.patch(model, ops="no_such_op")


def test_rotary_function_is_held_per_modeling_module():
    modeling = sys.modules["transformers.models.llama.modeling_llama"]
    original = modeling.apply_rotary_pos_emb
    first, second = build("llama"), build("llama")
    hf.patch(first)
    hf.patch(second)
    assert modeling.apply_rotary_pos_emb is not original
    hf.unpatch(first)
    assert modeling.apply_rotary_pos_emb is not original  # the second model still holds it
    hf.unpatch(second)
    assert modeling.apply_rotary_pos_emb is original


def test_nothing_to_replace_returns_an_empty_dict():
    assert hf.patch(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())) == {}
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128))
    assert hf.patch(gpt2) == {}
    assert hf.unpatch(gpt2) == {}


def test_unservable_modules_are_left_alone_and_named(caplog):
    model = build("llama", hidden_act="relu")  # no fused relu-and-mul op
    model.model.layers[1].input_layernorm.register_forward_hook(lambda *args: None)
    with caplog.at_level(logging.WARNING, logger="customop"):
        report = hf.patch(model)
    assert not any(path.endswith(".mlp") for path in report)
    assert "model.layers.1.input_layernorm" not in report and "model.layers.0.input_layernorm" in report
    text = caplog.text
    assert "activation ReLU has no fused" in text and "model.layers.0.mlp, model.layers.1.mlp" in text
    assert "hooks" in text and "model.layers.1.input_layernorm" in text
    hf.unpatch(model)


def test_calls_the_op_would_compute_differently_run_the_original():
    """A Llama norm with an fp32 weight on a bf16 input returns fp32 in Hugging Face's math; the
    op would return bf16, so that call runs the original module (same for the MLP under autocast)."""
    model = build("llama")
    norm = model.model.norm
    x = torch.randn(3, 64).bfloat16()
    want = norm(x)
    hf.patch(model)
    try:
        assert type(model.model.norm).__name__ == "RMSNorm"
        got = model.model.norm(x)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        mlp = model.model.layers[0].mlp
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(mlp(x.float()), mlp._original_forward(x.float()))
    finally:
        hf.unpatch(model)


def test_replacements_follow_custom_ops_and_oot():
    from customop.ops.layernorm import RMSNorm

    class MyNorm(RMSNorm):
        calls = 0

        def forward_oot(self, x, residual=None):
            MyNorm.calls += 1
            return self.forward_native(x, residual)

    CustomOp.register_oot(_decorated_op_cls=MyNorm, name="rms_norm")
    try:
        model = build("llama")
        with use_config(Config(custom_ops=["none"])):
            report = hf.patch(model, ops=["rms_norm", "silu_and_mul"])
        assert all("forward_native" in text for text in report.values())
        assert "MyNorm (rms_norm, forward_native)" in report.values()
        hf.unpatch(model)
        from customop.platforms import Platform, PlatformEnum

        class OotPlatform(Platform):
            _enum = PlatformEnum.OOT
            name = "oot_test"
            forward_method = "forward_oot"

        with forced_platform(OotPlatform()):
            report = hf.patch(model, ops=["rms_norm"])
        assert report["model.norm"] == "MyNorm (rms_norm, forward_oot)"
        logits(model, inputs())
        assert MyNorm.calls == 5
        hf.unpatch(model)
    finally:
        CustomOp.unregister_oot("rms_norm")


def test_deepcopy_of_a_patched_model_unpatches_on_its_own():
    model = build("mixtral")
    hf.patch(model)
    twin = copy.deepcopy(model)
    ids = inputs()
    assert torch.equal(logits(twin, ids), logits(model, ids))
    restored = hf.unpatch(twin)
    assert "model.layers.0.mlp.experts" in restored
    assert type(twin.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    assert type(model.model.layers[0].mlp.experts).__name__ == "TransformersMoERunner"
    hf.unpatch(model)


# ---- torch.compile ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch,backend", [("llama", "aot_eager"), ("phi3", "eager"), ("gemma3", "eager"),
                                          ("qwen3_moe", "aot_eager")])
def test_compiled_patched_model_has_no_graph_break(arch, backend):
    """fullgraph=True fails on any graph break, and Dynamo's tracing is what decides them, so
    Inductor is not needed here (the ops' own tests compile them with it; a tiny model took
    110 s on CI's box). aot_eager also runs the ops' fake kernels through AOTAutograd."""
    model = build(arch)
    ids = inputs()
    hf.patch(model)
    try:
        want = logits(model, ids)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with torch.no_grad():
            got = compiled(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        assert_logits_close(got, want, f"{arch} compiled ({backend})")
    finally:
        hf.unpatch(model)
        torch._dynamo.reset()
