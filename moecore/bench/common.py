"""Timing, environment and the benchmark record format shared by `moecore bench`."""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable
from types import SimpleNamespace

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


def cuda_back_to_back_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Mean milliseconds of `fn` over `iters` runs launched back to back between two CUDA events (no host wait
    in between), as a layer runs inside a model's step, where the host launches ahead of the GPU. The
    per-run `cuda_time_ms` instead starts each run from an idle GPU, so it also counts the time the GPU waits
    for the host's first launches."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def env() -> dict:
    """date, gpu and torch version for every record; on a GPU whose driver answers NVML (pynvml installed), the SM
    clock (MHz), power (W) and temperature (C) just after the measurement, which tell a throttled run apart."""
    rec = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        rec.update(gpu_state())
    return rec


def gpu_state() -> dict:
    """{"sm_clock_mhz", "power_w", "temp_c"} of the current GPU, each left out where NVML cannot say."""
    state = {}
    for key, read, scale in (
        ("sm_clock_mhz", torch.cuda.clock_rate, 1),
        ("power_w", torch.cuda.power_draw, 1e-3),  # NVML reports milliwatts
        ("temp_c", torch.cuda.temperature, 1),
    ):
        try:
            state[key] = round(read() * scale)
        except Exception:  # no pynvml, or a driver without the query
            continue
    return state


def dense_bf16_tflops(n: int = 8192, iters: int = 20) -> float:
    """The dense bf16 matmul rate of this GPU (n x n x n, random data): the MFU denominator."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, 3, iters)
    return 2 * n**3 / ms / 1e9


def copy_tbps(gib: float = 4.0, iters: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, TB/s): the memory-bound ceiling."""
    n = int(gib * 2**30) // 4
    a = torch.empty(n, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    ms = cuda_time_ms(lambda: b.copy_(a), 3, iters)
    return 2 * a.numel() * 4 / ms / 1e9


def record(shape: str, impl: str, ms: float | None, flops: float | None, peak_gb: float | None, **extra) -> dict:
    rec = {"shape": shape, "impl": impl, "tflops": None, "ms": None, "peak_mem_gb": None}
    if ms is not None:
        rec["ms"] = round(ms, 3)
        if flops:
            rec["tflops"] = round(flops / ms / 1e9, 1)
    if peak_gb is not None:
        rec["peak_mem_gb"] = round(peak_gb, 3)
    rec.update(extra)
    rec.update(env())
    return rec


def phase_of(kernel: str, phases: tuple) -> str:
    """The first phase whose name substrings occur in the lower-cased kernel name, else "other"."""
    name = kernel.lower()
    return next((ph for ph, keys in phases if any(k in name for k in keys)), "other")


def kernel_rows(prof, steps: int, phases: tuple) -> list[dict]:
    """Per CUDA kernel of a finished torch.profiler run over `steps` steps: name, ms and launches per
    step, phase; the longest first."""
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us:
            rows.append(
                {
                    "kernel": ev.key,
                    "ms": us / 1e3 / steps,
                    "calls": ev.count // steps,
                    "phase": phase_of(ev.key, phases),
                }
            )
    return sorted(rows, key=lambda r: -r["ms"])


def profile_gpu_ms(step: Callable[[], object], phases: tuple, steps: int = 3, top: list | None = None) -> dict:
    """GPU milliseconds per call of `step`, summed by phase over the CUDA kernels (torch.profiler).

    `phases`: ((phase, substrings of lower-cased kernel names), ...), first match wins; the rest is
    "other". Adds "wall" (CUDA-event time per step) and "GPU idle" (wall minus the summed kernel time:
    launch overhead and host syncs). A list given as `top` receives the 20 kernels that took longest
    (`kernel_rows`' rows, milliseconds per step rounded).
    """
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    rows = kernel_rows(prof, steps, phases)
    for row in rows:
        out[row["phase"]] = out.get(row["phase"], 0.0) + row["ms"]
    if top is not None:
        top.extend({**r, "kernel": r["kernel"][:100], "ms": round(r["ms"], 3)} for r in rows[:20])
    wall = start.elapsed_time(end) / steps
    busy = sum(out.values())
    out = {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}
    out["wall"] = round(wall, 3)
    out["GPU idle"] = round(max(wall - busy, 0.0), 3)
    return out


def chrome_trace(step: Callable[[], object], path: str) -> None:
    """One call of `step` under torch.profiler (CPU ops and CUDA kernels), written gzipped as a Chrome trace.

    What it is for: where the GPU waits (gaps between kernels) and which host op launched the kernel
    after each gap; open it in chrome://tracing or Perfetto.
    """
    import gzip
    import os
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def print_table(records: list[dict]) -> None:
    """One line per record: shape, impl, TFLOP/s, ms, peak GB (+ tokens/s and MFU where present)."""
    cols = [
        "shape",
        "routing",
        "impl",
        "tflops",
        "ms",
        "ms_back_to_back",
        "peak_mem_gb",
        "tokens_per_s",
        "mfu",
        "error",
    ]
    cols = [c for c in cols if any(r.get(c) is not None for r in records)]
    rows = [[("" if r.get(c) is None else str(r.get(c)))[:60] for c in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


FFN_SHAPES = {  # expert-FFN benchmarks (benchmarks/gemm_strategy.py, grouped_gemm_tiles.py): H, F, E, top-k, tokens
    "qwen3_30b_a3b": (2048, 768, 128, 8, 16384),
    "mixtral_8x7b": (4096, 14336, 8, 2, 16384),
    "deepseek_v3": (7168, 2048, 256, 8, 8192),
    "qwen3_next_80b": (2048, 512, 512, 10, 16384),
    # two more for rules fitted on the four above (grouped_gemm_tiles.py --quack; not in the scripts' defaults)
    "qwen3_235b_a22b": (4096, 1536, 128, 8, 16384),
    "kimi_k2": (7168, 2048, 384, 8, 8192),
}
DEFAULT_FFN_SHAPES = ("qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3", "qwen3_next_80b")


def expert_ffn_problem(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """Random top-k routing at an `FFN_SHAPES` shape and random operands of each expert-FFN GEMM.

    Fields: H, F, E, K, T, M (= T * K routed rows), idx [T, K], perm (the permutation), counts [E],
    bounds [E + 1] (int32 row offsets), x [T, H] tokens, xs [M, H] expert-sorted rows, w13 [E, 2F, H],
    w2 [E, H, F], h [M, 2F] (FC1 output, or its gradient), a [M, F] (activation), dy [M, H], p [M].
    """
    from moecore.kernels.grouped_gemm import group_bounds
    from moecore.kernels.permute import make_permutation

    H, F, E, K, T = FFN_SHAPES[name]
    torch.manual_seed(0)
    idx = torch.randn(T, E, device=device).topk(K, dim=-1).indices
    perm = make_permutation(idx, E)
    M = T * K

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    return SimpleNamespace(
        H=H, F=F, E=E, K=K, T=T, M=M, idx=idx, perm=perm, counts=perm.counts_E, bounds=group_bounds(perm.counts_E),
        x=rand(T, H), xs=rand(M, H), w13=rand(E, 2 * F, H, scale=0.02), w2=rand(E, H, F, scale=0.02),
        h=rand(M, 2 * F), a=rand(M, F), dy=rand(M, H), p=torch.rand(M, device=device),
    )  # fmt: skip
