"""The GPU runner's timers (runner.py's docstring says which one times what, and why).

- ``time_graph``: GRAPH_CALLS calls in one CUDA graph, replays queued behind a device sleep;
  no host time can enter a timed region. The default at every size; ``warm_up_graph_timer``
  first, once a process.
- ``time_queued``: do_bench's method (256 MB L2 flush, events around each call) with the calls
  queued behind a device sleep sized from the measured launch cost.
- ``time_do_bench``: triton's do_bench, which times host launch gaps when the launch path is
  slower than the flush.
"""

from __future__ import annotations

import statistics
import time

import torch

#: calls captured per CUDA graph
GRAPH_CALLS = 20


def time_do_bench(fn) -> float:
    """triton's do_bench (median, L2 flushed before each call). Its timed region starts when the
    device reaches the start event; if the host takes longer to launch ``fn`` than the device takes
    to run the 256 MB flush before it (~70 us), the device waits inside the timed region and the
    number is the host's launch time, not the kernel's. Kept for ``--timer do_bench``."""
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


_FLUSH: list[torch.Tensor] = []
_SLEEP_CYCLES_PER_MS: list[float] = []


def _flush_buffer() -> torch.Tensor:
    if not _FLUSH:  # what do_bench flushes with: 256 MB, four times the H200's L2
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    return _FLUSH[0]


def _device_sleep(ms: float) -> None:
    """Holds the current stream for about ``ms`` (a spin kernel), so what is queued after it
    waits for the device, not for the host."""
    if not _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS.append(2_000_000 / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(max(1, int(ms * _SLEEP_CYCLES_PER_MS[0])))


def time_queued(fn, entry: dict | None = None, rep_ms: float = 30.0, max_calls: int = 250) -> float:
    """us per call, do_bench's way (L2 flushed before every call, events around each call,
    median) but with the calls queued behind a device sleep long enough that the host has
    enqueued them before the device gets to them: the device never waits for the host inside a
    timed region, so the number is the kernels' time whatever the implementation's launch cost
    in Python, as long as the host keeps the pace it had while the sleep was sized (on the H200 it
    did not always: phases of 2-5x slower numbers remained, hence the graph timer by default).
    ``entry["host_us"]`` gets that launch cost (host time per flush + call)."""
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    flush = _flush_buffer()
    fn()
    torch.cuda.synchronize()
    _device_sleep(20.0)
    start, end = ev(), ev()
    t0 = time.perf_counter()
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / 5
    torch.cuda.synchronize()
    device_ms = start.elapsed_time(end) / 5  # flush + call
    n = int(max(10, min(max_calls, rep_ms / max(device_ms, 1e-3))))
    starts, ends = [ev() for _ in range(n)], [ev() for _ in range(n)]
    # the device finishes call i at sleep + i * device_ms, the host enqueues it at i * host_ms
    _device_sleep(min(3000.0, 1.5 * n * max(0.0, host_ms - device_ms) + 2.0))
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    if entry is not None:
        entry["host_us"] = host_ms * 1e3
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def warm_up_graph_timer(rounds: int = 3) -> None:
    """Throwaway ``time_graph`` runs of a small copy. The first graph timing of a process reads
    10-12% fast (H200, 2026-12-03: rms_norm 1 x 4096 1.405 us, then 1.578-1.598 in seven more
    timings of that process, the SM clock at 1980 MHz throughout; the same after two seconds of
    matrix products, and gone after two seconds of graph timings): the runner spends it here,
    not on its first row."""
    src = torch.randn(1 << 16, device="cuda")
    dst = [torch.empty_like(src) for _ in range(2)]
    for _ in range(rounds):
        time_graph([lambda d=d: d.copy_(src) for d in dst], keep_outputs=False)


def time_graph(fns: list, replays: int = 60, budget_ms: float = 25.0, keep_outputs: bool = True) -> float:
    """us per call: GRAPH_CALLS calls (cycling over ``fns``) captured in one CUDA graph, replayed
    (as many times as fit ``budget_ms``, 5 to ``replays``), median replay time / GRAPH_CALLS. The
    replays are queued behind a device sleep, so the host's launch time never shows.

    ``keep_outputs``: call i's outputs stay alive until call i + len(fns), so each input set has
    its own output buffers, as an in-place op writes into its own input set. Dropped at once, every
    call's fresh outputs would land on one buffer that never leaves the L2, and only in-place ops
    (the fused adds, which write x and the residual back) would pay for their writes reaching
    HBM. ``False`` is the method of the runs up to 2026-12-03 (``--reuse-outputs``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation, allocator) off the capture
        for fn in fns[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    held: list = [None] * len(fns)
    with torch.cuda.graph(graph):
        for k in range(GRAPH_CALLS):
            i = k % len(fns)
            held[i] = None  # set i's previous outputs go back to the pool; this call takes them
            if keep_outputs:
                held[i] = fns[i]()
            else:
                fns[i]()
    del held
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(5, min(replays, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    _device_sleep(2.0 + 0.2 * replays)
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    del graph
    return statistics.median(times) * 1e3 / GRAPH_CALLS
