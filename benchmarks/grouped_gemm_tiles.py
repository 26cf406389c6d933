"""Tile configurations of moecore's Triton grouped GEMMs against torch._grouped_mm, per GEMM of the expert FFN.

For each MoE-layer shape (random top-k routing, bf16): the six GEMMs of the expert FFN (forward w13 / w2, data
gradients through w2 / w13, weight gradients of w13 / w2) with torch._grouped_mm and with
`moecore.kernels.grouped_gemm` under every TileConfig of the sweep; each kernel output is checked against
torch's (relative Frobenius error). Prints one JSON line per measurement and writes them all to --json.
The best configuration per shape and GEMM is what `moecore.kernels.grouped_gemm.GPU_TILES` records.

With --fp8 the four forward / data-gradient GEMMs are timed instead with FP8 operands quantised rowwise along
the contracted dim (as `train.precision=fp8` with fp8.recipe=rowwise runs them): torch._scaled_grouped_mm
against `grouped_mm_scaled` under every --fp8-tiles configuration, on the same unpadded expert rows, both in
the backward's full fp32 accumulation and (`fwd_*_fast`) in the forward's fast accumulation.

With --blockwise the six GEMMs run as fp8.recipe=blockwise runs them (each expert's rows padded to 128; 1x128
activation and 128x128 weight scales): `fp8_block_gemm.block_gemm_nt` / `block_gemm_tn` under every
--block-tiles configuration, checked against the emulated GEMM (dequantise, fp32 matmul), beside torch's
rowwise FP8 grouped GEMM and bf16 grouped GEMM on the same padded rows (no blockwise grouped GEMM in torch).

    python benchmarks/grouped_gemm_tiles.py --json OUT.json [--shapes qwen3_next_80b,...] [--mm-tiles ...] [--schedules G,P,PT]
    python benchmarks/grouped_gemm_tiles.py --fp8 --json OUT.json [--fp8-tiles ...] [--schedules PTF]
    python benchmarks/grouped_gemm_tiles.py --blockwise --json OUT.json [--block-tiles ...] [--schedules PT,GT]

With --quack the six bf16 GEMMs run through QuACK's grouped GEMMs (moecore/kernels/quack_gemm.py; needs the
`quack` extra and a Hopper GPU) under each of its tiles, beside torch._grouped_mm, each output compared with
torch's bit for bit (`equal`); `rule` marks the tile `tile_for` guesses and `tuned` the candidate the backend
chooses by timing (`quack_gemm.choose`). Two more kinds time the SwiGLU in QuACK's epilogues
(moecore/kernels/quack_swiglu.py, `moe.swiglu_epilogue`) against the GEMM followed by moecore's SwiGLU kernel:
`fwd13_swiglu` (FC1 and the SwiGLU) and `dgrad2_dswiglu` (the activation's gradient and the SwiGLU backward with
the rows' probabilities), with `err` the fused output's relative error against the unfused one:

    python benchmarks/grouped_gemm_tiles.py --quack --json OUT.json [--shapes ...,qwen3_235b_a22b,kimi_k2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time

import torch

from moecore.bench.common import DEFAULT_FFN_SHAPES, cuda_time_ms, expert_ffn_problem
from moecore.kernels.fp8_block_gemm import block_gemm_nt, block_gemm_tn
from moecore.kernels.fp8_gemm import Fp8Recipe, quant_rows
from moecore.kernels.fp8_grouped import gmm_nt, gmm_tn, quant_cols, quant_weights
from moecore.kernels.fp8_quant import quantize_grouped_cols, quantize_rowwise
from moecore.kernels.grouped_gemm import TileConfig, group_bounds, grouped_mm, grouped_wgrad
from moecore.kernels.grouped_gemm_fp8 import grouped_mm_scaled, grouped_wgrad_scaled

MM_TILES = "128x128x64w4s4g8,128x128x64w8s3g8,128x256x64w8s3g8,64x128x64w4s4g8,64x256x64w8s3g8"
WGRAD_TILES = "128x128x64w8s3g8,128x128x64w4s4g8,128x256x64w8s3g8,256x128x64w8s3g8,64x128x64w4s4g8"
FP8_TILES = "128x256x128w8s3g8,128x128x128w8s4g8,128x128x128w4s4g8,64x256x128w8s3g8,128x256x64w8s4g8,256x128x128w8s3g8"
FP8_WGRAD_TILES = (
    "128x128x128w8s4g8,128x128x64w8s4g8,128x128x128w8s3g8,64x128x128w4s4g8,128x64x128w4s4g8,64x64x128w4s4g8"
)
BLOCK_TILES = "128x128x128w8s3g8,128x128x128w8s4g8,128x256x128w8s3g8,64x128x128w4s4g8,64x256x128w8s3g8"
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


def run_shape_quack(name: str, kinds: set | None, emit) -> None:
    """The six bf16 GEMMs through QuACK's grouped GEMMs under each tile, against torch._grouped_mm."""
    from moecore.kernels import quack_gemm

    dev = torch.device("cuda")
    pb = expert_ffn_problem(name, dev, torch.bfloat16)
    M, H, Fd, E, bounds = pb.M, pb.H, pb.F, pb.E, pb.bounds
    xs, w13, w2, h, a, dy = pb.xs, pb.w13, pb.w2, pb.h, pb.a, pb.dy
    offs = bounds[1:]
    f13, f2 = 2 * M * H * 2 * Fd, 2 * M * H * Fd
    gemms = {  # name: (torch call, QuACK call given the kind, flops)
        "fwd13": (lambda: torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs),
                  lambda k: quack_gemm.grouped_mm(xs, w13, bounds, True, k), f13),
        "fwd2": (lambda: torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs),
                 lambda k: quack_gemm.grouped_mm(a, w2, bounds, True, k), f2),
        "dgrad2": (lambda: torch._grouped_mm(dy, w2, offs=offs),
                   lambda k: quack_gemm.grouped_mm(dy, w2, bounds, False, k), f2),
        "dgrad13": (lambda: torch._grouped_mm(h, w13, offs=offs),
                    lambda k: quack_gemm.grouped_mm(h, w13, bounds, False, k), f13),
        "wgrad2": (lambda: torch._grouped_mm(dy.t(), a, offs=offs),
                   lambda k: quack_gemm.grouped_wgrad(dy, a, bounds, k), f2),
        "wgrad13": (lambda: torch._grouped_mm(h.t(), xs, offs=offs),
                    lambda k: quack_gemm.grouped_wgrad(h, xs, bounds, k), f13),
    }  # fmt: skip
    widths = {"fwd13": 2 * Fd, "fwd2": H, "dgrad2": Fd, "dgrad13": H, "wgrad2": Fd, "wgrad13": H}
    saved = quack_gemm.CANDIDATES
    try:
        for kind, (ref_fn, ours, flops) in gemms.items():
            if kinds is not None and kind not in kinds:
                continue
            ref = ref_fn()
            emit(name, kind, "torch", cuda_time_ms(ref_fn), flops)
            rule = quack_gemm.tile_for(kind, M / E, widths[kind])
            for tile in quack_gemm.TILES:
                quack_gemm.CANDIDATES, quack_gemm._CHOICES = (tile,), {}
                try:
                    equal = bool(torch.equal(ours(kind), ref))
                    ms = cuda_time_ms(lambda k=kind, f=ours: f(k))
                    emit(name, kind, f"quack-{tile}", ms, flops, equal=equal, rule=tile == rule)
                except Exception as ex:  # one tile that does not compile must not hide the others
                    emit(name, kind, f"quack-{tile}", 0.0, flops, error=str(ex)[:200])
            quack_gemm.CANDIDATES, quack_gemm._CHOICES = saved, {}
            ours(kind)
            emit(name, kind, "quack-tuned", cuda_time_ms(lambda k=kind, f=ours: f(k)), flops,
                 choice=next(iter(quack_gemm._CHOICES.values())))  # fmt: skip
            del ref
    finally:
        quack_gemm.CANDIDATES, quack_gemm._CHOICES = saved, {}
    run_swiglu_epilogues(name, pb, kinds, emit)


def run_swiglu_epilogues(name: str, pb, kinds: set | None, emit) -> None:
    """FC1 + SwiGLU and the activation's gradient + SwiGLU backward: QuACK's epilogues against QuACK's GEMM (the
    timed tile) followed by moecore's SwiGLU kernel."""
    from moecore.kernels import quack_gemm, quack_swiglu
    from moecore.kernels.swiglu import swiglu, swiglu_backward

    xs, w13, w2, h, dy, p, bounds = pb.xs, pb.w13, pb.w2, pb.h, pb.dy, pb.p, pb.bounds
    hi = quack_swiglu.interleave(h)
    f13, f2 = 2 * pb.M * pb.H * 2 * pb.F, 2 * pb.M * pb.H * pb.F
    pairs = {  # kind: (unfused, fused, the fused output in the unfused one's layout, flops)
        "fwd13_swiglu": (
            lambda: swiglu(quack_gemm.grouped_mm(xs, w13, bounds, True, "fwd13")),
            lambda: quack_swiglu.gated_fc1(xs, w13, bounds),
            lambda out: out[1], f13),
        "dgrad2_dswiglu": (
            lambda: swiglu_backward(h, p, quack_gemm.grouped_mm(dy, w2, bounds, False, "dgrad2"))[0],
            lambda: quack_swiglu.dgated_fc2(dy, w2, hi, p, bounds),
            lambda out: quack_swiglu.deinterleave(out[0]), f2),
    }  # fmt: skip
    for kind, (unfused, fused, comparable, flops) in pairs.items():
        if kinds is not None and kind not in kinds:
            continue
        ref = unfused()
        emit(name, kind, "quack+swiglu-kernel", cuda_time_ms(unfused), flops)
        try:
            got = comparable(fused()).float()
            err = ((got - ref.float()).norm() / ref.float().norm()).item()
            emit(name, kind, "quack-epilogue", cuda_time_ms(fused), flops, err=round(err, 5))
        except Exception as ex:  # report and go on to the next kind
            emit(name, kind, "quack-epilogue", 0.0, flops, error=str(ex)[:200])


def run_shape_fp8(name: str, cfgs: list, wgrad_cfgs: list, kinds: set | None, emit) -> None:
    """The forward and data-gradient GEMMs with rowwise FP8 operands: torch._scaled_grouped_mm against ours."""
    dev, e4m3 = torch.device("cuda"), torch.float8_e4m3fn
    pb = expert_ffn_problem(name, dev, torch.bfloat16)
    M, H, Fd, bounds = pb.M, pb.H, pb.F, pb.bounds

    def rows(t):  # [R, K] along K -> (q, s [R])
        q, s = quantize_rowwise(t, e4m3)
        return q, s.reshape(-1)

    def weights(w):  # [E, N, K] along K -> (q [E, N, K], s [E, N])
        q, s = quantize_rowwise(w.reshape(-1, w.shape[-1]), e4m3)
        return q.view(w.shape), s.view(w.shape[0], w.shape[1])

    f13, f2 = 2 * M * H * 2 * Fd, 2 * M * H * Fd
    problems = {  # name: (lhs rows, weights [E, N, K], flops, fast accumulation)
        "fwd_w13": (pb.xs, pb.w13, f13, False),
        "fwd_w13_fast": (pb.xs, pb.w13, f13, True),
        "fwd_w2": (pb.a, pb.w2, f2, False),
        "fwd_w2_fast": (pb.a, pb.w2, f2, True),
        "dgrad_w2": (pb.dy, pb.w2.transpose(1, 2).contiguous(), f2, False),
        "dgrad_w13": (pb.h, pb.w13.transpose(1, 2).contiguous(), f13, False),
    }
    for kind, (lhs, w, flops, fast) in problems.items():
        if kinds is None or kind.removesuffix("_fast") in kinds:
            _time_fp8(name, kind, rows(lhs), weights(w), bounds, flops, fast, cfgs, emit)
    # weight gradients: both operands quantised along each expert's rows, written transposed with the experts'
    # rows padded to 16 (as the FP8 expert FFN does), scales per expert and column
    padded = (pb.counts + 15) // 16 * 16
    pad_to = (padded, int(padded.sum()))
    pbounds = group_bounds(padded)

    def cols(t):
        return quantize_grouped_cols(t, pb.counts, e4m3, pad_to=pad_to)

    for kind, (lhs, rhs, flops) in {"wgrad_w13": (pb.h, pb.xs, f13), "wgrad_w2": (pb.dy, pb.a, f2)}.items():
        if kinds is None or kind in kinds:
            _time_fp8_wgrad(name, kind, cols(lhs), cols(rhs), pbounds, flops, wgrad_cfgs, emit)


def _time_fp8_wgrad(name: str, kind: str, a, b, bounds, flops: int, cfgs: list, emit) -> None:
    (aq, sa), (bq, sb) = a, b
    out = torch.bfloat16

    def torch_fp8():
        return torch._scaled_grouped_mm(aq, bq.t(), sa.reshape(-1), sb.reshape(-1), offs=bounds[1:], out_dtype=out)

    ref = torch_fp8()
    emit(name, kind, "torch-fp8", cuda_time_ms(torch_fp8), flops)
    for cfg in cfgs:
        try:
            err = rel(grouped_wgrad_scaled(aq, bq, sa, sb, bounds, out, cfg), ref)
            ms = cuda_time_ms(lambda c=cfg: grouped_wgrad_scaled(aq, bq, sa, sb, bounds, out, c))
            emit(name, kind, cfg.describe(), ms, flops, err=err)
        except Exception as ex:  # one config that does not compile must not hide the others
            emit(name, kind, cfg.describe(), 0.0, flops, error=str(ex)[:200])


def run_shape_blockwise(name: str, cfgs: list, kinds: set | None, emit) -> None:
    """The six expert-FFN GEMMs under fp8.recipe=blockwise: moecore's block GEMMs per tile, torch's rowwise FP8
    and bf16 grouped GEMMs on the same padded rows for scale (random operands: the kernels' speed does not
    depend on the values)."""
    dev, e4m3 = torch.device("cuda"), torch.float8_e4m3fn
    pb = expert_ffn_problem(name, dev, torch.bfloat16)
    H, Fd, E = pb.H, pb.F, pb.E
    counts = (pb.counts + 127) // 128 * 128  # the blockwise recipe pads each expert's rows to 128
    P = int(counts.sum())
    bounds = group_bounds(counts)
    block, emu = Fp8Recipe("blockwise"), Fp8Recipe("blockwise", emulate=True)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16)

    f13, f2 = 2 * P * H * 2 * Fd, 2 * P * H * Fd
    w13, w2 = rand(E, 2 * Fd, H) * 0.02, rand(E, H, Fd) * 0.02
    nt = {  # name: (rows [P, K], weights [E, N, K], flops)
        "fwd_w13": (rand(P, H), w13, f13),
        "fwd_w2": (rand(P, Fd), w2, f2),
        "dgrad_w2": (rand(P, H), w2.transpose(1, 2).contiguous(), f2),
        "dgrad_w13": (rand(P, 2 * Fd), w13.transpose(1, 2).contiguous(), f13),
    }
    for kind, (x, w, flops) in nt.items():
        if kinds is not None and kind not in kinds:
            continue
        a, b = quant_rows(x, block, e4m3), quant_weights(w, block)
        ref = gmm_nt(a, b, counts, counts.tolist(), emu, torch.float32)
        _time_block(name, kind, lambda c, a=a, b=b: block_gemm_nt(a.q, a.s, b.q, b.s, counts, torch.bfloat16, c),
                    ref, cfgs, flops, emit)  # fmt: skip
        _time_baselines(name, kind, x, w, bounds, flops, emit)
        del ref
    for kind, (n1, n2, flops) in {"wgrad_w13": (2 * Fd, H, f13), "wgrad_w2": (H, Fd, f2)}.items():
        if kinds is not None and kind not in kinds:
            continue
        x, y = rand(P, n1), rand(P, n2)
        a, b = quant_cols(x, counts, block, e4m3), quant_cols(y, counts, block, e4m3)
        ref = gmm_tn(a, b, counts, counts.tolist(), emu, torch.float32)
        _time_block(name, kind, lambda c, a=a, b=b: block_gemm_tn(a.q, a.s, b.q, b.s, counts, torch.bfloat16, c),
                    ref, cfgs, flops, emit)  # fmt: skip
        bf16 = lambda x=x, y=y: torch._grouped_mm(x.t(), y, offs=bounds[1:])  # noqa: E731
        emit(name, kind, "torch-bf16", cuda_time_ms(bf16), flops)
        del ref


def _time_block(name: str, kind: str, run, ref: torch.Tensor, cfgs: list, flops: int, emit) -> None:
    for cfg in cfgs:
        try:
            err = rel(run(cfg), ref)
            emit(name, kind, cfg.describe(), cuda_time_ms(lambda c=cfg: run(c)), flops, err=err)
        except Exception as ex:  # one config that does not compile must not hide the others
            emit(name, kind, cfg.describe(), 0.0, flops, error=str(ex)[:200])


def _time_baselines(name: str, kind: str, x, w, bounds, flops: int, emit) -> None:
    """torch's bf16 and rowwise FP8 (fast accumulation off) grouped GEMMs of x [P, K] with w [E, N, K]."""
    offs, wt = bounds[1:], w.transpose(-2, -1)
    emit(name, kind, "torch-bf16", cuda_time_ms(lambda: torch._grouped_mm(x, wt, offs=offs)), flops)
    xq, sx = quantize_rowwise(x, torch.float8_e4m3fn)
    wq, sw = quantize_rowwise(w.reshape(-1, w.shape[-1]), torch.float8_e4m3fn)
    wq, sw = wq.view(w.shape).transpose(-2, -1), sw.view(w.shape[0], w.shape[1])
    fn = lambda: torch._scaled_grouped_mm(xq, wq, sx.reshape(-1), sw, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    emit(name, kind, "torch-fp8-rowwise", cuda_time_ms(fn), flops)


def _time_fp8(name: str, kind: str, a, b, bounds, flops: int, fast: bool, cfgs: list, emit) -> None:
    (aq, sa), (bq, sb) = a, b
    out = torch.bfloat16

    def torch_fp8():
        return torch._scaled_grouped_mm(
            aq, bq.transpose(-2, -1), sa, sb, offs=bounds[1:], out_dtype=out, use_fast_accum=fast
        )

    ref = torch_fp8()
    emit(name, kind, "torch-fp8", cuda_time_ms(torch_fp8), flops)
    for cfg in cfgs:
        try:
            err = rel(grouped_mm_scaled(aq, bq, sa, sb, bounds, out, cfg, fast_accum=fast), ref)
            ms = cuda_time_ms(lambda c=cfg: grouped_mm_scaled(aq, bq, sa, sb, bounds, out, c, fast_accum=fast))
            emit(name, kind, cfg.describe(), ms, flops, err=err)
        except Exception as ex:  # one config that does not compile must not hide the others
            emit(name, kind, cfg.describe(), 0.0, flops, error=str(ex)[:200])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(DEFAULT_FFN_SHAPES))
    ap.add_argument("--mm-tiles", default=MM_TILES, help="forward / data-gradient tiles, comma-separated")
    ap.add_argument("--wgrad-tiles", default=WGRAD_TILES, help="weight-gradient tiles, comma-separated")
    ap.add_argument("--fp8", action="store_true", help="the forward / data-gradient GEMMs with rowwise FP8 operands")
    ap.add_argument("--fp8-tiles", default=FP8_TILES, help="tiles of the FP8 GEMMs, comma-separated")
    ap.add_argument("--fp8-wgrad-tiles", default=FP8_WGRAD_TILES, help="tiles of the FP8 weight-gradient GEMMs")
    ap.add_argument("--blockwise", action="store_true", help="the six GEMMs of fp8.recipe=blockwise")
    ap.add_argument("--quack", action="store_true", help="the six bf16 GEMMs through QuACK's tiles (Hopper)")
    ap.add_argument("--block-tiles", default=BLOCK_TILES, help="tiles of the blockwise GEMMs (BLOCK_K 128)")
    ap.add_argument("--schedules", default=SCHEDULES, help="schedule letter strings, comma-separated")
    ap.add_argument(
        "--kinds",
        default=None,
        help="only these GEMMs (fwd_w13,fwd_w2,dgrad_w2,dgrad_w13,wgrad_w13,wgrad_w2; with "
        "--quack: fwd13,fwd2,dgrad2,dgrad13,wgrad2,wgrad13,fwd13_swiglu,dgrad2_dswiglu)",
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
        if args.quack:
            run_shape_quack(name, kinds, emit)
            torch.cuda.empty_cache()
            continue
        if args.blockwise:
            run_shape_blockwise(name, configs(args.block_tiles, args.schedules), kinds, emit)
            torch.cuda.empty_cache()
            continue
        if args.fp8:
            fp8_cfgs = configs(args.fp8_tiles, args.schedules)
            run_shape_fp8(name, fp8_cfgs, configs(args.fp8_wgrad_tiles, args.schedules), kinds, emit)
            torch.cuda.empty_cache()
            continue
        run_shape(name, configs(args.mm_tiles, args.schedules), configs(args.wgrad_tiles, args.schedules), kinds, emit)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
