"""Each context-parallel attention path on GPUs (NCCL) against the same layer on one GPU, run by torchrun.

Usage: torchrun --nproc-per-node N tests/distributed/cp_gpu_worker.py [SEQ [cuda|cpu]]   (N >= 2 GPUs; cp = N)
For every attention kind (GQA, GQA with a sliding window, Qwen3-Next's gated output, gpt-oss sinks, MLA)
and both exchanges (ring, all-gather), every rank builds the layer twice from one seed: without CP on
the whole sequence (torch's SDPA on one GPU: the reference) and with CP on its chunks. Outputs, input
gradients and parameter gradients (summed over CP) must agree within relative 1e-4 (fp32, TF32 off;
the sums run in another order than SDPA's). Prints one line per case; exits 1 on any failure.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from moecore.config import ModelConfig, ParallelConfig
from moecore.models.decoder_layer import build_attention
from moecore.parallel import context
from moecore.parallel.dims import ParallelDims, destroy_distributed, init_distributed


def _model_config(kind: str) -> ModelConfig:
    m = ModelConfig(hidden_size=256, num_attention_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=32768)
    if kind == "gqa-swa":
        m.sliding_window = 4096
    elif kind == "gated":
        m.attn_output_gate = True
    elif kind == "sinks":
        m.attn_sinks = True
    elif kind == "mla":
        m.attention_type, m.num_kv_heads, m.q_lora_rank, m.kv_lora_rank = "mla", 8, 128, 64
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.rope_interleave = 64, 32, 64, True
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def check(kind: str, dims: ParallelDims, seq: int, device: torch.device) -> float:
    m = _model_config(kind)
    torch.manual_seed(0)
    ref = build_attention(m, 0, None).to(device)
    if kind == "sinks":
        with torch.no_grad():
            ref.sinks.normal_()
    layer = build_attention(m, 0, dims).to(device)
    layer.load_state_dict(ref.state_dict())
    g = torch.Generator(device=device).manual_seed(1)  # same inputs on every rank
    x = torch.randn(1, seq, m.hidden_size, device=device, generator=g, requires_grad=True)
    gout = torch.randn(1, seq, m.hidden_size, device=device, generator=g)
    out = ref(x, torch.arange(seq, device=device))
    out.backward(gout)
    xl = context.split_for_cp(x.detach(), dims).requires_grad_(True)
    got = layer(xl, context.cp_position_ids(seq, dims, device))
    got.backward(context.split_for_cp(gout, dims))
    errs = [
        _rel(got.detach(), context.split_for_cp(out.detach(), dims)),
        _rel(xl.grad, context.split_for_cp(x.grad, dims)),
    ]
    for p, q in zip(layer.parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=dims.cp_group.pg)
        errs.append(_rel(grad, q.grad))
    return max(errs)


def main() -> int:
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"  # "cpu": a gloo smoke run of this script
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = int(__import__("os").environ["WORLD_SIZE"])
    dims = {"ring": init_distributed(ParallelConfig(cp=world, cp_comm="ring"), device=device)}
    dims["allgather"] = ParallelDims(
        ParallelConfig(cp=world, cp_comm="allgather"), world, dims["ring"].rank, dims["ring"].device
    )
    failed = 0
    for kind in ("gqa", "gqa-swa", "gated", "sinks", "mla"):
        for comm, d in dims.items():
            err = check(kind, d, seq, d.device)
            bad = not err <= 1e-4
            failed += bad
            if d.rank == 0:
                print(
                    f"cp{world} seq {seq} {kind:8s} {comm:9s} max relative error {err:.2e} {'FAIL' if bad else 'ok'}",
                    flush=True,
                )
    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
