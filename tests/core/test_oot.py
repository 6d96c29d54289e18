"""Out-of-tree replacement: four registration forms, the swap at construction, idempotence."""

import pytest

from customop import Config, CustomOp, use_config
from customop.testing import forced_platform

from .ops_for_tests import make_op, unregister


@pytest.fixture
def in_tree():
    class InTreeNorm(CustomOp):
        def __init__(self, hidden, *, eps=1e-6):
            super().__init__()
            self.hidden, self.eps = hidden, eps

        def forward_native(self, x=None):
            return "in-tree"

    CustomOp.register("oot_norm")(InTreeNorm)
    yield InTreeNorm
    unregister("oot_norm")


def _replacement(base):
    class Vendor(base):
        def forward_native(self, x=None):
            return "vendor-native"

        def forward_oot(self, x=None):
            return "vendor-oot"

    return Vendor


@pytest.mark.parametrize("form", ["positional", "keyword", "bare", "direct", "op_name"])
def test_registration_forms_swap_the_class(in_tree, form):
    Vendor = _replacement(in_tree)
    if form == "positional":
        CustomOp.register_oot("InTreeNorm")(Vendor)
    elif form == "keyword":
        CustomOp.register_oot(name="InTreeNorm")(Vendor)
    elif form == "bare":
        in_tree.register_oot(Vendor)
    elif form == "direct":
        CustomOp.register_oot(_decorated_op_cls=Vendor, name="InTreeNorm")
    else:
        CustomOp.register_oot(name="oot_norm")(Vendor)
    assert CustomOp.op_registry_oot["oot_norm"] is Vendor
    op = in_tree(64, eps=1e-5)
    assert type(op) is Vendor
    assert (op.hidden, op.eps) == (64, 1e-5)  # __init__ ran with the same arguments, once
    assert op(None) == "vendor-native" or op(None) == "vendor-oot"


def test_bare_decorator_syntax(in_tree):
    @in_tree.register_oot
    class Vendor(in_tree):
        pass

    assert type(in_tree(8)) is Vendor


def test_replacement_not_subclassing_in_tree_still_gets_init(in_tree):
    class Standalone(CustomOp):
        def __init__(self, hidden, *, eps=1e-6):
            super().__init__()
            self.got = (hidden, eps)

        def forward_native(self, x=None):
            return "standalone"

    CustomOp.register_oot("InTreeNorm")(Standalone)
    op = in_tree(16, eps=0.5)
    assert type(op) is Standalone and op.got == (16, 0.5)
    assert Standalone.name == "oot_norm"


def test_minus_name_disables_the_replacement(in_tree):
    CustomOp.register_oot("InTreeNorm")(_replacement(in_tree))
    from customop.platforms import Platform, PlatformEnum

    class Npu(Platform):
        _enum = PlatformEnum.OOT
        name, forward_method = "npu", "forward_oot"

    with forced_platform(Npu()):
        with use_config(Config(custom_ops=["all"])):
            assert in_tree(8)(None) == "vendor-oot"
        with use_config(Config(custom_ops=["all", "-oot_norm"])):
            assert in_tree(8)(None) == "vendor-native"


def test_same_class_twice_is_a_noop_and_a_different_class_raises(in_tree):
    Vendor = _replacement(in_tree)
    CustomOp.register_oot("InTreeNorm")(Vendor)
    CustomOp.register_oot(name="oot_norm")(Vendor)  # the other key form, same op: still fine
    Other = _replacement(in_tree)
    with pytest.raises(ValueError, match="override=True"):
        CustomOp.register_oot("InTreeNorm")(Other)
    CustomOp.register_oot("InTreeNorm", override=True)(Other)
    assert CustomOp.op_registry_oot["oot_norm"] is Other


def test_unregister_restores_in_tree(in_tree):
    CustomOp.register_oot("InTreeNorm")(_replacement(in_tree))
    assert CustomOp.unregister_oot("InTreeNorm") is not None
    assert type(in_tree(8)) is in_tree


def test_unknown_key_and_bad_arguments(in_tree):
    with pytest.raises(KeyError, match="did you mean"):
        CustomOp.register_oot("InTreeNorn")(_replacement(in_tree))
    with pytest.raises(TypeError, match="classes"):
        CustomOp.register_oot("InTreeNorm")(lambda: None)
    with pytest.raises(TypeError, match="name="):
        CustomOp.register_oot(_replacement(in_tree))
    with pytest.raises(TypeError, match="subclass CustomOp"):
        CustomOp.register_oot("InTreeNorm")(object)


def test_only_the_exact_registered_class_is_swapped(in_tree):
    class Variant(in_tree):  # unregistered subclass shares the enable name but is not swapped
        pass

    CustomOp.register_oot("InTreeNorm")(_replacement(in_tree))
    assert type(Variant(8)) is Variant


def test_a_registered_op_cannot_replace_another():
    first, second = make_op("oot_first"), make_op("oot_second")
    try:
        with pytest.raises(ValueError, match="already op"):
            CustomOp.register_oot(name="oot_first")(second)
    finally:
        unregister("oot_first", "oot_second")
