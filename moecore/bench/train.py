"""A full training step of a Qwen3-30B-A3B-shaped proxy: moecore's MoETransformer against transformers.

Model (both sides): hidden 2048, 32 query / 4 key-value heads of 128, q/k RMSNorm, 128 experts
top-8 of width 768 (softmax over all experts, top-k, renormalised), vocabulary 151936, 8 layers
(default), untied embeddings, load-balancing loss with coefficient 0.001, bf16 weights. Step:
forward with labels, backward, `torch.optim.AdamW(fused=True)` step, zero_grad, on the same random
token batch (default 2 x 4096). transformers runs `Qwen3MoeForCausalLM` with
`experts_implementation=grouped_mm` and SDPA attention; moecore runs its own model with its fused
kernels (the defaults on CUDA) and the routing weights inside the SwiGLU.

FLOPs per step (the same count for both, as in the reference measurements): 6 * active parameters
* tokens + 12 * layers * heads * head_dim * seq * tokens / 2 (causal attention counted half).
MFU divides the achieved rate by the dense bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import gc
import json

import torch

from moecore.bench.common import cuda_time_ms, dense_bf16_tflops, profile_gpu_ms, record

H, HEADS, KV, HD, E, K, F, V = 2048, 32, 4, 128, 128, 8, 768, 151936


def step_flops(layers: int, seq: int, tokens: int) -> float:
    attn_params = H * HEADS * HD * 2 + H * KV * HD * 2
    active = layers * (attn_params + 3 * H * F * K + H * E) + 2 * V * H
    return 6 * active * tokens + layers * 12 * HEADS * HD * seq * tokens / 2


def _hf_model(layers: int, seq: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=V, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
        moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K, num_hidden_layers=layers,
        max_position_embeddings=seq, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001,
    )  # fmt: skip
    cfg._experts_implementation = "grouped_mm"
    cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(cfg)
    model.gradient_checkpointing_disable()
    return model


VARIANTS = {  # moecore variants timed by `--variants` (the default is "moecore")
    "moecore": "all fused kernels (the CUDA defaults)",
    "moecore-unfused-router": "moe.router_fusion=false: routing and its aux loss through separate torch ops",
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


def _moecore_model(
    layers: int, seq: int, recompute_modules: tuple = (), granularity: str = "none", router_fusion: bool = True
):
    from moecore.config import Config
    from moecore.models.transformer import MoETransformer

    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers = V, H, layers
    m.num_attention_heads, m.num_kv_heads, m.head_dim = HEADS, KV, HD
    m.qk_norm, m.max_position_embeddings, m.tie_embeddings = True, seq, False
    m.fused_cross_entropy = True
    moe.num_experts, moe.router_topk, moe.ffn_hidden_size = E, K, F
    moe.router_pre_softmax, moe.norm_topk_prob = True, True
    moe.router_load_balancing_type, moe.aux_loss_coeff = "aux_loss", 1e-3
    moe.apply_probs_on_input = True
    moe.router_fusion = router_fusion
    m.recompute_modules, m.recompute_granularity = list(recompute_modules), granularity
    cfg.train.seq_length = seq
    cfg.validate()
    return MoETransformer(cfg)


def _train_step(model, ids: torch.Tensor, labels: torch.Tensor):
    """One optimizer step on (ids, labels) as a closure, with its own fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _time_train(model, ids: torch.Tensor, labels: torch.Tensor, hf: bool, warmup: int, iters: int):
    step = _train_step(model, ids, labels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_time_ms(step, warmup, iters)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def run(
    compare_hf: bool,
    warmup: int,
    iters: int,
    batch: int | None,
    layers: int | None,
    seq: int | None,
    variants: tuple[str, ...] = ("moecore",),
    phases: bool = False,
) -> list[dict]:
    batch, layers, seq = batch or 2, layers or 8, seq or 4096
    dense = dense_bf16_tflops()
    tokens = batch * seq
    flops = step_flops(layers, seq, tokens)
    shape = f"qwen3_30b_a3b_proxy_{layers}l_b{batch}_s{seq}"
    torch.manual_seed(0)
    ids = torch.randint(0, V, (batch, seq), device="cuda")
    records = []
    impls = (["transformers-grouped_mm"] if compare_hf else []) + list(variants)
    for impl in impls:
        model = None
        try:
            torch.manual_seed(1)
            hf = impl.startswith("transformers")
            with torch.device("cuda"):  # initialise on the GPU: a CPU init of 5.5B parameters takes minutes
                fused = impl != "moecore-unfused-router"
                model = _hf_model(layers, seq) if hf else _moecore_model(layers, seq, router_fusion=fused)
            model = model.to(torch.bfloat16)
            model.train()
            # transformers shifts labels inside the model; moecore takes them already shifted.
            labels = ids if hf else torch.roll(ids, -1, dims=1)
            ms, peak = _time_train(model, ids, labels, hf, warmup, iters)
            tflops = flops / ms / 1e9
            extra = {"phases_ms": profile_gpu_ms(_train_step(model, ids, labels), PHASES, 2)} if phases else {}
            records.append(
                record(
                    shape,
                    impl,
                    ms,
                    flops,
                    peak,
                    tokens_per_s=round(tokens / ms * 1e3),
                    mfu=round(tflops / dense, 3),
                    dense_tflops=round(dense, 1),
                    **extra,
                )
            )
        except Exception as ex:
            records.append(record(shape, impl, None, None, None, error=f"{type(ex).__name__}: {ex}"[:300]))
        print(json.dumps(records[-1]), flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    return records
