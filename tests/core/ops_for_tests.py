"""Tiny ops that record which forward ran, for the dispatcher's tests."""

import customop

METHODS = ("forward_native", "forward_cuda", "forward_hip", "forward_xpu", "forward_tpu",
           "forward_cpu", "forward_oot")


def _reporting(method):
    def forward(self, x=None):
        return method
    forward.__name__ = method
    return forward


def make_op(name: str, methods=METHODS, base=customop.CustomOp):
    """A registered op class defining exactly ``methods``; each returns its own name."""
    cls = type(f"Op_{name}", (base,), {m: _reporting(m) for m in methods})
    return customop.CustomOp.register(name)(cls)


def unregister(*names):
    for name in names:
        customop.CustomOp.op_registry.pop(name, None)
        customop.CustomOp.op_registry_oot.pop(name, None)
