"""``FusedMoE`` at tp_size N (experts sliced along I) and with expert parallelism (whole experts
spread over the N ranks) against the same layer at tp_size 1, inside one N-rank job.

Run by tests/distributed/test_moe_tp.py through ``_launch.run_ranks`` (gloo, CPU). Each check
loads the same per-expert checkpoint tensors through ``weight_loader`` into the tp-N layer and a
tp-1 reference built under ``use_tp_group(None)``, runs ``forward_native`` and ``forward_cpu`` on
both, and compares; every rank issues the same collectives before any assertion.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from customop.distributed import TPGroup, use_tp_group
from customop.ops.moe import FusedMoE
from customop.samples.moe import correction_bias, moe_tolerance, routing_logits
from customop.testing import assert_close
from tests.distributed._launch import run_worker

CHECKS: dict[str, Callable[[TPGroup], None]] = {}
E, K, H, I = 8, 2, 48, 64


def check(fn: Callable[[TPGroup], None]) -> Callable[[TPGroup], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def checkpoint(seed: int, dtype: torch.dtype, bias: bool) -> dict[str, torch.Tensor]:
    """Per-expert tensors as a checkpoint stores them (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ck = {"w1": torch.randn(E, I, H, generator=g) * H ** -0.5, "w3": torch.randn(E, I, H, generator=g) * H ** -0.5,
          "w2": torch.randn(E, H, I, generator=g) * I ** -0.5}
    if bias:
        ck.update(b1=torch.randn(E, I, generator=g) * 0.5, b3=torch.randn(E, I, generator=g) * 0.5,
                  b2=torch.randn(E, H, generator=g) * 0.5)
    return {k: v.to(dtype) for k, v in ck.items()}


def build_and_load(tp: TPGroup | None, ck: dict[str, torch.Tensor], dtype: torch.dtype, **kwargs) -> FusedMoE:
    with use_tp_group(tp):
        layer = FusedMoE(E, K, H, I, params_dtype=dtype, has_bias="b1" in ck, enforce_enable=True, **kwargs)
    for e in range(E):
        for shard in ("w1", "w3", "w2"):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(param, ck[shard][e], f"experts.{e}.{shard}", shard, e)
            if "b1" in ck:
                bias = layer.w2_bias if shard == "w2" else layer.w13_bias
                layer.weight_loader(bias, ck["b" + shard[1]][e], f"experts.{e}.{shard}.bias", shard, e)
    return layer


def compare(tp: TPGroup, dtype: torch.dtype, bias: bool = False, **kwargs) -> None:
    ck = checkpoint(7, dtype, bias)
    layer = build_and_load(tp, ck, dtype, **kwargs)
    ref = build_and_load(None, ck, dtype, **{k: v for k, v in kwargs.items() if k != "enable_expert_parallel"})
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, H, generator=g).to(dtype)
    logits = routing_logits(9, E, torch.float32, generator=g)
    got = {path: getattr(layer, path)(x, logits) for path in ("forward_native", "forward_cpu")}
    want = ref.forward_native(x, logits)
    atol, rtol = moe_tolerance(dtype)
    for path, out in got.items():
        assert_close(out, want, dtype, atol=atol, rtol=rtol, what=f"{path} {kwargs}")


@check
def check_tensor_parallel(tp: TPGroup) -> None:
    """Each rank holds I / N of every expert; the all-reduce sums the partial down projections."""
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            compare(tp, dtype)
    layer = build_and_load(tp, checkpoint(7, torch.float32, False), torch.float32)
    assert layer.w13_weight.shape == (E, 2 * I // tp.tp_size, H) and layer.expert_map is None


@check
def check_tensor_parallel_bias_counted_once(tp: TPGroup) -> None:
    with torch.no_grad():
        compare(tp, torch.float32, bias=True)


@check
def check_expert_parallel(tp: TPGroup) -> None:
    """Each rank holds E / N whole experts; slots of the others' experts add zero locally."""
    with torch.no_grad():
        for placement in ("linear", "round_robin"):
            compare(tp, torch.float32, enable_expert_parallel=True, expert_placement=placement)
        compare(tp, torch.float32, bias=True, enable_expert_parallel=True)
        compare(tp, torch.float32, enable_expert_parallel=True, use_grouped_topk=True, num_expert_group=4,
                topk_group=2, scoring_func="sigmoid", routed_scaling_factor=2.5,
                e_score_correction_bias=correction_bias(E, 4, generator=torch.Generator().manual_seed(3)))
    layer = build_and_load(tp, checkpoint(7, torch.float32, False), torch.float32, enable_expert_parallel=True)
    assert layer.local_num_experts == E // tp.tp_size and layer.w13_weight.shape == (E // tp.tp_size, 2 * I, H)


@check
def check_reduce_results_off(tp: TPGroup) -> None:
    """reduce_results=False leaves the sum to the caller: the ranks' outputs add up to tp 1's."""
    ck = checkpoint(5, torch.float32, False)
    with torch.no_grad():
        layer = build_and_load(tp, ck, torch.float32, reduce_results=False)
        ref = build_and_load(None, ck, torch.float32)
        g = torch.Generator().manual_seed(13)  # the same inputs on every rank
        x, logits = torch.randn(4, H, generator=g), routing_logits(4, E, torch.float32, generator=g)
        partial = layer.forward_native(x, logits)
        total = tp.all_reduce(partial.clone())
        assert_close(total, ref.forward_native(x, logits), torch.float32, atol=2e-5, rtol=2e-5, what="sum of partials")


def main() -> int:
    return run_worker(lambda tp: {name: functools.partial(fn, tp) for name, fn in CHECKS.items()})


if __name__ == "__main__":
    sys.exit(main())
