"""FP8 quantisation kernels at the expert FFN's shapes: GPU time and the memory bandwidth each reaches.

Usage (GPU): PYTHONPATH=. python benchmarks/fp8_quant_bandwidth.py [--shapes mixtral_8x7b,deepseek_v3] [--json OUT]

The FP8 expert FFN (moecore/kernels/fp8_grouped.py) quantises, per forward + backward, its routed
activations and gradients rowwise (along the features) and per expert along the rows (the weight-gradient
GEMMs' operands), and its two expert weights in two layouts. Each is memory-bound: this script times
every kernel on the operands of one MoE-layer shape (`moecore bench moe-layer`'s shapes, rows = tokens x
top-k, each expert's rows padded to 16 as the layer pads them) and reports the bandwidth it reaches,
counting the bytes it moves (its input read once per pass over it, two passes each: amax, then
quantise; FP8 values and fp32 scales written), beside a device-to-device copy measured in the same run (the ceiling).
The FP8 weight transposes (the blockwise and tensorwise recipes' w^T for the input gradient) are timed with
moecore's kernel and with torch's transposed copy.
"""

from __future__ import annotations

import argparse
import json

import torch

from moecore.bench.common import copy_tbps, cuda_time_ms, env
from moecore.bench.moe_layer import SHAPES
from moecore.kernels import fp8_quant as fq
from moecore.kernels.fp8_transpose import transpose_last2, transpose_last2_reference

E4M3 = torch.float8_e4m3fn


def _counts(rows: int, experts: int, align: int = 16) -> torch.Tensor:
    """Near-uniform per-expert rows, each a multiple of `align`, summing to at most `rows`."""
    per = rows // experts // align * align
    return torch.full((experts,), per, dtype=torch.int64, device="cuda")


def cases(shape: str) -> list[tuple[str, int, object]]:
    """(name, bytes moved, thunk) for every quantisation of one forward + backward of the FP8 layer."""
    h, f, e, k, t = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = _counts(t * k, e)
    p = int(counts.sum())
    out = []
    for name, cols in (("x / dy", h), ("a", f), ("dh", 2 * f)):
        x = torch.randn(p, cols, device="cuda", dtype=torch.bfloat16, generator=g)
        n = x.numel()
        out.append((f"rowwise {name} [{p}, {cols}]", 2 * 2 * n + n + 4 * p, lambda x=x: fq.quantize_rowwise(x)))
        out.append(
            (
                f"grouped cols {name} [{p}, {cols}]",
                2 * 2 * n + n + 4 * e * cols,
                lambda x=x: fq.quantize_grouped_cols(x, counts),
            )
        )
        out.append(  # the weight-gradient operands as the layer writes them (fp8.padding=wgrad: groups padded to 16)
            (
                f"grouped cols padded {name} [{p}, {cols}]",
                2 * 2 * n + n + 4 * e * cols,
                lambda x=x: fq.quantize_grouped_cols(x, counts, pad_to=(counts, p), aligned=True),
            )
        )
        del x
    for name, dims in (("w13", (e, 2 * f, h)), ("w2", (e, h, f))):
        w = torch.randn(*dims, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        n = w.numel()
        rows_scales, cols_scales = 4 * dims[0] * dims[1], 4 * dims[0] * dims[2]
        out.append(
            (
                f"rowwise {name} {list(dims)}",
                2 * 2 * n + n + rows_scales,
                lambda w=w: fq.quantize_rowwise(w.flatten(0, 1)),
            )
        )
        out.append(
            (
                f"transposed {name} {list(dims)}",
                2 * 2 * n + n + cols_scales,
                lambda w=w: fq.quantize_weight_layouts(w, E4M3, rows=False),
            )
        )
        out.append(
            (
                f"both layouts {name} {list(dims)}",
                2 * 2 * 2 * n + 2 * n + rows_scales + cols_scales,
                lambda w=w: fq.quantize_weight_layouts(w, E4M3),
            )
        )
        q = fq.quantize_rowwise(w.flatten(0, 1))[0].view(dims)  # blockwise / tensorwise: w^T from the FP8 w
        out.append((f"FP8 transpose {name} {list(dims)}", 2 * n, lambda q=q: transpose_last2(q)))
        out.append((f"FP8 transpose {name} (torch copy)", 2 * n, lambda q=q: transpose_last2_reference(q)))
        del q
        master = w.float()  # fp8.primary_weights' step: the fp32 master rounded to bf16, then both layouts
        out.append(
            (
                f"both layouts from fp32 master {name}",
                4 * n + 2 * n + 2 * 2 * 2 * n + 2 * n + rows_scales + cols_scales,
                lambda m=master: fq.quantize_weight_layouts(m.bfloat16(), E4M3),
            )
        )
        del w, master
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral_8x7b,deepseek_v3")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ceiling = copy_tbps()
    records = []
    print(f"device-to-device copy: {ceiling:.2f} TB/s")
    for shape in args.shapes.split(","):
        for name, nbytes, fn in cases(shape):
            ms = cuda_time_ms(fn, 2, args.iters)
            tbps = nbytes / ms / 1e9
            rec = {"shape": shape, "kernel": name, "ms": round(ms, 3), "tb_per_s": round(tbps, 2)}
            rec["of_copy"] = round(tbps / ceiling, 3)
            records.append(rec)
            print(f"{shape:14s} {name:48s} {ms:8.3f} ms {tbps:6.2f} TB/s ({rec['of_copy']:.2f} of copy)", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_tb_per_s": round(ceiling, 2), **env(), "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
