"""Tile configurations of moecore's Triton grouped GEMMs against torch._grouped_mm, per GEMM of the expert FFN.

For each MoE-layer shape (random top-k routing, bf16): the six GEMMs of the expert FFN (forward w13 / w2, data
gradients through w2 / w13, weight gradients of w13 / w2) with torch._grouped_mm and with
`moecore.kernels.grouped_gemm` under every TileConfig of the sweep; each kernel output is checked against
torch's (relative Frobenius error). Prints one JSON line per measurement and writes them all to --json.
The best configuration per shape and GEMM is what `moecore.kernels.grouped_ffn.TRITON_TILES` records.

    python benchmarks/grouped_gemm_tiles.py --json OUT.json [--shapes qwen3_next_80b,...] [--mm-tiles ...] [--schedules G,P,PT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time

import torch

from moecore.bench.common import FFN_SHAPES as SHAPES
from moecore.bench.common import cuda_time_ms, expert_ffn_problem
from moecore.kernels.grouped_gemm import TileConfig, grouped_mm, grouped_wgrad

MM_TILES = "128x128x64w4s4g8,128x128x64w8s3g8,128x256x64w8s3g8,64x128x64w4s4g8,64x256x64w8s3g8"
WGRAD_TILES = "128x128x64w8s3g8,128x128x64w4s4g8,128x256x64w8s3g8,256x128x64w8s3g8,64x128x64w4s4g8"
SCHEDULES = "G,P,PT,GT"  # G one tile per program, P persistent; T TMA loads, F flattened loop, W warp-specialised


def configs(tiles: str, schedules: str) -> list[TileConfig]:
    """Every tile (BMxBNxBKwWARPSsSTAGESgGROUP) under every schedule letter string."""
    out = []
    for tile, sched in itertools.product(tiles.split(","), schedules.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)g(\d+)", tile)
        if m is None:
            raise SystemExit(f"--tiles: {tile!r} is not BMxBNxBKwWsSgG (e.g. 128x256x64w8s3g8)")
        bm, bn, bk, w, st, g = map(int, m.groups())
        out.append(TileConfig(bm, bn, bk, g, w, st, "P" in sched, "T" in sched, "F" in sched, "W" in sched))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error, accumulated over slices of the leading dimension (the outputs reach 15 GB)."""
    num = den = 0.0
    step = 4096 if a.dim() == 2 else 8
    for i in range(0, a.shape[0], step):
        x, y = a[i : i + step].float(), b[i : i + step].float()
        num += (x - y).square().sum().item()
        den += y.square().sum().item()
    return (num / max(den, 1e-30)) ** 0.5


def run_shape(name: str, mm_cfgs: list, wgrad_cfgs: list, kinds: set | None, emit) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    pb = expert_ffn_problem(name, dev, dt)
    M, H, Fd, bounds = pb.M, pb.H, pb.F, pb.bounds
    xs, w13, w2, h, a, dy = pb.xs, pb.w13, pb.w2, pb.h, pb.a, pb.dy
    offs = bounds[1:]
    f13, f2 = 2 * M * H * 2 * Fd, 2 * M * H * Fd
    mm_kinds = {  # name: (torch call, our call given a config, flops)
        "fwd_w13": (lambda: torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs), (xs, w13, True), f13),
        "fwd_w2": (lambda: torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs), (a, w2, True), f2),
        "dgrad_w2": (lambda: torch._grouped_mm(dy, w2, offs=offs), (dy, w2, False), f2),
        "dgrad_w13": (lambda: torch._grouped_mm(h, w13, offs=offs), (h, w13, False), f13),
    }
    for kind, (ref_fn, (lhs, rhs, trans), flops) in mm_kinds.items():
        if kinds is not None and kind not in kinds:
            continue
        ref = ref_fn()
        emit(name, kind, "torch", cuda_time_ms(ref_fn), flops)
        for cfg in mm_cfgs:
            try:
                err = rel(grouped_mm(lhs, rhs, bounds, trans, cfg), ref)
                ms = cuda_time_ms(lambda c=cfg, x=lhs, w=rhs, t=trans: grouped_mm(x, w, bounds, t, c))
                emit(name, kind, cfg.describe(), ms, flops, err=err)
            except Exception as ex:  # one config that does not compile must not hide the others
                emit(name, kind, cfg.describe(), 0.0, flops, error=str(ex)[:200])
        del ref
    wgrad_kinds = {"wgrad_w13": (h, xs, f13), "wgrad_w2": (dy, a, f2)}
    for kind, (lhs, rhs, flops) in wgrad_kinds.items():
        if kinds is not None and kind not in kinds:
            continue
        ref_fn = lambda lhs=lhs, rhs=rhs: torch._grouped_mm(lhs.t(), rhs, offs=offs)  # noqa: E731
        ref = ref_fn()
        emit(name, kind, "torch", cuda_time_ms(ref_fn), flops)
        for cfg in wgrad_cfgs:
            try:
                err = rel(grouped_wgrad(lhs, rhs, bounds, dt, cfg), ref)
                ms = cuda_time_ms(lambda c=cfg, x=lhs, y=rhs: grouped_wgrad(x, y, bounds, dt, c))
                emit(name, kind, cfg.describe(), ms, flops, err=err)
            except Exception as ex:
                emit(name, kind, cfg.describe(), 0.0, flops, error=str(ex)[:200])
        del ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--mm-tiles", default=MM_TILES, help="forward / data-gradient tiles, comma-separated")
    ap.add_argument("--wgrad-tiles", default=WGRAD_TILES, help="weight-gradient tiles, comma-separated")
    ap.add_argument("--schedules", default=SCHEDULES, help="schedule letter strings, comma-separated")
    ap.add_argument(
        "--kinds", default=None, help="only these GEMMs (fwd_w13,fwd_w2,dgrad_w2,dgrad_w13,wgrad_w13,wgrad_w2)"
    )
    args = ap.parse_args()
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    records: list = []

    def emit(shape, measure, impl, ms, flops, **extra):
        rec = dict(shape=shape, measure=measure, impl=impl, ms=round(ms, 4))
        rec["tflops"] = round(flops / ms / 1e9, 1) if ms > 0 else None
        rec.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in extra.items()}, **env)
        records.append(rec)
        print(json.dumps(rec), flush=True)

    for name in args.shapes.split(","):
        kinds = set(args.kinds.split(",")) if args.kinds else None
        run_shape(name, configs(args.mm_tiles, args.schedules), configs(args.wgrad_tiles, args.schedules), kinds, emit)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
