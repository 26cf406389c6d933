"""Timing, environment and the benchmark record format shared by `moecore bench`."""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable

import torch


def cuda_time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of `fn` over `iters` runs, each between two CUDA events, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def env() -> dict:
    """date, gpu and torch version for every record."""
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }


def dense_bf16_tflops(n: int = 8192, iters: int = 20) -> float:
    """The dense bf16 matmul rate of this GPU (n x n x n, random data): the MFU denominator."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, 3, iters)
    return 2 * n**3 / ms / 1e9


def record(shape: str, impl: str, ms: float | None, flops: float | None, peak_gb: float | None, **extra) -> dict:
    rec = {"shape": shape, "impl": impl, "tflops": None, "ms": None, "peak_mem_gb": None}
    if ms is not None:
        rec["ms"] = round(ms, 3)
        if flops:
            rec["tflops"] = round(flops / ms / 1e9, 1)
    if peak_gb is not None:
        rec["peak_mem_gb"] = round(peak_gb, 2)
    rec.update(extra)
    rec.update(env())
    return rec


def print_table(records: list[dict]) -> None:
    """One line per record: shape, impl, TFLOP/s, ms, peak GB (+ tokens/s and MFU where present)."""
    cols = ["shape", "impl", "tflops", "ms", "peak_mem_gb", "tokens_per_s", "mfu", "error"]
    cols = [c for c in cols if any(r.get(c) is not None for r in records)]
    rows = [[("" if r.get(c) is None else str(r.get(c)))[:60] for c in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
