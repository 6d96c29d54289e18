"""End to end: a Hugging Face Llama with and without ``customop.integrations.transformers.patch``.

    python -m benchmarks.transformers_e2e                      # H200, bf16: the issue-19 table
    python -m benchmarks.transformers_e2e --out benchmarks/results/transformers_e2e_h200.md
    python -m benchmarks.transformers_e2e --tiny               # a smoke run on CPU (times mean nothing)

The model is Llama-3-8B-shaped with 2 layers (hidden 4096, intermediate 14336, 32 query / 8 KV
heads of 128, vocab 128256, rope theta 500000), random weights, sdpa attention. Four variants:

- ``eager``: transformers as it is;
- ``patched``: after ``patch(model)`` (the report's replacements are printed);
- ``compiled`` / ``compiled+patched``: ``torch.compile(model, dynamic=False)`` of each.

Timed, per variant:

- prefill: one forward of ``--prefill`` tokens (batch 1, no cache, ``logits_to_keep=1`` as
  ``generate`` does), CUDA events, median of ``--reps``;
- decode at each ``--decode-batches``: one token per sequence against a ``StaticCache`` holding
  ``--context`` tokens; the step is captured in a CUDA graph (``--no-graphs`` to skip; a variant
  whose capture fails is timed without one and marked), ``--steps`` replays between two events,
  median of ``--reps``. Hugging Face's static cache advances its own length on every step, so the
  length is reset to ``--context`` before each timed run (outside the graph).

The table gives milliseconds and the speedup over ``eager`` in each column.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

LLAMA3_8B_2L = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, num_hidden_layers=2, vocab_size=128256, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, vocab_size=128, max_position_embeddings=256)
VARIANTS = ("eager", "patched", "compiled", "compiled+patched")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke run): hidden 64, 2 layers")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 4096; --tiny: 32)")
    p.add_argument("--decode-batches", default=None, help="comma-separated (default 1,64; --tiny: 1,4)")
    p.add_argument("--context", type=int, default=None, help="tokens in the cache when decoding (default 1024)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed run (default 20)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per number (default 10; --tiny: 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    p.add_argument("--no-graphs", action="store_true", help="time decode steps without CUDA graphs")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.prefill = args.prefill or (32 if tiny else 4096)
    args.decode_batches = [int(b) for b in (args.decode_batches or ("1,4" if tiny else "1,64")).split(",")]
    args.context = args.context or (16 if tiny else 1024)
    args.steps = args.steps or (3 if tiny else 20)
    args.reps = args.reps or (2 if tiny else 10)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    args.graphs = args.device.startswith("cuda") and not args.no_graphs
    return args


# ---- timing -------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, reps: int, calls: int = 1,
            before: Callable[[], None] | None = None) -> float:
    """Median over ``reps`` of the time of ``calls`` back-to-back calls of ``fn``, per call (ms);
    ``before`` runs untimed before each rep. CUDA events on GPUs, the wall clock on CPUs."""
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        _sync(device)
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples)


# ---- the model ----------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, dtype: torch.dtype):
    import transformers

    shape = dict(TINY if args.tiny else LLAMA3_8B_2L)
    theta = shape.pop("rope_theta", 10000.0)
    config = transformers.LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": theta})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _reset_cache(cache, length: int) -> None:
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def _new_cache(model, batch: int, args: argparse.Namespace, dtype: torch.dtype):
    import transformers

    config = model.config
    # room for the warm-up and the timed steps past the context (the length is reset before each run)
    cache = transformers.StaticCache(config=config, max_cache_len=args.context + 4 * args.steps + 16)
    cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads,
                               head_dim=config.head_dim, dtype=dtype, device=torch.device(args.device))
    return cache


def bench_prefill(model, fn: Callable, args: argparse.Namespace) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, args.prefill), device=args.device)

    def step():
        return fn(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    for _ in range(2):  # warm-up (compiles the compiled variants)
        step()
    return time_ms(step, args.device, args.reps)


def bench_decode(model, fn: Callable, batch: int, args: argparse.Namespace, dtype: torch.dtype) -> tuple[float, str]:
    """ms per decode step and how it ran ('graph', or 'no graph: <why>')."""
    cache = _new_cache(model, batch, args, dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=args.device)

    def step():
        return fn(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits

    def reset():
        _reset_cache(cache, args.context)

    reset()
    how = "eager steps"
    if args.graphs:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up off the default stream, as capture requires
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            reset()
            return time_ms(graph.replay, args.device, args.reps, calls=args.steps, before=reset), "graph"
        except Exception as err:  # noqa: BLE001  (reported in the table, timed without a graph)
            how = f"no graph: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            torch.cuda.synchronize()
            reset()
    for _ in range(3):
        step()
    return time_ms(step, args.device, args.reps, calls=args.steps, before=reset), how


# ---- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    from customop import current_platform
    from customop.integrations.transformers import patch, unpatch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = build_model(args, dtype)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# transformers end to end: {'tiny Llama' if args.tiny else 'Llama-3-8B shape, 2 layers'}, "
          f"{args.dtype}, {device_name}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, customop platform "
          f"{current_platform.name}; prefill {args.prefill} tokens; decode with {args.context} tokens cached, "
          f"{args.steps} steps per run, {'CUDA graphs' if args.graphs else 'no CUDA graphs'}; median of {args.reps}\n")

    columns = [f"prefill {args.prefill}"] + [f"decode b={b}" for b in args.decode_batches]
    results: dict[str, list[float]] = {}
    notes: list[str] = []
    for variant in args.variants:
        torch._dynamo.reset()
        if "patched" in variant:
            report = patch(model)
            if not notes or not notes[0].startswith("patch replaced"):
                paths = sorted({v for v in report.values()})
                notes.insert(0, f"patch replaced {len(report)} modules: " + "; ".join(paths))
        fn = torch.compile(model, dynamic=False) if variant.startswith("compiled") else model
        with torch.no_grad():
            t0 = time.perf_counter()
            row = [bench_prefill(model, fn, args)]
            for batch in args.decode_batches:
                ms, how = bench_decode(model, fn, batch, args, dtype)
                row.append(ms)
                if how not in ("graph", "eager steps"):
                    notes.append(f"{variant} decode b={batch}: {how}")
        results[variant] = row
        print(f"  {variant}: " + ", ".join(f"{c} {v:.3f} ms" for c, v in zip(columns, row))
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        if "patched" in variant:
            unpatch(model)

    base = results.get("eager")
    lines = ["| variant | " + " | ".join(f"{c} (ms)" for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for variant, row in results.items():
        cells = [f"{v:.3f}" + (f" ({base[i] / v:.2f}x)" if base and variant != "eager" else "")
                 for i, v in enumerate(row)]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    if "compiled" in results and "compiled+patched" in results:
        ratio = [a / b for a, b in zip(results["compiled"], results["compiled+patched"])]
        lines.append("")
        lines.append("compiled+patched over compiled: " + ", ".join(f"{c} {r:.2f}x" for c, r in zip(columns, ratio)))
    table = "\n".join(lines + [""] + [f"- {n}" for n in notes])
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
