"""The state-space layers at tp_size 2 (two gloo ranks on 127.0.0.1) against tp_size 1: the same
checkpoint tensors loaded through the layers' ``weight_loader``s, the same batch; the tp-2 output
(after ``out_proj``'s all-reduce) must equal the tp-1 output, and each rank's caches the rank's
slice of the tp-1 caches. Covers Mamba-2 with groups split over the ranks and with one group
replicated on both, Mamba-1, the short conv, and the gated norm's three cases (one group: the
all-reduce; groups on whole ranks: local; 3 groups on 2 ranks: the all-gather).

This module is also the worker: ``python -m tests.ops.test_mamba_tp --rank R ...`` (started by
``tests.distributed._launch.run_ranks``), one job for every check.
"""

from __future__ import annotations

import sys

import pytest
import torch

WORLD_SIZE = 2
CHECKS = ("mamba_mixer2[2 groups]", "mamba_mixer2[1 group]", "mamba_mixer", "short_conv", "norm[1 group]",
          "norm[4 groups]", "norm[3 groups]")


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    from tests.distributed._launch import run_ranks

    return run_ranks("tests.ops.test_mamba_tp", world_size=WORLD_SIZE, timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_tp2_matches_tp1(reports, check):
    failures = [f"rank {r}:\n{report.get(check, 'not run')}" for r, report in enumerate(reports)
                if report.get(check, "not run") is not None]
    assert not failures, f"{check} failed\n" + "\n".join(failures)


# ---- the worker ------------------------------------------------------------------------------------


def _load(layer, name: str, full: torch.Tensor) -> None:
    param = layer.get_parameter(name)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(full)  # replicated (the RMSNorms of Mamba-1)
    else:
        loader(param, full)


def _checkpoint(reference) -> dict[str, torch.Tensor]:
    """Random full tensors for every parameter of the tp-1 layer (A as A_log: its loader takes
    ``-exp``), the same on every rank."""
    gen, out = torch.Generator().manual_seed(0), {}
    for name, p in reference.named_parameters():
        value = torch.randn(p.shape, generator=gen) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5)
        if name == "A":
            value = torch.log(0.5 + torch.rand(p.shape, generator=gen))
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = 1 + 0.2 * value
        out[name] = value
    return out


def _mixer_check(tp, case_label: str, channel_slices) -> None:
    from customop.distributed import use_tp_group
    from customop.samples.mamba import BATCHES, BY_LABEL, mixer_compare
    from customop.testing import assert_close

    case, batch = BY_LABEL[case_label], BATCHES["small"][2]
    with use_tp_group(None):
        ref = case.op_class(**case.init_kwargs("small", torch.float32))
    with use_tp_group(tp):
        mine = case.op_class(**case.init_kwargs("small", torch.float32))
    for name, full in _checkpoint(ref).items():
        _load(ref, name, full)
        _load(mine, name, full)
    h, *caches, meta = case.inputs(ref, batch, torch.float32, torch.Generator().manual_seed(1))
    parts = channel_slices(ref, tp.tp_rank)  # per cache: the index of this rank's part
    local = [c[part].contiguous() for c, part in zip(caches, parts)]
    results = []
    for path in ("forward_native", "forward_cpu"):  # every rank runs both before any comparison
        ref_caches, my_caches = [c.clone() for c in caches], [c.clone() for c in local]
        results.append((path, getattr(ref, path)(h, *ref_caches, meta), getattr(mine, path)(h, *my_caches, meta),
                        ref_caches, my_caches))
    for path, want, got, ref_caches, my_caches in results:
        mixer_compare(got, want, torch.float32)
        for i, (g, w, part) in enumerate(zip(my_caches, ref_caches, parts)):
            assert_close(g, w[part], torch.float32, atol=2e-5, rtol=2e-5, what=f"{path} cache {i}")


def _half(n: int, rank: int) -> slice:
    return slice(rank * n // 2, (rank + 1) * n // 2)


def _mamba2_slices(ref, rank):
    """Rank r holds [x_r | B_r | C_r] of the conv channels (whole B and C when one group is
    replicated) and heads_r of the SSM state."""
    I, N, G = ref.intermediate_size, ref.ssm_state_size, ref.n_groups
    idx = torch.arange(I + 2 * G * N)
    x, B, C = idx[:I], idx[I:I + G * N], idx[I + G * N:]
    if G > 1:
        B, C = B[_half(G * N, rank)], C[_half(G * N, rank)]
    return [(slice(None), slice(None), torch.cat([x[_half(I, rank)], B, C])), (slice(None), _half(ref.num_heads, rank))]


def _norm_check(tp, groups: int, hidden: int = 96) -> None:
    from customop.distributed import use_tp_group
    from customop.ops.mamba import Mixer2RMSNormGated
    from customop.testing import assert_close

    with use_tp_group(None):
        ref = Mixer2RMSNormGated(hidden, groups, eps=1e-5)
    with use_tp_group(tp):
        mine = Mixer2RMSNormGated(hidden, groups, eps=1e-5)
    gen = torch.Generator().manual_seed(groups)
    weight, x, gate = 1 + 0.3 * torch.randn(hidden, generator=gen), torch.randn(5, hidden, generator=gen), \
        torch.randn(5, hidden, generator=gen)
    _load(ref, "weight", weight)
    _load(mine, "weight", weight)
    part = _half(hidden, tp.tp_rank)
    results = [(path, getattr(ref, path)(x, gate)[:, part], getattr(mine, path)(x[:, part], gate[:, part]))
               for path in ("forward_native", "forward_cpu", "forward_kernel")]
    for path, want, got in results:
        assert_close(got, want, torch.float32, what=path)


def _checks(tp):
    return {
        "mamba_mixer2[2 groups]": lambda: _mixer_check(tp, "mamba_mixer2", _mamba2_slices),
        "mamba_mixer2[1 group]": lambda: _mixer_check(tp, "mamba_mixer2[1 group]", _mamba2_slices),
        "mamba_mixer": lambda: _mixer_check(tp, "mamba_mixer", lambda ref, r: [
            (slice(None), slice(None), _half(ref.intermediate_size, r)), (slice(None), _half(ref.intermediate_size, r))]),
        "short_conv": lambda: _mixer_check(tp, "short_conv", lambda ref, r: [
            (slice(None), slice(None), _half(ref.conv_dim, r))]),
        "norm[1 group]": lambda: _norm_check(tp, 1),
        "norm[4 groups]": lambda: _norm_check(tp, 4),
        "norm[3 groups]": lambda: _norm_check(tp, 3),
    }


def main() -> int:
    from tests.distributed._launch import run_worker

    run_worker(_checks)
    return 0  # every rank reports; the parent test fails the checks that did


if __name__ == "__main__":
    sys.exit(main())
