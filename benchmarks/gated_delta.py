"""Forward + backward time, peak memory and accuracy of the gated delta rule: Triton kernels vs PyTorch.

Usage (GPU): PYTHONPATH=. python benchmarks/gated_delta.py OUT.json [--batch 2] [--seq 4096] [--reps 10]
(a CPU smoke run of the script itself: TRITON_INTERPRET=1 ... --device cpu --seq 40 --heads 1,2 --dim 16)
Shape: one Qwen3-Next-80B-A3B linear-attention layer (recipes/qwen3-next-80b-a3b.yaml: hidden 2048, 16
key heads and 32 value heads of dim 128, chunk 64) at batch x seq tokens. Inputs as the layer makes them
(`GatedDeltaNet.prepare`): unit-norm q, k; g = -exp(A_log) softplus(a + dt_bias) <= 0; beta = sigmoid(b).
Modes: `bf16` (q, k, v bf16; g, beta fp32), `layer` (q, k fp32 as prepare returns them, v bf16) and
`fp32`. Per mode and path: median ms of forward alone and of forward + backward over --reps timed runs
after warm-up (the warm-up includes the kernels' autotuning), the peak memory of forward + backward above
the inputs, the memory the forward keeps for backward, and relative errors (Frobenius) of o and of every
input gradient against the PyTorch chunked path in float64 on the same inputs; on a GPU also the
time per kernel of one forward + backward (torch.profiler), and flash-linear-attention's kernel where
it is installed (its forward; its backward, or the error it raises).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from moecore.kernels.gated_delta import gated_delta_rule_triton
from moecore.models.linear_attention import _fla_chunk_fn, gated_delta_rule_chunked, l2_normalize

HK, HV, D, CHUNK = 16, 32, 128, 64  # Qwen3-Next's linear attention
MODES = {  # (q/k dtype, v dtype)
    "bf16": (torch.bfloat16, torch.bfloat16),
    "layer": (torch.float32, torch.bfloat16),
    "fp32": (torch.float32, torch.float32),
}


def make_inputs(shape: dict, qk_dtype: torch.dtype, v_dtype: torch.dtype, device: str, seed: int = 0) -> list:
    """q, k [B, S, Hk, D], v [B, S, Hv, D], g, beta [B, S, Hv] as `GatedDeltaNet.prepare` makes them."""
    b, s, hk, hv, d = (shape[n] for n in ("batch", "seq", "key_heads", "value_heads", "head_dim"))
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, device=device, generator=gen)

    q = l2_normalize(randn(b, s, hk, d)).to(qk_dtype)
    k = l2_normalize(randn(b, s, hk, d)).to(qk_dtype)
    v = randn(b, s, hv, d).to(v_dtype)
    a_log = torch.empty(hv, device=device).uniform_(1.0, 16.0, generator=gen).log()  # as GatedDeltaNet's init
    g = -a_log.exp() * F.softplus(randn(b, s, hv) - 4.0)  # dt around softplus(-4) ~ 0.02
    beta = torch.sigmoid(randn(b, s, hv))
    return [q, k, v, g, beta]


def _paths() -> dict:
    return {
        "triton": lambda *a: gated_delta_rule_triton(*a, chunk_size=CHUNK)[0],
        "torch": lambda *a: gated_delta_rule_chunked(*a, chunk_size=CHUNK)[0],
    }


def _fwd_bwd(fn, inputs: list, do: torch.Tensor) -> list:
    xs = [x.detach().requires_grad_() for x in inputs]
    o = fn(*xs)
    o.backward(do)
    return [o.detach()] + [x.grad for x in xs]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(call, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _memory(fn, inputs: list, do: torch.Tensor, device: str) -> tuple[float, float]:
    """(peak GB of forward + backward, GB the forward keeps for backward), above what was allocated."""
    if device != "cuda":
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    xs = [x.detach().requires_grad_() for x in inputs]
    o = fn(*xs)
    kept = torch.cuda.memory_allocated() - base - o.numel() * o.element_size()
    o.backward(do)
    peak = torch.cuda.max_memory_allocated() - base
    return round(peak / 2**30, 3), round(kept / 2**30, 3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def kernel_times(fn, inputs: list, do: torch.Tensor) -> dict:
    """GPU milliseconds per kernel name over one forward + backward (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _fwd_bwd(fn, inputs, do)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    return {name: round(ms, 3) for name, ms in sorted(rows, key=lambda x: -x[1])[:15]}


def _fla(inputs: list, do: torch.Tensor, o_ref: torch.Tensor, reps: int) -> dict:
    """flash-linear-attention's kernel where installed, called as `gated_delta_rule(backend="fla")` calls it
    (without that function's refusal to train on Hopper): the forward's time and error, and the forward +
    backward's time or the error its backward raises."""
    fla = _fla_chunk_fn()

    def fn(q, k, v, g, beta):
        rep = v.shape[2] // k.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return fla(q.to(v.dtype), k.to(v.dtype), v, g=g.float(), beta=beta.to(v.dtype), scale=k.shape[-1] ** -0.5)[0]

    with torch.no_grad():
        out = {"rel_err_o_vs_fp64": float(f"{_rel(fn(*inputs), o_ref):.2e}")}
        out["fwd_ms"] = round(_time_ms(lambda: fn(*inputs), reps, "cuda"), 3)
    try:
        _fwd_bwd(fn, inputs, do)
        out["fwd_bwd_ms"] = round(_time_ms(lambda: _fwd_bwd(fn, inputs, do), reps, "cuda"), 3)
    except Exception as e:  # its backward refuses Hopper with some Triton versions
        out["fwd_bwd_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def bench(shape: dict, reps: int = 10, modes: tuple[str, ...] = tuple(MODES), device: str = "cuda") -> dict:
    """Measurements per mode and path (module docstring)."""
    out = {"shape": shape, "device": torch.cuda.get_device_name() if device == "cuda" else device}
    for mode in modes:
        inputs = make_inputs(shape, *MODES[mode], device=device)
        gen = torch.Generator(device).manual_seed(1)
        do = torch.randn(inputs[2].shape, device=device, generator=gen).to(inputs[2].dtype)
        ref = _fwd_bwd(_paths()["torch"], [x.double() for x in inputs], do.double())
        res = {}
        for name, fn in _paths().items():
            got = _fwd_bwd(fn, inputs, do)  # warm-up (and autotuning)
            errors = {n: _rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref)}
            del got
            with torch.no_grad():
                fwd = _time_ms(lambda fn=fn, xs=inputs: fn(*xs), reps, device)
            fwd_bwd = _time_ms(lambda fn=fn, xs=inputs, do=do: _fwd_bwd(fn, xs, do), reps, device)
            peak, kept = _memory(fn, inputs, do, device)
            res[name] = {
                "fwd_ms": round(fwd, 3),
                "fwd_bwd_ms": round(fwd_bwd, 3),
                "peak_gb": peak,
                "saved_for_backward_gb": kept,
                "rel_err_vs_fp64": {k: float(f"{v:.2e}") for k, v in errors.items()},
            }
            if device == "cuda":
                res[name]["kernel_ms"] = kernel_times(fn, inputs, do)
            print(mode, name, json.dumps(res[name]), flush=True)
        res["speedup_fwd_bwd"] = round(res["torch"]["fwd_bwd_ms"] / res["triton"]["fwd_bwd_ms"], 2)
        if device == "cuda" and _fla_chunk_fn() is not None:
            res["fla"] = _fla(inputs, do, ref[0], reps)
            print(mode, "fla", json.dumps(res["fla"]), flush=True)
        out[mode] = res
    from moecore.kernels import gated_delta

    tuned = {name: obj for name, obj in vars(gated_delta).items() if name.endswith("_kernel")}
    out["autotuned"] = {name: str(getattr(obj, "best_config", None)) for name, obj in tuned.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the JSON result")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--heads", default=f"{HK},{HV}", help="key heads,value heads")
    parser.add_argument("--dim", type=int, default=D, help="key and value head dim")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    hk, hv = (int(x) for x in args.heads.split(","))
    shape = {"batch": args.batch, "seq": args.seq, "key_heads": hk, "value_heads": hv, "head_dim": args.dim}
    shape["chunk"] = CHUNK
    result = bench(shape, args.reps, tuple(args.modes.split(",")), args.device)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
