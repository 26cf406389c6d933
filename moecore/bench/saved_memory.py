"""What an MoE layer keeps for backward, in bytes, counted with saved-tensor hooks (runs on CPU).

`saved_bytes(fn, exclude)` runs `fn()` under `torch.autograd.graph.saved_tensors_hooks` and sums the
bytes of the distinct storages autograd saves (a tensor saved twice, or views of one storage, count
once; storages in `exclude`, e.g. the parameters, not at all). `moe_saved_bytes` does it for one
MoE layer forward and splits the total into activations (storages with more than `T * max(K, E)`
elements: hidden- or FFN-sized rows) and routing (indices, probabilities, logits, counts).

`python -m moecore.bench.saved_memory` prints the table of docs/design.md: the standard, minimal and
chunked modes (`moe.activation_memory`) at fixed hidden size and active parameters (top-k x expert FFN
width) as the granularity grows. The standard numbers are for the fused expert FFN path of a GPU
(moecore/kernels/grouped_ffn.py, run here on CPU through torch._grouped_mm).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from unittest import mock

import torch

from moecore.config import MoEConfig


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device)


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, list[torch.Tensor]]:
    """(fn's result, the distinct saved storages as tensors) for one call of fn under saved-tensor hooks."""
    skip = {_storage_key(t) for t in exclude}
    seen: dict[tuple, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip and key not in seen and t.untyped_storage().nbytes():
            seen[key] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, list(seen.values())


def _fused_path_on_cpu():
    """Run GroupedExperts' fused expert FFN Function on CPU (torch._grouped_mm), as it runs on a GPU."""
    from moecore.kernels import grouped_ffn
    from moecore.moe import experts

    def ffn(x, w13, w2, counts, probs, plan=None, sync_free=False, backend="auto", load_spread=None, limit=None):
        plan = grouped_ffn.GemmPlan()
        return grouped_ffn._GroupedFFN.apply(x.contiguous(), w13, w2, counts, probs, plan, "auto", limit)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(experts, "fused_expert_ffn_available", lambda x: True))
    stack.enter_context(mock.patch.object(experts, "expert_ffn", ffn))
    return stack


def moe_saved_bytes(
    num_experts: int,
    topk: int,
    ffn: int,
    hidden: int = 128,
    tokens: int = 256,
    mode: str = "standard",
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """{"activations", "routing", "total"}: bytes one MoE layer forward keeps for backward.

    On CPU (fp32) the standard path runs the GPU's fused expert FFN Function through torch._grouped_mm;
    on CUDA (bf16) every path is the real one.
    """
    from moecore.moe.layer import MoELayer

    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=num_experts, router_topk=topk, ffn_hidden_size=ffn, activation_memory=mode)
    layer = MoELayer(cfg, hidden).to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, hidden, requires_grad=True, device=device, dtype=dtype)
    emulate = mode == "standard" and device == "cpu"
    with _fused_path_on_cpu() if emulate else contextlib.nullcontext():
        (y, aux), saved = saved_bytes(lambda: layer(x), exclude=[*layer.parameters(), x])
    (y.float().square().sum() + aux.loss).backward()  # the saved state is usable
    routing_max = tokens * max(topk, num_experts)
    act = sum(
        t.untyped_storage().nbytes() for t in saved if t.untyped_storage().nbytes() // t.element_size() > routing_max
    )
    total = sum(t.untyped_storage().nbytes() for t in saved)
    return {"activations": act, "routing": total - act, "total": total}


def main() -> None:
    hidden, tokens, active = 256, 1024, 256  # topk * ffn = active expert FFN width per token
    print(f"saved for backward by one MoE layer: hidden {hidden}, {tokens} tokens, fp32, top-k x ffn = {active}")
    modes = ("standard", "minimal", "chunked")
    print("| experts | top-k | ffn | " + " | ".join(f"{m} activations | {m} routing" for m in modes) + " |")
    print("|---|---|---" + "|---|---" * len(modes) + "|")
    mib = 2**20
    for e, k in ((8, 2), (32, 8), (64, 16)):
        f = active // k
        cells = []
        for mode in modes:
            b = moe_saved_bytes(e, k, f, hidden, tokens, mode)
            cells += [f"{b['activations'] / mib:.2f} MiB", f"{b['routing'] / mib:.2f} MiB"]
        print(f"| {e} | {k} | {f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
