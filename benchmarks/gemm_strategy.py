"""Which GEMM each phase of the expert FFN should use, per shape, on the GPU at hand.

Times, for random top-k routing of the benchmark's MoE-layer shapes: each GEMM kind (forward, dgrad, wgrad) with
torch._grouped_mm, a loop of cuBLAS GEMMs and our Triton grouped GEMM (grouped_gemm.py); the fused SwiGLU and the
permute/unpermute gathers; and the whole expert FFN forward+backward under several plans. Prints
one JSON line per measurement and writes them all to --json.

    python benchmarks/gemm_strategy.py --json OUT.json [--shapes qwen3_30b_a3b,...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moecore.bench.common import DEFAULT_FFN_SHAPES, expert_ffn_problem
from moecore.bench.common import cuda_time_ms as bench
from moecore.kernels.grouped_ffn import GemmPlan, default_plan, expert_ffn, gemm_nn, gemm_nt, gemm_tn
from moecore.kernels.permute import make_permutation, permute, unpermute
from moecore.kernels.swiglu import swiglu, swiglu_backward


def run_shape(name: str, out: list) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    pb = expert_ffn_problem(name, dev, dt)
    H, Fd, E, K, T, M = pb.H, pb.F, pb.E, pb.K, pb.T, pb.M
    idx, perm, counts, bounds, host = pb.idx, pb.perm, pb.counts, pb.bounds, pb.counts.tolist()
    x, xs, w13, w2, h, a, dy, p = pb.x, pb.xs, pb.w13, pb.w2, pb.h, pb.a, pb.dy, pb.p

    def emit(what, ms, flops=None, **kw):
        rec = dict(shape=name, what=what, ms=round(ms, 4), **kw)
        if flops:
            rec["tflops"] = round(flops / ms / 1e9, 1)
        out.append(rec)
        print(json.dumps(rec), flush=True)

    f13, f2 = 2 * M * H * 2 * Fd, 2 * M * H * Fd
    for impl in ("grouped", "loop", "streams", "triton"):
        try:
            emit(f"fwd_w13/{impl}", bench(lambda impl=impl: gemm_nt(xs, w13, bounds, host, impl, "fwd13")), f13)
            emit(f"fwd_w2/{impl}", bench(lambda impl=impl: gemm_nt(a, w2, bounds, host, impl, "fwd2")), f2)
            emit(f"dgrad_w2/{impl}", bench(lambda impl=impl: gemm_nn(dy, w2, bounds, host, impl, "dgrad2")), f2)
            emit(f"dgrad_w13/{impl}", bench(lambda impl=impl: gemm_nn(h, w13, bounds, host, impl, "dgrad13")), f13)
        except Exception as ex:  # record and go on: one failing kind must not hide the others
            emit(f"fwd_dgrad/{impl}", 0.0, error=str(ex)[:300])
    for impl in ("grouped", "loop", "streams", "triton"):
        try:
            emit(f"wgrad_w13/{impl}", bench(lambda impl=impl: gemm_tn(h, xs, bounds, host, impl, dt, "wgrad13")), f13)
            emit(f"wgrad_w2/{impl}", bench(lambda impl=impl: gemm_tn(dy, a, bounds, host, impl, dt, "wgrad2")), f2)
        except Exception as ex:
            emit(f"wgrad/{impl}", 0.0, error=str(ex)[:300])
    # elementwise / movement phases
    emit("swiglu_fwd", bench(lambda: swiglu(h, p)), bytes=M * Fd * 2 * 3)
    emit("swiglu_bwd", bench(lambda: swiglu_backward(h, p, a)), bytes=M * Fd * 2 * 7)
    emit("make_permutation", bench(lambda: make_permutation(idx, E)))
    emit("permute_fwd", bench(lambda: permute(x, perm)), bytes=M * H * 4)
    emit("unpermute_fwd", bench(lambda: unpermute(dy, perm)), bytes=M * H * 2 + T * H * 2)
    # whole expert FFN, forward + backward
    flops = 18 * H * Fd * K * T
    plans = {
        "grouped": GemmPlan.uniform("grouped"),
        "grouped+triton_wgrad": GemmPlan.uniform("grouped", "triton"),
        "loop": GemmPlan.uniform("loop"),
        "default": default_plan(E, M, H, Fd, dev),
        "default+streams": default_plan(E, M, H, Fd, dev).with_streams(),
    }
    w13p = w13.clone().requires_grad_()
    w2p = w2.clone().requires_grad_()
    xsp = xs.clone().requires_grad_()
    for pname, plan in plans.items():

        def step(plan=plan):
            w13p.grad = w2p.grad = xsp.grad = None
            y = expert_ffn(xsp, w13p, w2p, counts, p, plan=plan)
            y.backward(dy)

        try:
            torch.cuda.reset_peak_memory_stats()
            ms = bench(step, 2, 5)
            emit(
                f"expert_ffn_fwd_bwd/{pname}",
                ms,
                flops,
                peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2),
            )
        except Exception as ex:
            emit(f"expert_ffn_fwd_bwd/{pname}", 0.0, error=str(ex)[:300])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(DEFAULT_FFN_SHAPES))
    args = ap.parse_args()
    out: list = []
    print(json.dumps(dict(what="env", torch=torch.__version__, gpu=torch.cuda.get_device_name())), flush=True)
    n = 8192
    m1, m2 = (
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
    )
    ms = bench(lambda: m1 @ m2, 3, 20)
    out.append(dict(what="dense_bf16_8192", ms=ms, tflops=2 * n**3 / ms / 1e9))
    print(json.dumps(out[-1]), flush=True)
    for name in args.shapes.split(","):
        run_shape(name, out)
        torch.cuda.empty_cache()
    if args.json:
        env = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump([contract_record(r, env) for r in out], f, indent=1)


def contract_record(rec: dict, env: dict) -> dict:
    """A record in the benchmarks/results format: shape, impl, tflops, ms, peak_mem_gb, date, gpu, torch.

    `what` is `<measurement>[/<impl>]` (e.g. `wgrad_w13/grouped`); the measurement goes to `measure`.
    """
    rec = dict(rec)
    measure, _, impl = rec.pop("what").partition("/")
    out = {"shape": rec.pop("shape", "dense_8192^3"), "measure": measure, "impl": impl or "torch"}
    out.update(tflops=rec.pop("tflops", None), ms=rec.pop("ms"), peak_mem_gb=None)
    out.update(rec)
    out.update(env)
    return out


if __name__ == "__main__":
    main()
