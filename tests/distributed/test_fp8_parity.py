"""FP8 (emulated, rowwise) under data, tensor and expert parallelism: the same training as the one-process FP8 run.

Quantisation groups follow the layout where a tensor is sharded: under tensor parallelism a row-parallel
weight's row scales cover this rank's columns only, and the weight gradients of replicated (data-parallel)
modules are quantised over this rank's tokens. So a layout is not bit-equal to the one-process FP8 run.
The bar: for the losses and for every parameter's first-step gradient, the layout's distance from the
one-process FP8 run is at most 1.5x the distance between that run and the one-process fp32 run (FP8's
own rounding; in this tiny model up to ~50% for the router's gradient, a small difference of expert
outputs) plus 1e-4. A wrong shard, scale or padding shows up as errors far beyond FP8's own.
"""

from __future__ import annotations

import pytest
from dist_parity import build, compare, make_data, make_dims, reference, tiny_config, train_steps

from moecore.kernels.fp8_gemm import Fp8Recipe
from moecore.models.fp8 import apply_fp8
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

RECIPE = Fp8Recipe("rowwise", emulate=True)
MODULES = ["experts", "shared_experts", "dense_mlp", "attention"]
LAYOUTS = {"dp2": {}, "tp2-sp": {"tp": 2}, "ep2-alltoall": {"ep": 2}}


def _fp8_hook(model) -> None:
    apply_fp8(model, RECIPE, MODULES)


def _config(par: dict):
    cfg = tiny_config(token_dispatcher_type="alltoall")
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _run_all(rank: int, world: int, init: dict, data) -> dict:
    out = {}
    for name, par in LAYOUTS.items():
        cfg = _config(par)
        dims = make_dims(cfg, rank, world)
        model = build(cfg, dims, init)
        done = apply_fp8(model, RECIPE, MODULES)
        out[name] = train_steps(model, dims, data)
        out[name]["fp8_modules"] = len(done["fp8"])
    return out


def _errors(ref: dict, got: dict) -> dict:
    out = {"loss": max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], got["losses"]))}
    for name, g in ref["grads"].items():
        out[name] = float((got["grads"][name] - g).norm() / g.norm().clamp(min=1e-30))
    return out


def test_fp8_layouts_track_the_one_process_fp8_run():
    data = make_data()
    cfg = tiny_config(token_dispatcher_type="alltoall")
    _, ref32 = reference(cfg, data)
    init, ref8 = reference(cfg, data, init_hook=_fp8_hook)
    fp8_noise = _errors(ref32, ref8)
    assert fp8_noise["loss"] > 0  # FP8 changed the arithmetic
    results = run_local(_run_all, 2, init, data)
    for name, got in results[0].items():
        assert got["fp8_modules"] > 0, name
        err = _errors(ref8, got)
        bad = {k: (e, fp8_noise[k]) for k, e in err.items() if e > 1.5 * fp8_noise[k] + 1e-4}
        r = compare(ref8, got)
        print(
            f"{name}: loss {r['loss']:.1e} grad {r['grad']:.1e} ({r['grad_param']}); FP8's own {max(fp8_noise.values()):.1e}"
        )
        assert not bad, (name, bad)
