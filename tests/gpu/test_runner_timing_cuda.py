"""The benchmark runner's graph timer: where each captured call's outputs land.

With ``keep_outputs`` every input set gets its own output buffer (so fresh outputs leave the L2
as an in-place op's writes do); without it every call writes the same buffer.
"""

import pytest
import torch

from customop.benchmarks.runner_timing import GRAPH_CALLS, time_graph

pytestmark = pytest.mark.cuda


def _recording_fns(sets: int, addresses: list[int]) -> list:
    inputs = [torch.randn(4096, device="cuda") for _ in range(sets)]

    def call(x):
        out = x * 2.0
        if torch.cuda.is_current_stream_capturing():
            addresses.append(out.data_ptr())
        return out

    return [lambda x=x: call(x) for x in inputs]


@pytest.mark.parametrize("sets", [1, 3, 7])
def test_keep_outputs_gives_each_input_set_its_own_buffer(sets):
    addresses: list[int] = []
    assert time_graph(_recording_fns(sets, addresses), replays=5, keep_outputs=True) > 0
    assert len(addresses) == GRAPH_CALLS
    assert len(set(addresses)) == sets
    # call k and call k + sets (same input set) share their buffer
    assert all(addresses[k] == addresses[k + sets] for k in range(GRAPH_CALLS - sets))


def test_reused_outputs_share_one_buffer():
    addresses: list[int] = []
    assert time_graph(_recording_fns(5, addresses), replays=5, keep_outputs=False) > 0
    assert len(set(addresses)) == 1
