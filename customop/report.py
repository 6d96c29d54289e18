"""What is registered, and what each op would run here: the data behind ``customop info``."""

from __future__ import annotations

import dataclasses

from customop.config import Config, get_config, use_config
from customop.custom_op import CustomOp
from customop.platforms import Platform, current_platform


@dataclasses.dataclass(frozen=True)
class DispatchRow:
    op: str
    op_class: str
    replaced_by: str | None  # the out-of-tree class, if any
    enabled: bool
    method: str  # the method the platform selects (forward_native when disabled)
    runs: str  # the method that really runs after base-class fallbacks


def list_ops() -> list[str]:
    """The registered op names, sorted."""
    return sorted(CustomOp.op_registry.copy())  # a snapshot: registration may run in another thread


def dispatch_report(config: Config | None = None, platform: Platform | None = None) -> list[DispatchRow]:
    """For each registered op: enabled under ``config``? which method on ``platform``?"""
    config = config or get_config()
    platform = platform or current_platform()
    rows = []
    for name in list_ops():
        in_tree = CustomOp.op_registry[name]
        replacement = CustomOp.op_registry_oot.get(name)
        cls = replacement or in_tree
        with use_config(config):  # what construction would decide: an op may override enabled()
            enabled = cls.enabled()
        method = platform.forward_method if enabled else "forward_native"
        rows.append(
            DispatchRow(
                op=name,
                op_class=in_tree.__qualname__,
                replaced_by=replacement.__qualname__ if replacement else None,
                enabled=enabled,
                method=method,
                runs=cls.effective_method(method),
            )
        )
    return rows


#: ``customop info``'s MoE shapes: (label, E, top_k, H, I), each at ``MOE_TOKENS`` tokens in bf16
MOE_SHAPES = (("Mixtral-8x7B E8 k2 H4096 I14336", 8, 2, 4096, 14336),
              ("Qwen3-30B-A3B E128 k8 H2048 I768", 128, 8, 2048, 768))
MOE_TOKENS = (1, 256, 4096)
_CPU_ROUTES = {"spec": "spec (fp32 loop over experts)", "per_expert": "per_expert (loop, GEMMs in the dtype)",
               "grouped": "grouped (torch._grouped_mm, eager)",
               "compiled": "compiled (torch.compile of the grouped form)"}


def moe_routes(config: Config | None = None, platform: Platform | None = None) -> tuple[str, list[list[str]]]:
    """The experts route ``fused_moe`` takes here for ``MOE_SHAPES`` (one rank, bf16): a heading
    and ``[shape, tokens, route]`` rows. Reads ``customop/ops/moe/cpu.py``'s choice or the
    Triton tuning table (``moe_tuning`` imports torch only); loads no backend."""
    import torch

    config = config or get_config()
    platform = platform or current_platform()
    row = next((r for r in dispatch_report(config, platform) if r.op == "fused_moe"), None)
    if row is None:
        return "fused_moe is not registered", []
    method, dtype = row.runs, torch.bfloat16
    heading = f"bf16, {method}" + (f", {row.replaced_by}" if row.replaced_by else "")
    if row.replaced_by:
        route = lambda *_: f"{row.replaced_by}'s own"  # noqa: E731
    elif method == "forward_native":
        heading += ", fused_moe disabled" if not row.enabled else ""
        route = lambda *_: _CPU_ROUTES["spec"]  # noqa: E731
    elif method == "forward_cpu":
        from customop.ops.moe import cpu

        route = lambda t, e, k, h, i: _CPU_ROUTES[cpu.route(t, h, i, k, dtype, e)]  # noqa: E731
    elif platform.is_cuda_alike():
        try:
            from customop.backends.triton import moe_tuning
        except ImportError as err:
            return heading + f"; the Triton tuning table cannot load ({err})", []
        device = torch.device("cuda")
        route = lambda t, e, k, h, i: moe_tuning.route(device, t, e, i, h, k, dtype)  # noqa: E731
    else:
        kernel = {"xpu": "IPEX GatedMLPMOE where it applies, else the Triton kernels (xpu providers)",
                  "tpu": "the Pallas grouped matmul (xla)"}.get(platform.name, "torch.ops.customop.fused_experts")
        route = lambda *_: kernel  # noqa: E731
    rows = [[label, str(t), route(t, e, k, h, i)] for label, e, k, h, i in MOE_SHAPES for t in MOE_TOKENS]
    return heading, rows


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table (no dependency on a table library)."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
