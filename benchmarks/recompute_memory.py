"""Peak memory and step time of a moecore training step per recomputation option, on two proxies.

Usage (GPU): PYTHONPATH=. python benchmarks/recompute_memory.py [--model qwen3|dsv2lite] [--layers 8] [--json OUT]
`qwen3`: the Qwen3-30B-A3B proxy of `moecore bench train` (GQA, 128 experts, no shared expert).
`dsv2lite`: the `deepseek-v2-lite` recipe cut to --layers layers (MLA without q LoRA, first layer
dense, 64 experts top-6 + 2 shared), which exercises mla_up_proj, mlp and shared_experts too.
One `Trainer` per option, built as `moecore train` builds it (batch 2 x 4096, `--precision` mode of
`moecore bench train`, default bf16); the peak is torch.cuda.max_memory_allocated over 2 warm-up + 3
timed steps. `activations_gb` is what one forward leaves allocated for the backward (memory after the
forward minus before it): the memory recomputation trades for time. The step's peak also holds the
weights, master weights, moments and gradients, which recomputation does not touch.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from moecore.bench.common import cuda_time_ms
from moecore.bench.train import MODES, bench_config

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


def _config(model: str, mode: str, layers: int, seq: int, modules: tuple, granularity: str):
    rec = ",".join(modules)
    common = [
        f"model.num_layers={layers}", f"train.seq_length={seq}", "train.global_batch_size=2",
        "train.micro_batch_size=2", f"model.recompute_modules=[{rec}]", f"model.recompute_granularity={granularity}",
    ]  # fmt: skip
    if model == "qwen3":
        return bench_config("qwen3-30b-a3b", mode, extra=common)
    from moecore.config import load_config

    quiet = ["log.progress=false", "log.tensorboard=false", "log.oom_snapshot=false", "parallel.ep=1"]
    return load_config("deepseek-v2-lite", [*common, *MODES[mode], *quiet])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("qwen3", "dsv2lite"), default="qwen3")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--precision", choices=tuple(MODES), default="bf16")
    a = p.parse_args()
    from moecore.train.loop import Trainer

    rows = []
    options = OPTIONS if a.model == "qwen3" else OPTIONS_MLA
    for name, (mods, gran) in options.items():
        trainer = Trainer(_config(a.model, a.precision, a.layers, a.seq, mods, gran))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_time_ms(lambda trainer=trainer: trainer.train_step(with_moe_metrics=False), 2, 3)
        peak = torch.cuda.max_memory_allocated() / 2**30
        batch = {k: v.cuda() for k, v in trainer.data.train.next_micro_batch().items()}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = trainer.model(batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"])
        torch.cuda.synchronize()
        activations = (torch.cuda.memory_allocated() - before) / 2**30
        del out
        rows.append(
            {
                "model": a.model,
                "option": name,
                "precision": a.precision,
                "ms": round(ms, 2),
                "peak_mem_gb": round(peak, 3),
                "activations_gb": round(activations, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        trainer.rt.shutdown()
        trainer = None
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
