"""Tensor-parallel MLP at Llama-3-8B sizes: column-parallel gate/up, SiLU-and-mul, row-parallel down.

    torchrun --nproc-per-node 2 benchmarks/tp_mlp_bench.py --out benchmarks/results/tp_mlp_h200.md
    torchrun --nproc-per-node 2 benchmarks/tp_mlp_bench.py --device cpu --hidden 256 \\
        --intermediate 512 --tokens 1,16 --iters 3             # a smoke run on CPU (gloo)

For each token count it times the MLP at tp 1 (rank 0 alone, the others wait) and at tp = world
size: ``MergedColumnParallelLinear(hidden, [inter, inter])`` -> ``silu(gate) * up`` ->
``RowParallelLinear(inter, hidden)`` whose all-reduce is the only communication. Reported:

- time per forward (median of ``--reps`` timings of ``--iters`` back-to-back calls), CUDA events on
  GPUs; optionally replayed from a CUDA graph (``--graph``; NCCL kernels are capturable), which
  removes launch overhead for decode-sized batches;
- TFLOP/s: ``6 * tokens * hidden * inter`` FLOPs (gate, up and down GEMMs) over the time, in total
  and per GPU;
- the all-reduce alone: the same ``[tokens, hidden]`` all-reduce timed the same way, and its share
  of the tp-N forward.

On CUDA the NVLink-multicast paths stay off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1; issue 8). Weights are random: this measures speed, examples/tp_mlp.py
and tests/distributed check correctness.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from customop.distributed import TPGroup, init_from_torchrun, init_tp_group, use_tp_group
from customop.ops.linear import MergedColumnParallelLinear, RowParallelLinear

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_TOKENS = "1,16,64,256,1024,4096,8192"




class Mlp:
    """The Llama MLP on one TP group, with random weights made directly on the device."""

    def __init__(self, tp: TPGroup, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
        with use_tp_group(tp), torch.device(device):
            self.gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, params_dtype=dtype)
            self.down = RowParallelLinear(inter, hidden, bias=False, params_dtype=dtype)
        for p in (self.gate_up.weight, self.down.weight):
            p.data.normal_(0.0, p.shape[1] ** -0.5)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)[0].chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)[0]


def timer(device: torch.device, graph: bool) -> Callable[[Callable[[], object], int, int], float]:
    """Returns ``time(fn, iters, reps)`` -> median seconds per call."""

    def time_cpu(fn, iters, reps):
        fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - start) / iters)
        return statistics.median(samples)

    def time_cuda(fn, iters, reps):
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture stream, as capture requires
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        else:
            run = fn
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(samples)

    return time_cuda if device.type == "cuda" else time_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated token counts")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20, help="calls per timing")
    parser.add_argument("--reps", type=int, default=7, help="timings; the median is reported")
    parser.add_argument("--graph", action="store_true", help="replay each forward from a CUDA graph")
    parser.add_argument("--out", help="also write the markdown table here (rank 0)")
    args = parser.parse_args()

    device, dtype = init_from_torchrun("nccl" if args.device == "cuda" else "gloo"), DTYPES[args.dtype]
    world = init_tp_group()
    rank0 = world.tp_rank == 0
    measure = timer(device, args.graph and device.type == "cuda")
    single = TPGroup()  # tp 1: rank 0 alone, no collectives
    mlps = {1: Mlp(single, args.hidden, args.intermediate, dtype, device) if rank0 else None}
    if world.tp_size > 1:
        mlps[world.tp_size] = Mlp(world, args.hidden, args.intermediate, dtype, device)

    rows = []
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
            flops = 6 * tokens * args.hidden * args.intermediate
            times: dict[int, float] = {}
            if rank0:
                times[1] = measure(lambda: mlps[1](x), args.iters, args.reps)
            dist.barrier()
            if world.tp_size > 1:
                times[world.tp_size] = measure(lambda: mlps[world.tp_size](x), args.iters, args.reps)
                # zeros: stays finite however often it is summed in place
                buf = torch.zeros(tokens, args.hidden, device=device, dtype=dtype)
                t_ar = measure(lambda: world.all_reduce(buf), args.iters, args.reps)
            dist.barrier()
            for tp, t in sorted(times.items()):
                ar = f"{t_ar * 1e6:.1f} | {t_ar / t:.0%}" if tp > 1 else "- | -"
                speedup = times[1] / t if 1 in times else float("nan")
                rows.append(f"| {tokens} | {tp} | {t * 1e6:.1f} | {flops / t / 1e12:.2f} | "
                            f"{flops / t / tp / 1e12:.2f} | {ar} | {speedup:.2f}x |")

    if rank0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        header = [f"TP MLP (gate/up column-parallel, SiLU-and-mul, down row-parallel), hidden {args.hidden}, "
                  f"intermediate {args.intermediate}, {args.dtype}, {world.tp_size} x {name}, "
                  f"backend {dist.get_backend()}, torch {torch.__version__}, {datetime.date.today()}, "
                  f"{'CUDA graphs' if args.graph and device.type == 'cuda' else 'eager'}",
                  "",
                  "| tokens | tp | time us | TFLOP/s total | TFLOP/s per GPU | all-reduce us | all-reduce share | "
                  "speedup vs tp1 |",
                  "|---|---|---|---|---|---|---|---|"]
        table = "\n".join(header + rows)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
