"""Activation memory per rank against the context-parallel degree: one training micro-batch per sequence length.

Usage (GPUs): torchrun --nproc-per-node CP benchmarks/cp_memory.py OUT.jsonl [--recipe tiny-qwen3-moe]
              [--seq 8192,16384,32768] [--set model.num_layers=4 ...]
Run it once per CP degree (1, 2, 4, 8: world size = cp, so dp = 1); each run appends one JSON line per
sequence length to OUT.jsonl. With 1 process it measures the run without CP.
On CPU (`--device cpu`, gloo) the peak is not measured; the saved bytes are (below).

Per sequence length: a warm-up forward + backward (so gradients and optimizer-free buffers exist), then the
peak of torch.cuda.max_memory_allocated over a second forward + backward of one sequence (micro-batch 1,
fp32 unless --set train.precision=bf16) minus the memory allocated before it: the activations, attention
workspaces and transient gradient buffers of one micro-batch on this rank. On every device, also the bytes
autograd saves for backward during that forward (distinct storages, parameters excluded:
`moecore.bench.saved_memory.saved_bytes`), which is what grows with the tokens a rank holds. Reported: the
largest over the ranks, the seconds of the measured forward + backward, and the layout. `parallel.cp_comm` is set by --comm.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from moecore.bench.saved_memory import saved_bytes
from moecore.config import load_config
from moecore.models.transformer import MoETransformer
from moecore.parallel import context
from moecore.parallel.dims import destroy_distributed, init_distributed


def measure(model: MoETransformer, dims, seq: int, vocab: int, device: torch.device) -> tuple[float | None, int, float]:
    """(peak bytes above the start of one forward + backward, or None off CUDA; bytes saved for backward;
    the seconds of the forward + backward)."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = context.split_batch_for_cp({"input_ids": ids, "labels": ids, "loss_mask": torch.ones_like(ids)}, dims)

    saved: list[torch.Tensor] = []

    def forward() -> torch.Tensor:
        out = model(
            batch["input_ids"],
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            position_ids=batch.get("position_ids"),
        )
        loss = out.lm_loss_sum / seq + (out.aux_loss if out.aux_loss is not None else 0.0)
        return loss + out.mtp_loss if out.mtp_loss is not None else loss

    def step() -> None:
        loss, kept = saved_bytes(forward, exclude=list(model.parameters()))
        saved[:] = kept
        loss.backward()

    step()  # warm-up: gradients allocated
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    saved_total = sum(t.untyped_storage().nbytes() for t in saved)
    return (torch.cuda.max_memory_allocated() - base if cuda else None), saved_total, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--recipe", default="tiny-qwen3-moe")
    ap.add_argument("--seq", default="8192,16384,32768")
    ap.add_argument("--comm", default="ring", choices=("ring", "allgather"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--set", nargs="*", default=[], help="dotted config overrides")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seqs = [int(s) for s in args.seq.split(",")]
    cfg = load_config(args.recipe, [*args.set, f"parallel.cp={world}", f"parallel.cp_comm={args.comm}"])
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = 32768
    cfg.model.max_position_embeddings = max(cfg.model.max_position_embeddings, max(seqs))
    m = cfg.model
    dims = init_distributed(
        cfg.parallel,
        seed=0,
        device=args.device,
        num_experts=cfg.moe.num_experts,
        num_attention_heads=m.num_attention_heads,
    )
    model = MoETransformer(cfg, dims).to(dims.device)
    if cfg.train.precision == "bf16":
        model = model.to(torch.bfloat16)
    for seq in seqs:
        context.check_cp_seq_len(seq, world)
        peak, kept, seconds = measure(model, dims, seq, m.vocab_size, dims.device)
        stats = torch.tensor([float(peak or 0), seconds, float(kept)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if dims.is_main:
            row = {
                "recipe": args.recipe,
                "overrides": args.set,
                "cp": world,
                "cp_comm": args.comm,
                "seq": seq,
                "tokens_per_rank": seq // world,
                "activation_bytes_per_rank": None if peak is None else int(stats[0]),
                "activation_gib_per_rank": None if peak is None else round(float(stats[0]) / 2**30, 3),
                "saved_bytes_per_rank": int(stats[2]),
                "saved_mib_per_rank": round(float(stats[2]) / 2**20, 2),
                "fwd_bwd_s": round(float(stats[1]), 3),
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            }
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    destroy_distributed()


if __name__ == "__main__":
    main()
