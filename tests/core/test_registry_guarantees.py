"""Registries and configuration under misuse: clear errors at the call, one enable name per
class, and registrations that stay atomic when threads race."""

from __future__ import annotations

import threading
import time

import pytest

import customop
from customop import Config, CustomOp, set_config, use_config
from customop.platforms import _load_class

from .ops_for_tests import make_op, unregister


@pytest.fixture
def two_ops():
    first, second = make_op("guarantee_a"), make_op("guarantee_b")
    yield first, second
    unregister("guarantee_a", "guarantee_b", "guarantee_c")


@pytest.mark.parametrize("name", [None, "", "two words", "1st", 3])
def test_register_rejects_names_that_are_not_identifiers(name):
    with pytest.raises(ValueError, match="op name must be a Python identifier"):
        CustomOp.register(name)


def test_one_class_cannot_take_a_second_op_name(two_ops):
    first, _ = two_ops
    with pytest.raises(ValueError, match="already op 'guarantee_a'.*cannot also be 'guarantee_c'"):
        CustomOp.register("guarantee_c")(first)
    assert "guarantee_c" not in CustomOp.op_registry
    with use_config(Config(custom_ops=["all", "-guarantee_a"])):
        assert first().forward_method_name == "forward_native"  # "-guarantee_a" still disables it


def test_one_replacement_cannot_replace_two_ops(two_ops):
    first, second = two_ops

    class Vendor(CustomOp):
        def forward_native(self, x=None):
            return "vendor"

    CustomOp.register_oot(name="guarantee_a")(Vendor)
    with pytest.raises(ValueError, match="cannot also replace 'guarantee_b'"):
        CustomOp.register_oot(name="guarantee_b")(Vendor)
    assert "guarantee_b" not in CustomOp.op_registry_oot
    assert Vendor.name == "guarantee_a"


class _HoldsBetweenCheckAndStore(dict):
    """The OOT registry, with the thread named "first" pausing right after its check: without a
    lock over check-and-store, a second thread would pass the same check in that window."""

    def __init__(self, *args, checked: threading.Event):
        super().__init__(*args)
        self.checked = checked

    def get(self, key, default=None):
        value = super().get(key, default)
        if threading.current_thread().name == "first" and not self.checked.is_set():
            self.checked.set()
            time.sleep(0.3)
        return value


def test_racing_registrations_under_one_key_let_exactly_one_win(two_ops, monkeypatch):
    checked = threading.Event()
    monkeypatch.setattr(CustomOp, "op_registry_oot", _HoldsBetweenCheckAndStore(checked=checked))
    classes = [type(f"Vendor{i}", (CustomOp,), {"forward_native": lambda self, x=None: None}) for i in range(2)]
    outcomes: dict[str, str] = {}

    def register(cls, thread_name):
        try:
            CustomOp.register_oot(name="guarantee_a")(cls)
            outcomes[thread_name] = "ok"
        except ValueError as err:
            outcomes[thread_name] = str(err)

    first = threading.Thread(target=register, args=(classes[0], "first"), name="first")
    first.start()
    assert checked.wait(5)
    second = threading.Thread(target=register, args=(classes[1], "second"), name="second")
    second.start()
    first.join(5)
    second.join(5)
    assert outcomes["first"] == "ok"
    assert "already replaced by Vendor0" in outcomes["second"]
    assert CustomOp.op_registry_oot["guarantee_a"] is classes[0]


def test_listing_ops_while_another_thread_registers():
    stop = threading.Event()
    names = [f"guarantee_race_{i}" for i in range(300)]

    def keep_registering():
        for name in names:
            make_op(name)
        stop.set()

    writer = threading.Thread(target=keep_registering)
    writer.start()
    try:
        while not stop.is_set():
            customop.list_ops()
            CustomOp.resolve_op_name("rms_norm")
    finally:
        writer.join()
        unregister(*names)


@pytest.mark.parametrize("call, match", [
    (lambda: Config(custom_ops=None), "custom_ops must be a list of strings"),
    (lambda: Config(custom_ops=["all", 3]), "custom_ops must be a list of strings"),
    (lambda: set_config("all"), r"set_config takes a customop.Config or None, got 'all'; write set_config\(Config"),
    (lambda: use_config(["all"]).__enter__(), r"use_config takes a customop.Config, got \['all'\]"),
])
def test_config_misuse_raises_at_the_call(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_platform_plugin_errors_name_the_plugin():
    with pytest.raises(RuntimeError, match="platform plugin 'npu'.*'no_such_module:Npu', which cannot be loaded"):
        _load_class("no_such_module:Npu", "npu")
    with pytest.raises(RuntimeError, match="platform plugin 'npu'.*cannot be loaded"):
        _load_class("customop.platforms:NoSuchPlatform", "npu")
    with pytest.raises(TypeError, match="platform plugin 'npu'.*must return a 'module:Class' path"):
        _load_class(customop.platforms.CpuPlatform, "npu")
    with pytest.raises(TypeError, match="platform plugin 'npu'.*not a customop Platform subclass"):
        _load_class("customop.config:Config", "npu")
