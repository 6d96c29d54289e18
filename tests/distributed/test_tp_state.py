"""The tensor-parallel state in one process: the tp-1 default, scoping, and clear errors when
torch.distributed is not set up (the 2-rank mismatch errors run in test_tp_layers)."""

import pytest
import torch
import torch.distributed as dist

from customop import distributed as cd
from customop.ops.linear import ColumnParallelLinear


@pytest.fixture(autouse=True)
def _no_process_group():
    if dist.is_initialized():
        pytest.skip("needs a process without a default process group")
    previous = cd.set_tp_group(None)
    yield
    cd.set_tp_group(previous)


def test_single_process_default_needs_no_setup():
    tp = cd.get_tp_group()
    assert (tp.tp_rank, tp.tp_size, tp.group) == (0, 1, None)
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x and tp.all_gather(x, 0) is x and tp.gather(x) is x
    assert cd.tensor_model_parallel_all_reduce(x) is x
    assert cd.tensor_model_parallel_all_gather(x) is x and cd.tensor_model_parallel_gather(x) is x
    layer = ColumnParallelLinear(4, 6)
    assert layer.tp_size == 1 and layer.weight.shape == (6, 4)


def test_uninitialised_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised.*init_process_group"):
        cd.init_tp_group()
    with pytest.raises(RuntimeError, match="not initialised"):
        cd.init_tp_group(object())
    with pytest.raises(RuntimeError, match="not initialised"):
        with cd.use_tp_group(object()):
            pass
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        cd.TPGroup(tp_rank=0, tp_size=1, group=object())
    assert cd.get_tp_group().tp_size == 1  # a failed init leaves the default in place


@pytest.mark.parametrize("rank,size,match", [(2, 2, "not in"), (-1, 1, "not in"), (0, 0, "not in"),
                                             (1, 2, "needs a torch.distributed process group")])
def test_inconsistent_state_is_rejected(rank, size, match):
    with pytest.raises(ValueError, match=match):
        cd.TPGroup(tp_rank=rank, tp_size=size)


def test_state_is_frozen_and_scoped():
    tp = cd.TPGroup()
    with pytest.raises(Exception):
        tp.tp_size = 2
    with cd.use_tp_group(tp) as inner:
        assert cd.get_tp_group() is inner is tp
    assert cd.get_tp_group() == cd.TPGroup()
    assert cd.set_tp_group(tp) == cd.TPGroup() and cd.get_tp_group() is tp
