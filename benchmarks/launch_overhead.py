"""Host time per launch: moecore's Triton grouped GEMM, its parts, and the torch calls it competes with.

Usage (GPU): PYTHONPATH=. python benchmarks/launch_overhead.py [--json OUT]

Where a GPU's work is small (a chunk of `moe.activation_memory=chunked`, a small model's step, FP8's many
quantisation launches) the host's time to issue a kernel, not the kernel, sets the pace. This script issues each
call 100 times on a problem too small to keep the GPU busy (2048 rows, 6 experts, K 2048, N 1024) without
synchronising, and reports the host's microseconds per call (time until the last call returns) and the wall
microseconds per call once the GPU has finished. Cases: an empty Triton kernel (the floor of a Triton launch),
the tile-start table the grouped GEMM computes from the expert bounds (`grouped_gemm.tile_starts`, one Triton
launch; `tile_starts_reference`, the torch operations it replaced), two TMA descriptors, the grouped-GEMM kernel
launched with prepared arguments, the whole `grouped_mm` call, `torch._grouped_mm`, `torch.mm` and a torch add;
with the `quack` extra on Hopper, QuACK's grouped GEMM launched with a fixed tile and the whole
`quack_gemm.grouped_mm` call (its tile already chosen).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moecore.bench.common import env
from moecore.kernels import grouped_gemm as gg
from moecore.kernels import quack_gemm


def _host_us(fn, calls: int = 100) -> tuple[float, float]:
    """(host us per call, wall us per call until the GPU is done) over `calls` unsynchronised calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / calls * 1e6


def cases() -> list[tuple[str, object]]:
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr):
        tl.store(x_ptr, 1.0)

    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(6, 1024, 2048, device=dev, dtype=torch.bfloat16)
    bounds = gg.group_bounds(torch.tensor([341] * 5 + [343], device=dev, dtype=torch.int32))
    cfg = gg.tiles_for("fwd2", a)
    starts = gg.tile_starts(bounds, cfg.block_m)
    out = torch.empty(2048, 1024, device=dev, dtype=torch.bfloat16)
    w2d = w.view(-1, 2048)
    a_desc, b_desc = gg._descriptor(a, [cfg.block_m, cfg.block_k]), gg._descriptor(w2d, [cfg.block_n, cfg.block_k])
    programs = gg._programs(dev, 0, cfg)

    def kernel_only():
        gg._grouped_mm_kernel[(programs,)](
            a, w, out, out, out, a_desc, b_desc, bounds, starts, 6, 1024, 2048,
            a.stride(0), w.stride(0), w.stride(2), w.stride(1), out.stride(0),
            TRANS_B=True, USE_TMA=True, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, NUM_PROGRAMS=programs, SEARCH_STEPS=3, FLATTEN=cfg.flatten,
            WARP_SPECIALIZE=cfg.warp_specialize, SCALED=False, IMPRECISE_ACC=None,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip

    found = [
        ("empty Triton kernel", lambda: _empty[(1,)](out)),
        ("tile_starts (one Triton launch)", lambda: gg.tile_starts(bounds, cfg.block_m)),
        ("tile_starts_reference (torch ops)", lambda: gg.tile_starts_reference(bounds, cfg.block_m)),
        ("two TMA descriptors", lambda: (gg._descriptor(a, [128, 64]), gg._descriptor(w2d, [256, 64]))),
        ("grouped GEMM kernel, prepared arguments", kernel_only),
        ("grouped_mm (the whole call)", lambda: gg.grouped_mm(a, w, bounds, True, cfg)),
        ("torch._grouped_mm", lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=bounds[1:])),
        ("torch.mm", lambda: torch.mm(a, out)),
        ("torch add", lambda: a.add(1)),
    ]
    if quack_gemm.quack_available(dev):
        b_ekn = w.transpose(1, 2)
        found += [
            (
                "QuACK grouped GEMM, 128x256 tile",
                lambda: quack_gemm.launch(a, b_ekn, out, "128x256", cu_seqlens_m=bounds),
            ),
            ("quack_gemm.grouped_mm (the whole call)", lambda: quack_gemm.grouped_mm(a, w, bounds, True, "fwd2")),
        ]
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the records here")
    args = p.parse_args()
    records = []
    for name, fn in cases():
        host, wall = _host_us(fn)
        records.append({"case": name, "host_us": round(host, 1), "wall_us": round(wall, 1), **env()})
        print(f"{name:45s} host {host:7.1f} us   wall {wall:7.1f} us per call", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
