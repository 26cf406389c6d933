"""`moecore bench train`: the training step `moecore train` runs, timed against transformers on the same GPU.

moecore's side is the real `Trainer` (moecore/train/loop.py) built from a recipe and overrides, exactly
as `moecore train RECIPE overrides...` builds it — the same config, precision, optimizer, data path
(the embedded corpus unless `data.paths` is given) and step function (`Trainer.train_step`, without
the per-layer statistics a logged step adds). Only the progress bar, TensorBoard and checkpoints are off.

transformers' side is the same architecture exported through our family mapping (`config_to_hf`),
built with `experts_implementation=grouped_mm` and SDPA attention, trained on the trainer's own
micro-batches with `torch.optim.AdamW(fused=True)`, in the same precision mode:
- `bf16`: bf16 parameters, bf16 AdamW moments (moecore: `optim.master_weights=bf16
  optim.state_dtype=bf16`; transformers: the model cast to bf16, as with `torch_dtype=bfloat16`);
- `mixed`: fp32 master weights and moments (moecore: bf16 parameters with fp32 masters, the default;
  transformers: fp32 parameters under bf16 autocast, as its Trainer runs with `bf16=True`).

Proxies (`--model`): recipe + overrides for a GPU-sized slice of each real model (see PROXIES).
FLOPs per step for both sides: `moecore.train.logger.flops_per_token` (the count `moecore train`
logs MFU with) x tokens. MFU divides by the dense bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import gc
import json
import tempfile

import torch

from moecore.bench.common import chrome_trace, copy_tbps, cuda_time_ms, dense_bf16_tflops, profile_gpu_ms, record

PROXIES = {
    # name: (recipe, overrides) — the shape a user trains, cut to fit one GPU
    "qwen3-30b-a3b": (
        "qwen3-30b-a3b",
        ["model.num_layers=8", "parallel.ep=1", "train.global_batch_size=2", "train.micro_batch_size=2",
         "train.seq_length=4096"],
    ),
    "qwen3-next": (  # hidden 2048, 3 gated-DeltaNet : 1 gated-attention, 512 experts top-10; 4 layers (7.0B
        # parameters: 8 layers, 13.5B, do not fit one H200 with fp32 masters and moments)
        "qwen3-next-80b-a3b",
        ["model.num_layers=4", "model.layer_types=[" + ",".join(["linear_attention"] * 3 + ["full_attention"]) + "]",
         "parallel.ep=1", "train.global_batch_size=1", "train.micro_batch_size=1", "train.seq_length=4096"],
    ),
    "deepseek-v3": (  # MLA, 256 experts top-8 in 8 groups, a dense first layer, one MTP layer; narrower
        "deepseek-v3",
        ["model.num_layers=4", "moe.first_k_dense_replace=1", "model.hidden_size=2048", "model.ffn_hidden_size=5632", "moe.ffn_hidden_size=512",
         "moe.shared_expert_intermediate_size=512", "model.num_attention_heads=16", "model.num_kv_heads=16", "parallel.ep=1",
         "train.global_batch_size=2", "train.micro_batch_size=2", "train.seq_length=4096"],
    ),
    "deepseek-v4": (  # DeepSeek-V4-Flash's attention at its real size (64 heads of 512, one key/value head, both
        # compressed kinds), 4 streams, a hash-routed first layer; 2 layers of 128 experts top-6 of FFN 512 (narrower)
        "deepseek-v4-flash",
        ["model.num_layers=2", "model.layer_types=[heavily_compressed_attention,compressed_sparse_attention]",
         "moe.num_hash_layers=1", "moe.num_experts=128", "moe.ffn_hidden_size=512", "parallel.ep=1",
         "train.global_batch_size=1", "train.micro_batch_size=1", "train.seq_length=4096"],
    ),
}  # fmt: skip

MODES = {  # precision mode -> moecore overrides
    "bf16": ["train.precision=bf16", "optim.master_weights=bf16", "optim.state_dtype=bf16"],
    "mixed": ["train.precision=bf16", "optim.master_weights=fp32", "optim.state_dtype=fp32"],
    # mixed with FP8 GEMMs (fp8.recipe from the overrides, default rowwise); records' impl moecore-fp8-<recipe>[-hybrid]
    "fp8": ["train.precision=fp8", "optim.master_weights=fp32", "optim.state_dtype=fp32"],
}

VARIANTS = {  # moecore variants timed by `--variants` (the default is "moecore")
    "moecore": "the recipe as `moecore train` runs it",
    "moecore-unfused-router": "moe.router_fusion=false: routing and its aux loss through separate torch ops",
    "moecore-sparse-attention": "model.compressed_attention_kernel=sparse: DeepSeek-V4's attention through the sparse "
    "MLA kernel instead of flex_attention",
}
VARIANT_OVERRIDES = {
    "moecore-unfused-router": ["moe.router_fusion=false"],
    "moecore-sparse-attention": ["model.compressed_attention_kernel=sparse"],
}

PHASES = (  # (phase, substrings of CUDA kernel names), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attention")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("GEMMs (dense + expert)", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "grouped")),
    ("cross-entropy", ("_ce_", "cross_entropy", "log_softmax", "logsumexp")),
    ("SwiGLU", ("swiglu", "silu")),
    ("permute/unpermute", ("_gather", "index", "scatter")),
    ("router", ("_router_", "softmax", "topk")),
    ("RMSNorm / RoPE", ("_rms", "_rope")),
    ("sort/count", ("sort", "bincount", "histc", "cumsum", "radix")),
    ("elementwise / copies", ("elementwise", "copy", "fill", "reduce")),
)


def bench_config(model: str, mode: str, variant: str = "moecore", extra: list[str] | tuple = ()):
    """The Config `moecore train` would build for this proxy, precision mode and variant (plus `extra` overrides)."""
    from moecore.config import load_config

    recipe, overrides = PROXIES[model]
    run_dir = tempfile.mkdtemp(prefix="moecore-bench-")
    quiet = ["log.progress=false", "log.tensorboard=false", "log.oom_snapshot=false", f"train.run_dir={run_dir}"]
    variant_overrides = VARIANT_OVERRIDES.get(variant, [])
    return load_config(recipe, [*overrides, *MODES[mode], *quiet, *variant_overrides, *extra])


def hf_model(cfg, mode: str):
    """transformers' model of the same architecture (our family mapping's config.json), on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moecore.hf.pretrained import hf_config_dict, pick_family

    body = hf_config_dict(cfg, pick_family(cfg), torch.float32)
    body.pop("architectures", None)
    body.pop("dtype", None)
    hf_cfg = AutoConfig.for_model(**body)
    hf_cfg._experts_implementation = "grouped_mm"
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg.use_cache = False
    with torch.device("cuda"):  # initialise on the GPU: a CPU init of billions of parameters takes minutes
        model = AutoModelForCausalLM.from_config(hf_cfg)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    return model


def hf_step(model, batches: list[dict], mode: str):
    """One optimizer step of transformers' model over the trainer's micro-batches (fused AdamW)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "mixed")

    def step():
        for b in batches:
            with autocast:
                # transformers shifts the labels itself: give it the inputs as labels.
                out = model(input_ids=b["input_ids"], labels=b["input_ids"])
            (out.loss / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def optimizer_bytes(trainer) -> int:
    """Bytes one optimizer step must read and write at least: gradient, weights (master and bf16), moments."""
    mp = trainer.rt.mixed
    total = 0
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            state = trainer.optimizer.state.get(p, {})
            moments = sum(2 * t.element_size() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq"))
            grad = 4 if mp is not None and mp.sum_in_fp32 else p.element_size()
            weights = 2 * 4 + p.element_size() if mp is not None and p in mp.masters else 2 * p.element_size()
            total += p.numel() * (grad + weights + moments)
    return total


def _first_batches(cfg) -> list[dict]:
    """The micro-batches of the first step of a one-process run of `cfg` (on the GPU)."""
    from moecore.data import build_data

    data = build_data(cfg)
    n = cfg.train.global_batch_size // cfg.train.micro_batch_size
    return [{k: v.cuda() for k, v in data.train.next_micro_batch().items()} for _ in range(n)]


def _time(step, warmup: int, iters: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_time_ms(step, warmup, iters)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run(
    compare_hf: bool,
    warmup: int,
    iters: int,
    model: str = "qwen3-30b-a3b",
    modes: tuple[str, ...] = ("bf16", "mixed"),
    variants: tuple[str, ...] = ("moecore",),
    phases: bool = False,
    overrides: tuple[str, ...] = (),
    trace: str | None = None,
) -> list[dict]:
    """Time each (precision mode, implementation); `trace`: a folder for gzipped Chrome traces of one step each."""
    from moecore.train.logger import flops_per_token
    from moecore.train.loop import Trainer

    dense = dense_bf16_tflops()
    records = []
    for mode in modes:
        impls = (["transformers-grouped_mm"] if compare_hf else []) + list(variants)
        batches = None
        for impl in impls:
            hf = impl.startswith("transformers")
            cfg = bench_config(model, mode, "moecore" if hf else impl, overrides)
            if mode == "fp8" and not hf:
                hybrid = "-hybrid" if cfg.fp8.format == "hybrid" else ""
                impl = impl.replace("moecore", f"moecore-fp8-{cfg.fp8.recipe}{hybrid}", 1)
            t = cfg.train
            shape = f"{model}_{cfg.model.num_layers}l_b{t.global_batch_size}_s{t.seq_length}"
            trainer = net = None
            try:
                tokens = t.global_batch_size * t.seq_length
                if hf:
                    batches = _first_batches(cfg)  # the micro-batches the trainer's first step takes
                    flops = flops_per_token(cfg) * tokens
                    torch.manual_seed(cfg.train.seed)
                    net = hf_model(cfg, "mixed" if mode == "fp8" else mode)  # fp8: against its bf16 autocast
                    step = hf_step(net, batches, "mixed" if mode == "fp8" else mode)
                else:
                    trainer = Trainer(cfg)
                    flops = flops_per_token(cfg) * tokens

                    def step(trainer=trainer):
                        trainer.train_step(with_moe_metrics=False)

                ms, peak = _time(step, warmup, iters)
                if trace:
                    chrome_trace(step, f"{trace}/{model}-{mode}-{impl}.json.gz")
                extra = {}
                if phases:
                    top: list = []
                    extra = {"phases_ms": profile_gpu_ms(step, PHASES, 2, top), "top_kernels": top}
                    if trainer is not None:
                        extra["optimizer_gb_moved"] = round(optimizer_bytes(trainer) / 1e9, 2)
                        extra["copy_tbps"] = round(copy_tbps(), 2)
                tflops = flops / ms / 1e9
                records.append(
                    record(
                        shape,
                        impl,
                        ms,
                        flops,
                        peak,
                        precision=mode,
                        tokens_per_s=round(tokens / ms * 1e3),
                        mfu=round(tflops / dense, 3),
                        dense_tflops=round(dense, 1),
                        **extra,
                    )  # fmt: skip
                )
            except Exception as ex:
                records.append(
                    record(shape, impl, None, None, None, precision=mode, error=f"{type(ex).__name__}: {ex}"[:300])
                )
            finally:
                if trainer is not None:
                    trainer.rt.shutdown()
                trainer = net = None
                _free()
            print(json.dumps(records[-1]), flush=True)
    return records
