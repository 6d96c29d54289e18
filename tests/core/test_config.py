"""The custom_ops grammar: vLLM's tokens, precedence and defaults, plus the comma forms (docs/design.md)."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import customop
from customop import CompilationMode, Config
from customop.config import parse_custom_ops


# --- B.3: every row of vLLM's validation table --------------------------------------------------

@pytest.mark.parametrize("token", ["rms_norm", "+", "-", "++x", "+x-y", "all ,-x,", "+1op", ""])
def test_malformed_token_names_the_token(token):
    with pytest.raises(ValueError, match="invalid token"):
        Config(custom_ops=[token] if token else ["all", ""])


@pytest.mark.parametrize("ops", [["all", "none"], ["all", "all"], ["none", "none"], ["none,all"]])
def test_more_than_one_base_mode_raises(ops):
    with pytest.raises(ValueError, match="only one base mode"):
        Config(custom_ops=ops)


def test_enable_and_disable_same_op_raises_naming_sorted_ops():
    with pytest.raises(ValueError, match="same op.*: a, b"):
        Config(custom_ops=["+b", "-b", "-a", "+a"])


def test_duplicate_plus_is_harmless():
    assert Config(custom_ops=["none", "+x", "+x"]).is_enabled("x")


def test_unknown_name_is_not_an_error_but_warns_once_with_close_matches(caplog):
    @customop.CustomOp.register("grammar_probe_op")
    class Probe(customop.CustomOp):
        pass

    with caplog.at_level(logging.WARNING, logger="customop"):
        Config(custom_ops=["+grammar_probe_opp"])
        Config(custom_ops=["-grammar_probe_opp"])
    warnings = [r for r in caplog.records if "grammar_probe_opp" in r.getMessage()]
    assert len(warnings) == 1
    assert "grammar_probe_op" in warnings[0].getMessage().split("did you mean")[1]
    del customop.CustomOp.op_registry["grammar_probe_op"]


# --- comma forms (our addition) --------------------------------------------------------------

@pytest.mark.parametrize("ops, on, off", [
    (["all,-a"], {"b"}, {"a"}),
    (["none,+a,+b"], {"a", "b"}, {"c"}),
    (["none", "+a, +b"], {"a", "b"}, {"c"}),
    ("none,+a", {"a"}, {"b"}),
])
def test_comma_forms(ops, on, off):
    config = Config(custom_ops=ops)
    assert all(config.is_enabled(n) for n in on)
    assert not any(config.is_enabled(n) for n in off)


def test_tokens_are_flattened():
    assert Config(custom_ops=["none,+a"]).custom_ops == ["none", "+a"]


# --- B.4: the default base mode ----------------------------------------------------------------

@pytest.mark.parametrize("backend, mode, default_on", [
    ("inductor", CompilationMode.NONE, True),
    ("inductor", CompilationMode.VLLM_COMPILE, False),
    ("inductor", CompilationMode.STOCK_TORCH_COMPILE, False),
    ("eager", CompilationMode.VLLM_COMPILE, True),
    ("openxla", CompilationMode.VLLM_COMPILE, True),
])
def test_default_base_mode(backend, mode, default_on):
    config = Config(backend=backend, mode=mode)
    assert config.default_on is default_on
    assert config.is_enabled("anything") is default_on


def test_explicit_base_mode_beats_the_default():
    assert Config(custom_ops=["all"], mode=CompilationMode.VLLM_COMPILE).default_on
    assert not Config(custom_ops=["none"]).default_on


# --- precedence, as a property -------------------------------------------------------------------

NAMES = ["a", "b", "c"]
tokens = st.lists(
    st.sampled_from(["all", "none"] + [s + n for s in "+-" for n in NAMES]), max_size=6
)


@settings(max_examples=300, deadline=None)
@given(tokens, st.sampled_from(["inductor", "eager"]), st.sampled_from(list(CompilationMode)))
def test_is_enabled_follows_precedence(toks, backend, mode):
    base = [t for t in toks if t in ("all", "none")]
    plus = {t[1:] for t in toks if t[0] == "+"}
    minus = {t[1:] for t in toks if t[0] == "-"}
    if len(base) > 1 or plus & minus:
        with pytest.raises(ValueError):
            Config(custom_ops=toks, backend=backend, mode=mode)
        return
    config = Config(custom_ops=toks, backend=backend, mode=mode)
    default = (base[0] == "all") if base else not (backend == "inductor" and mode != CompilationMode.NONE)
    for name in NAMES:
        expected = False if name in minus else (True if name in plus else default)
        assert config.is_enabled(name) is expected, (toks, name)


# --- where the current config comes from -------------------------------------------------------

def test_env_default_and_scoped_and_global(monkeypatch):
    monkeypatch.setenv("CUSTOMOP_CUSTOM_OPS", "none,+x")
    assert customop.get_config().custom_ops == ["none", "+x"]
    scoped = Config(custom_ops=["all"])
    with customop.use_config(scoped):
        assert customop.get_config() is scoped
        inner = Config(custom_ops=["none"])
        with customop.use_config(inner):
            assert customop.get_config() is inner
        assert customop.get_config() is scoped
    glob = Config(custom_ops=["-x"])
    customop.set_config(glob)
    assert customop.get_config() is glob
    customop.set_config(None)
    assert customop.get_config().custom_ops == ["none", "+x"]


def test_env_with_bad_token_raises(monkeypatch):
    monkeypatch.setenv("CUSTOMOP_CUSTOM_OPS", "all,rms_norm")
    with pytest.raises(ValueError, match="'rms_norm'"):
        customop.get_config()


def test_parse_accepts_a_bare_string():
    assert parse_custom_ops("none, +a") == ("none", "+a")
    assert parse_custom_ops("") == ()
