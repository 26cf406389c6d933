"""Peak memory and step time of the moecore Qwen3-30B-A3B proxy training step per recomputation option.

Usage (GPU): PYTHONPATH=. python benchmarks/recompute_memory.py [--layers 8] [--json OUT]
One model per option (bf16 weights, AdamW fused, batch 2 x 4096 as `moecore bench train`); the peak
is torch.cuda.max_memory_allocated over 2 warm-up + 3 timed steps. `activations_gb` is what the
forward leaves allocated for the backward (memory after the forward minus before it, no gradients
held): the memory recomputation trades for time. The step's peak also holds the weights, gradients
and AdamW moments, which recomputation does not touch.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from moecore.bench.train import V, _moecore_model, _time_train

OPTIONS = {
    "none": ((), "none"),
    "core_attn": (("core_attn",), "selective"),
    "norm": (("norm",), "selective"),
    "moe_act": (("moe_act",), "selective"),
    "shared_experts": (("shared_experts",), "selective"),
    "moe_act+norm": (("moe_act", "norm"), "selective"),
    "moe": (("moe",), "selective"),
    "full": ((), "full"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(0, V, (a.batch, a.seq), device="cuda")
    labels = torch.roll(ids, -1, dims=1)
    rows = []
    for name, (mods, gran) in OPTIONS.items():
        torch.manual_seed(1)
        with torch.device("cuda"):
            model = _moecore_model(a.layers, a.seq, mods, gran)
        model = model.to(torch.bfloat16).train()
        ms, peak = _time_train(model, ids, labels, False, 2, 3)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(input_ids=ids, labels=labels)
        torch.cuda.synchronize()
        activations = (torch.cuda.memory_allocated() - before) / 2**30
        out.loss.backward()
        out = None
        model.zero_grad(set_to_none=True)
        rows.append(
            {"option": name, "ms": round(ms, 2), "peak_mem_gb": round(peak, 3), "activations_gb": round(activations, 3)}
        )
        print(json.dumps(rows[-1]), flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    base = rows[0]["activations_gb"]
    for r in rows:
        print(
            f"{r['option']:>16}  {r['ms']:8.1f} ms  peak {r['peak_mem_gb']:7.2f} GB  "
            f"activations {r['activations_gb']:6.2f} GB  saves {base - r['activations_gb']:6.2f} GB"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
