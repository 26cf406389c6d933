"""Peak memory and step time of a moecore training step per recomputation option, on two proxies.

Usage (GPU): PYTHONPATH=. python benchmarks/recompute_memory.py [--model qwen3|dsv2lite] [--layers 8] [--json OUT]
`qwen3`: the Qwen3-30B-A3B proxy of `moecore bench train` (GQA, 128 experts, no shared expert).
`dsv2lite`: the `deepseek-v2-lite` recipe cut to --layers layers (MLA without q LoRA, first layer
dense, 64 experts top-6 + 2 shared), which exercises mla_up_proj, mlp and shared_experts too.
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

OPTIONS = {  # the qwen3 proxy
    "none": ((), "none"),
    "core_attn": (("core_attn",), "selective"),
    "norm": (("norm",), "selective"),
    "moe_act": (("moe_act",), "selective"),
    "shared_experts": (("shared_experts",), "selective"),
    "moe_act+norm": (("moe_act", "norm"), "selective"),
    "moe": (("moe",), "selective"),
    "full": ((), "full"),
}
OPTIONS_MLA = {  # the DeepSeek-V2-Lite proxy
    "none": ((), "none"),
    "core_attn": (("core_attn",), "selective"),
    "mla_up_proj": (("mla_up_proj",), "selective"),
    "norm": (("norm",), "selective"),
    "mlp": (("mlp",), "selective"),
    "shared_experts": (("shared_experts",), "selective"),
    "recipe (mla_up_proj+moe_act+norm)": (("mla_up_proj", "moe_act", "norm"), "selective"),
    "moe": (("moe",), "selective"),
    "full": ((), "full"),
}


def _dsv2lite_model(layers: int, seq: int, recompute_modules: tuple, granularity: str):
    from moecore.config import load_config
    from moecore.models.transformer import MoETransformer

    rec = ",".join(recompute_modules)
    cfg = load_config(
        "deepseek-v2-lite",
        [
            f"model.num_layers={layers}",
            f"train.seq_length={seq}",
            "parallel.ep=1",
            "moe.token_dispatcher_type=alltoall",
            f"model.recompute_modules=[{rec}]",
            f"model.recompute_granularity={granularity}",
            "moe.apply_probs_on_input=true",
        ],
    )
    return MoETransformer(cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("qwen3", "dsv2lite"), default="qwen3")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    vocab = V if a.model == "qwen3" else 102400
    ids = torch.randint(0, vocab, (a.batch, a.seq), device="cuda")
    labels = torch.roll(ids, -1, dims=1)
    rows = []
    options = OPTIONS if a.model == "qwen3" else OPTIONS_MLA
    build = _moecore_model if a.model == "qwen3" else _dsv2lite_model
    for name, (mods, gran) in options.items():
        torch.manual_seed(1)
        with torch.device("cuda"):
            model = build(a.layers, a.seq, mods, gran)
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
            {
                "model": a.model,
                "option": name,
                "ms": round(ms, 2),
                "peak_mem_gb": round(peak, 3),
                "activations_gb": round(activations, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    base = rows[0]["activations_gb"]
    for r in rows:
        print(
            f"{r['option']:>34}  {r['ms']:8.1f} ms  peak {r['peak_mem_gb']:7.2f} GB  "
            f"activations {r['activations_gb']:6.2f} GB  saves {base - r['activations_gb']:6.2f} GB"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
