"""The fused router kernels at the layer bench's shapes (GPU): forward and forward + backward time per launch shape.

Usage: PYTHONPATH=. python benchmarks/router_kernel.py [--shapes qwen3_next,deepseek_v3,...] [--blocks 4x4,8x4]
       [--json OUT]

For each `moecore bench moe-layer` shape it routes the shape's tokens with its model's router options (softmax
top-k with renormalisation; DeepSeek-V3: sigmoid scores, expert bias, 8 groups of which the best 4 by their
best-two sum, scaling 2.5) through `moecore.kernels.router.fused_router`, and reports microseconds per call,
calls launched back to back between two CUDA events (the GPU's time: each call's work outlasts its launch):
`fwd_us` (routing, no autograd) and `fwd_bwd_us` (routing with autograd, then the backward of the weights).
`--blocks`: launch shapes to time besides the kernel's own choice, as BLOCK_T x warps; each must route exactly as
the default does (checked). "GB/s" counts the fp32 logits read once by the forward.
"""

from __future__ import annotations

import argparse
import json

import torch

from moecore.bench.common import cuda_back_to_back_ms, env
from moecore.bench.moe_layer import SHAPES
from moecore.kernels import router as router_kernels
from moecore.kernels.router import RouterSpec, fused_router

SPECS = {
    "qwen3_30b_a3b": RouterSpec(topk=8),
    "mixtral_8x7b": RouterSpec(topk=2),
    "deepseek_v3": RouterSpec(
        topk=8, score_function="sigmoid", scaling_factor=2.5, num_groups=8, group_topk=4, group_score="top2_sum"
    ),
    "qwen3_next": RouterSpec(topk=10),
}


def _us_per_call(fn, reps: int = 20) -> float:
    fn()  # compiles the kernels of a new launch shape
    return cuda_back_to_back_ms(fn, reps) * 1e3


def time_shape(name: str, blocks: list[tuple[int, int]]) -> list[dict]:
    _, _, E, _, T = SHAPES[name]
    spec = SPECS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g)
    bias = torch.randn(E, device="cuda", generator=g) * 0.1 if spec.score_function == "sigmoid" else None
    d_weight = torch.randn(T, spec.topk, device="cuda", generator=g)
    leaf = logits.clone().requires_grad_()
    default = router_kernels._blocking
    own = default(T, E, T)
    records, want = [], None
    for block_t, warps in [(own[0], own[3]), *blocks]:
        # the launch shape for this record (segment = T: one block never straddles two segments)
        router_kernels._blocking = lambda t, e, seg, bt=block_t, w=warps: (bt, -(-t // bt), -(-t // bt), w)
        try:
            with torch.no_grad():
                out = fused_router(logits, spec, bias)
            if want is None:
                want = (out.idx_TK.clone(), out.weight_TK.clone())
            elif not (torch.equal(out.idx_TK, want[0]) and torch.equal(out.weight_TK, want[1])):
                raise AssertionError(f"{name}: BLOCK_T {block_t} x {warps} warps routes otherwise than the default")
            with torch.no_grad():
                fwd = _us_per_call(lambda: fused_router(logits, spec, bias))
            fwd_bwd = _us_per_call(
                lambda: torch.autograd.grad(fused_router(leaf, spec, bias).weight_TK, leaf, d_weight)
            )
        finally:
            router_kernels._blocking = default
        records.append(
            {
                "shape": name,
                "block_t": block_t,
                "warps": warps,
                "default": (block_t, warps) == (own[0], own[3]),
                "fwd_us": round(fwd, 1),
                "fwd_bwd_us": round(fwd_bwd, 1),
                "fwd_GBps": round(T * E * 4 / fwd / 1e3, 1),
                **env(),
            }
        )
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--blocks", default="", help="extra launch shapes, BLOCK_TxWARPS, comma-separated")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("router_kernel.py: needs a CUDA GPU")
    blocks = [tuple(int(v) for v in b.split("x")) for b in a.blocks.split(",") if b]
    records = []
    for name in a.shapes.split(","):
        for r in time_shape(name, blocks):
            records.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
