"""A two-layer tensor-parallel MLP: ColumnParallelLinear -> GELU -> RowParallelLinear.

    torchrun --nproc-per-node 2 examples/tp_mlp.py                 # gloo on CPU, nccl on GPUs
    torchrun --nproc-per-node 2 examples/tp_mlp.py --dtype bf16 --tokens 64

Every rank builds the same full weights (one seed: the "checkpoint"), loads its shard through the
layers' ``weight_loader``, runs the MLP, and compares the result with the tp-1 computation on the
full weights (float64). The column layer's output stays sharded (no gather): the GELU is
elementwise, so each rank applies it to its own slice and the row layer's all-reduce is the only
communication. Rank 0 prints the max error; the exit code is 1 if it exceeds the dtype's bound.

On hosts where the hostname does not resolve to a loopback address, add ``GLOO_SOCKET_IFNAME=lo``
for a CPU run. For NCCL the NVLink-multicast paths are switched off (issue 8).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from customop.distributed import init_from_torchrun, init_tp_group
from customop.ops.linear import ColumnParallelLinear, RowParallelLinear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Max abs error allowed against the float64 result (outputs are O(1)): a few output-dtype ulps.
BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}




def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]

    device = init_from_torchrun()
    tp = init_tp_group()  # the whole world is one tensor-parallel group

    # The full checkpoint, identical on every rank (same seed).
    gen = torch.Generator().manual_seed(0)
    h, i = args.hidden, args.intermediate
    w_up, b_up = torch.randn(i, h, generator=gen) * h ** -0.5, torch.randn(i, generator=gen) * 0.1
    w_down, b_down = torch.randn(h, i, generator=gen) * i ** -0.5, torch.randn(h, generator=gen) * 0.1
    x = torch.randn(args.tokens, h, generator=gen)

    with torch.device(device):
        up = ColumnParallelLinear(h, i, params_dtype=dtype)  # rank r: rows [r*i/tp, (r+1)*i/tp)
        down = RowParallelLinear(i, h, params_dtype=dtype)    # columns of the same range
    for layer, weight, bias in ((up, w_up, b_up), (down, w_down, b_down)):
        layer.weight.weight_loader(layer.weight, weight.to(dtype))  # full tensor in, this rank's shard kept
        layer.bias.weight_loader(layer.bias, bias.to(dtype))

    with torch.inference_mode():
        hidden, _ = up(x.to(device, dtype))           # [tokens, i/tp], sharded
        out, _ = down(F.gelu(hidden))                 # all-reduce: [tokens, h] on every rank

    # tp-1 reference: the same MLP on the full (dtype-rounded) weights, in float64.
    def full64(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).double()

    ref = F.linear(F.gelu(F.linear(full64(x), full64(w_up), full64(b_up))), full64(w_down), full64(b_down))
    err = torch.tensor((out.double().cpu() - ref).abs().max().item(), device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)  # the worst rank decides

    ok = err.item() <= BOUNDS[dtype]
    if tp.tp_rank == 0:
        print(f"tp_size={tp.tp_size} backend={dist.get_backend()} device={device.type} dtype={args.dtype} "
              f"tokens={args.tokens} hidden={h} intermediate={i}")
        print(f"  column shard {tuple(up.weight.shape)}, row shard {tuple(down.weight.shape)} per rank")
        print(f"  max |tp{tp.tp_size} - tp1 reference| = {err.item():.3e} (bound {BOUNDS[dtype]:.0e}): "
              f"{'OK' if ok else 'FAIL'}")
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
