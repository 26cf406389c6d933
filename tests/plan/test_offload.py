"""Activation offloading (model.offload_modules): the saved tensors go through the host and come back unchanged.

On CPU the host copy is a clone, so these tests check the mechanics: the hooks pack the tensors of the
chosen modules (and not parameters), every packed tensor is unpacked in backward, and the loss and
every gradient equal the run without offloading bit for bit, alone and combined with recomputation,
over two accumulated micro-batches. The GPU test checks the same on CUDA with pinned memory and the
side stream, and that the memory the forward leaves drops.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config
from moecore.models.offload import apply_offload, modules_for
from moecore.models.transformer import MoETransformer


def _config(offload=(), recompute=(), layers=3) -> Config:
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers, m.ffn_hidden_size = 64, 32, layers, 48
    m.num_attention_heads, m.num_kv_heads, m.qk_norm = 4, 2, True
    e.num_experts, e.router_topk, e.ffn_hidden_size, e.first_k_dense_replace = 8, 2, 16, 1
    e.shared_expert_intermediate_size = 24
    m.offload_modules = list(offload)
    m.recompute_modules = list(recompute)
    m.recompute_granularity = "selective" if recompute else "none"
    return cfg


def _grads(cfg: Config, device: str = "cpu", dtype=torch.float32):
    torch.manual_seed(0)
    with torch.device(device):
        model = MoETransformer(cfg).to(dtype)
    off = getattr(model, "_offloader", None)
    if off is not None:
        off.min_bytes = 0
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):  # two accumulated micro-batches
        ids = torch.randint(0, 64, (2, 16), generator=g).to(device)
        out = model(ids, labels=torch.roll(ids, -1, 1))
        out.loss.backward()
        losses.append(out.loss.detach())
    return model, losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "offload,recompute",
    [
        (("moe_act",), ()),
        (("moe", "mlp", "core_attn", "norm"), ()),
        (("moe_act", "shared_experts", "norm"), ("norm", "moe_act")),
        (("moe",), ("moe", "core_attn")),
    ],
)
def test_offloading_is_bit_identical_and_moves_every_saved_tensor_back(offload, recompute) -> None:
    _, ref_losses, ref = _grads(_config((), recompute))
    model, losses, grads = _grads(_config(offload, recompute))
    off = model._offloader
    assert off.stats["packed"] > 0 and off.stats["unpacked"] == off.stats["packed"]
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert grads.keys() == ref.keys()
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name


def test_parameters_eval_and_no_grad_forwards_are_not_offloaded() -> None:
    cfg = _config(("moe", "core_attn"))
    model = MoETransformer(cfg)
    model._offloader.min_bytes = 0
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        model(ids)
    model.eval()
    model(ids, labels=ids)
    assert model._offloader.stats["packed"] == 0
    model.train()
    seen = []
    pack = model._offloader.pack

    def spy(t):
        out = pack(t)
        seen.append((t, out))
        return out

    model._offloader.pack = spy  # the hooks look the method up at each module call
    model(ids, labels=ids).loss.backward()
    params = {id(p) for p in model.parameters()}
    offloaded = [t for t, out in seen if out is not t]
    kept = [t for t, out in seen if out is t]
    assert offloaded and all(id(t) not in params for t in offloaded)
    assert any(id(t) in params for t in kept)  # the weights the matmuls saved stay where they are


def test_selection_keeps_the_outermost_modules() -> None:
    model = MoETransformer(_config())
    mods = modules_for(model, ["moe", "moe_act", "shared_experts"])
    assert len(mods) == 2 and all(type(m).__name__ == "MoELayer" for m in mods)  # experts inside are covered
    assert len(modules_for(model, ["norm"])) == 6
    with pytest.raises(ValueError, match="model.offload_modules"):
        apply_offload(model, ["attention"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offloading_is_bit_identical_and_frees_device_memory() -> None:
    _, ref_losses, ref = _grads(_config((), (), layers=4), "cuda", torch.bfloat16)
    model, losses, grads = _grads(_config(("moe_act", "core_attn"), (), layers=4), "cuda", torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(grads[n], ref[n]) for n in ref)
    assert model._offloader.stats["packed"] > 0


def test_a_dropped_graph_leaves_nothing_behind() -> None:
    model = MoETransformer(_config(("moe", "core_attn")))
    off = model._offloader
    off.min_bytes = 0
    ids = torch.randint(0, 64, (1, 8))
    out = model(ids, labels=ids)  # forward whose backward never runs
    first = len(off.groups)
    assert first > 0
    del out
    model(ids, labels=ids).loss.backward()
    model(ids, labels=ids)
    assert len(off.groups) == first  # only the last forward's groups: the dropped ones were released


def test_host_copies_keep_the_saved_views_strides() -> None:
    """A saved column slice, transpose or expanded view comes back with its own strides (backward's kernels, and
    so the gradients' last bits, can depend on them), the copy holding its own memory."""
    from moecore.models.offload import _copy_like

    x = torch.randn(6, 8)
    for view in (x, x[:, :3], x.t(), x[::2], torch.randn(3, 1).expand(3, 5), x[:0]):
        c = _copy_like(view, torch.device("cpu"))
        assert c.shape == view.shape and c.stride() == view.stride() and torch.equal(c, view)
        assert view.numel() == 0 or c.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
