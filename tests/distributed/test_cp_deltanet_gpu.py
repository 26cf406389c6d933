"""Gated DeltaNet under context parallel on GPUs (NCCL, Triton kernels) against one GPU, sequence 16384.

`torchrun --nproc-per-node N` runs this file as a script (N = cp = 2, and 4 where there are 4 GPUs). Every
rank builds the same layer (Qwen3-Next head dims: Dk = Dv = 128, 2 value heads per key head) and the same
data, computes the full-sequence reference on its own GPU, then the CP layer on its two chunks; it compares
the output and input gradient at its positions and the weight gradients summed over CP (fp32, relative
Frobenius error, bar 1e-4 as the other fp32 GPU parity tests: 3xTF32 dots and another summation order).
Rank 0 prints the errors, the forward + backward times of both and the peak memory of the CP step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

SEQ, HIDDEN = 16384, 1024


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _step(layer, x, w):
    """Forward + backward of a fixed random loss; (output, input grad, seconds)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * w).sum().backward()
    torch.cuda.synchronize()
    return y.detach(), x.grad, time.perf_counter() - t0


def main() -> None:
    from moecore.config import ModelConfig, ParallelConfig
    from moecore.models.linear_attention import GatedDeltaNet
    from moecore.parallel.comm import all_reduce_
    from moecore.parallel.context import split_for_cp
    from moecore.parallel.dims import destroy_distributed, init_distributed

    world = int(os.environ["WORLD_SIZE"])
    dims = init_distributed(ParallelConfig(cp=world), seed=0, device="cuda")
    dev = dims.device
    cfg = ModelConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        linear_chunk_size=64,
    )
    torch.manual_seed(0)
    ref = GatedDeltaNet(cfg, 0).to(dev)
    layer = GatedDeltaNet(cfg, 0, dims).to(dev)
    layer.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, SEQ, HIDDEN, generator=gen).to(dev)
    w = torch.randn(1, SEQ, HIDDEN, generator=gen).to(dev)

    _step(layer, split_for_cp(x, dims), split_for_cp(w, dims))  # compile / autotune the kernels
    layer.zero_grad()
    torch.cuda.reset_peak_memory_stats()
    y, dx, t_cp = _step(layer, split_for_cp(x, dims), split_for_cp(w, dims))
    peak_cp = torch.cuda.max_memory_allocated() / 2**30
    _step(ref, x, w)
    ref.zero_grad()
    y_ref, dx_ref, t_ref = _step(ref, x, w)

    errs = {"out": _rel(y, split_for_cp(y_ref, dims)), "dx": _rel(dx, split_for_cp(dx_ref, dims))}
    for (name, p), (_, p_ref) in zip(layer.named_parameters(), ref.named_parameters()):
        errs[f"d{name}"] = _rel(all_reduce_(p.grad.clone(), dims.cp_group), p_ref.grad)
    worst = torch.tensor(max(errs.values()), device=dev)
    all_reduce_(worst, dims.world_group, "max")
    if dims.rank == 0:
        print(" ".join(f"{k}={v:.1e}" for k, v in errs.items()))
        print(
            f"cp{world} seq {SEQ}: fwd+bwd {t_cp * 1e3:.1f} ms (one GPU {t_ref * 1e3:.1f} ms), peak {peak_cp:.2f} GiB"
        )
        print(f"worst={worst.item():.3e}")
    destroy_distributed()
    if worst.item() >= 1e-4:
        raise SystemExit(f"CP DeltaNet differs from one GPU: {errs}")


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_gpu_cp_deltanet_matches_one_gpu(cp):
    if not torch.cuda.is_available() or torch.cuda.device_count() < cp:
        pytest.skip(f"needs {cp} CUDA GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), __file__]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "worst=" in proc.stdout


if __name__ == "__main__":
    main()
