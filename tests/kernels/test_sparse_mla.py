"""The sparse MLA attention kernel (moecore/kernels/sparse_mla.py) against its PyTorch reference
(moecore.models.dsa.sparse_mqa_attention_reference): output, lse and the gradients of q and kv, with
queries that have fewer visible tokens than K (-1 entries), head counts and widths that are not powers of
two; on the GPU also at DeepSeek-V3.2's head shape; and a whole DSA layer (indexer, absorbed MLA, up-projection)
through the kernel against the same layer through the reference. In Triton's interpreter on CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from moecore.config import ModelConfig
from moecore.models import dsa
from moecore.models.dsa import sparse_mqa_attention_reference
from tests.kernels.conftest import rel_err, setup


def _cfg(**over) -> ModelConfig:
    kw = dict(
        hidden_size=48, num_attention_heads=3, num_kv_heads=3, attention_type="dsa", q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, index_n_heads=4,
        index_head_dim=16, index_topk=6, dsa_stage="sparse",
    )  # fmt: skip
    kw.update(over)
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


def _layer(cfg: ModelConfig, seed: int = 0) -> dsa.DSAttention:
    torch.manual_seed(seed)
    layer = dsa.DSAttention(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 3.0) + (1.0 if p.dim() == 1 else 0.0))
    return layer


def _inputs(b, s, nh, dv, dr, k, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, nh, dv + dr, generator=g)
    kv = torch.randn(b, s, dv + dr, generator=g)
    # each query t picks min(k, t + 1) distinct visible tokens at random, -1 for the rest
    idx = torch.full((b, s, k), -1, dtype=torch.long)
    for bb in range(b):
        for t in range(s):
            n = min(k, t + 1)
            idx[bb, t, :n] = torch.randperm(t + 1, generator=g)[:n]
    return q.to(device, dtype), kv.to(device, dtype), idx.to(device)


def _run(fn, q, kv, idx, scale, dv, grad_out):
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = fn(q, kv, idx, scale, dv)
    out.backward(grad_out)
    return out.detach(), lse.detach(), q.grad, kv.grad


@pytest.mark.parametrize("backward", ["atomic", "split"])
@pytest.mark.parametrize(
    "shape,block_h", [((2, 21, 3, 24, 8, 6), 16), ((1, 40, 17, 16, 16, 33), 32)], ids=["small", "wide-k-32-heads"]
)
def test_sparse_mla_kernel_matches_reference(backend, shape, block_h, backward):
    from moecore.kernels.sparse_mla import sparse_mla_attention

    device, _ = setup(backend)
    b, s, nh, dv, dr, k = shape
    q, kv, idx = _inputs(b, s, nh, dv, dr, k, device, torch.float32)
    grad_out = torch.randn(b, s, nh, dv, generator=torch.Generator().manual_seed(5)).to(device)
    scale = (dv + dr) ** -0.5
    ref = _run(sparse_mqa_attention_reference, q, kv, idx, scale, dv, grad_out)
    got = _run(lambda *a: sparse_mla_attention(*a, block_h=block_h, backward=backward), q, kv, idx, scale, dv, grad_out)
    tol = 1e-5 if backend == "interpret" else 2e-3  # TF32 dots on the GPU
    for name, r, g in zip(("out", "lse", "dq", "dkv"), ref, got):
        assert rel_err(g, r) < tol, (name, rel_err(g, r))


@pytest.mark.parametrize("backward", ["atomic", "split"])
def test_lse_gradient_and_no_rope_channels(backend, backward):
    """DeepSeek-V4's use (moecore/models/compressed_attention.py): values are the whole row (no rope block), and
    the sinks gate the output by lse, so lse's gradient must reach q and kv: against the reference's autograd."""
    from moecore.kernels.sparse_mla import sparse_mla_attention

    device, _ = setup(backend)
    b, s, nh, d, k = 2, 13, 5, 32, 7
    q, kv, idx = _inputs(b, s, nh, d, 0, k, device, torch.float32, seed=3)
    g = torch.Generator().manual_seed(6)
    sinks = torch.randn(nh, generator=g).to(device)
    grad_out = torch.randn(b, s, nh, d, generator=g).to(device)

    def gated(fn):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, lse = fn(qq, kk, idx, d**-0.5, d)
        y = out * torch.sigmoid(lse - sinks).unsqueeze(-1)
        y.backward(grad_out)
        return y.detach(), qq.grad, kk.grad

    ref = gated(sparse_mqa_attention_reference)
    got = gated(lambda *a: sparse_mla_attention(*a, backward=backward))
    tol = 1e-5 if backend == "interpret" else 2e-3
    for name, r, x in zip(("out", "dq", "dkv"), ref, got):
        assert rel_err(x, r) < tol, (name, rel_err(x, r))


@pytest.mark.parametrize("backward", ["atomic", "split-atomic", "split-sorted"])
def test_queries_against_a_longer_sequence_match_the_reference(backend, monkeypatch, backward):
    """Context parallel's form: a rank's S queries (positions scattered over the sequence) attend to the N > S
    rows of the gathered sequence; the kernel, through the batch folding of `sparse_mqa_attention_to_sequence`,
    against the reference indexing the N rows directly."""
    import functools

    from moecore.kernels.sparse_mla import SplitBackward, sparse_mla_attention

    device, _ = setup(backend)
    kind, _, reduce = backward.partition("-")
    # the split backward with small scratch chunks, so that its row offsets cross chunks
    split = SplitBackward(b_reduce=reduce or "atomic", scratch_bytes=4096)
    monkeypatch.setattr(
        dsa, "sparse_mqa_attention", functools.partial(sparse_mla_attention, backward=kind, split=split)
    )
    b, n, nh, dv, dr, k = 2, 24, 3, 16, 8, 5
    positions = torch.tensor([0, 1, 2, 9, 10, 11, 12, 21, 22, 23])  # chunks 0 and 3 of 4, say
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, len(positions), nh, dv + dr, generator=g).to(device)
    kv = torch.randn(b, n, dv + dr, generator=g).to(device)
    idx = torch.full((b, len(positions), k), -1, dtype=torch.long)
    for bb in range(b):
        for i, t in enumerate(positions.tolist()):
            m = min(k, t + 1)
            idx[bb, i, :m] = torch.randperm(t + 1, generator=g)[:m]
    idx = idx.to(device)
    grad_out = torch.randn(b, len(positions), nh, dv, generator=g).to(device)
    scale = (dv + dr) ** -0.5
    ref = _run(sparse_mqa_attention_reference, q, kv, idx, scale, dv, grad_out)
    got = _run(dsa.sparse_mqa_attention_to_sequence, q, kv, idx, scale, dv, grad_out)
    tol = 1e-5 if backend == "interpret" else 2e-3  # TF32 dots on the GPU
    for name, r, o in zip(("out", "lse", "dq", "dkv"), ref, got):
        assert rel_err(o, r) < tol, (name, rel_err(o, r))


@pytest.mark.parametrize("reduce", ["atomic", "sorted"])
def test_split_backward_chunks_head_groups_and_shared_rows(backend, reduce):
    """The split backward with every block smaller than what it covers: query rows in several scratch chunks (the
    last one partial), heads in two groups for pass B (so each row gets one share per group), three latent
    channel blocks (the last one partial) besides the rope block, several selected-row tiles (the last partial),
    two sequences, -1 entries, and row 0 of each sequence selected by every query (its dkv sums many shares);
    dkv summed by atomic adds or by the sorted per-row sums."""
    from moecore.kernels.sparse_mla import SplitBackward, sparse_mla_attention

    device, _ = setup(backend)
    b, s, nh, dv, dr, k = 2, 13, 18, 40, 8, 20
    q, kv, idx = _inputs(b, s, nh, dv, dr, k, device, torch.float32, seed=1)
    idx = torch.where(idx == 0, idx[:, :, :1], idx)  # swap row 0 to the front of each query's list
    idx[:, :, 0] = 0
    assert ((idx == 0).sum(-1) == 1).all() and (idx[:, 0, 1:] == -1).all() and idx.shape[-1] % 16
    grad_out = torch.randn(b, s, nh, dv, generator=torch.Generator().manual_seed(6)).to(device)
    scale = (dv + dr) ** -0.5
    per_row = 2 * nh * k * 4 + (2 * k * (dv + dr) * 4 if reduce == "sorted" else 0)  # scratch bytes per query
    split = SplitBackward(
        a_block_h=16, a_block_k=16, b_block_c=16, b_block_h=16, b_block_k=16, b_reduce=reduce,
        scratch_bytes=per_row * 10,
    )  # fmt: skip  # 10 query rows per chunk: 26 rows in chunks of 10, 10, 6
    ref = _run(sparse_mqa_attention_reference, q, kv, idx, scale, dv, grad_out)
    got = _run(lambda *a: sparse_mla_attention(*a, backward="split", split=split), q, kv, idx, scale, dv, grad_out)
    tol = 1e-5 if backend == "interpret" else 2e-3
    for name, r, g in zip(("out", "lse", "dq", "dkv"), ref, got):
        assert rel_err(g, r) < tol, (name, rel_err(g, r))


def test_sparse_mla_rejects_bad_options():
    from moecore.kernels._triton import triton_importable

    if not triton_importable():
        pytest.skip("needs triton")
    from moecore.kernels.sparse_mla import SplitBackward, sparse_mla_attention

    q, kv, idx = _inputs(1, 4, 2, 16, 16, 2, "cpu", torch.float32)
    with pytest.raises(ValueError, match="backward='dense' is invalid"):
        sparse_mla_attention(q, kv, idx, 0.1, 16, backward="dense")
    with pytest.raises(ValueError, match="SplitBackward.b_block_c=48 is invalid"):
        sparse_mla_attention(q, kv, idx, 0.1, 16, backward="split", split=SplitBackward(b_block_c=48))
    with pytest.raises(ValueError, match="SplitBackward.b_reduce='dense' is invalid"):
        sparse_mla_attention(q, kv, idx, 0.1, 16, backward="split", split=SplitBackward(b_reduce="dense"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sparse_mla_kernel_deepseek_shape_bf16():
    """DeepSeek-V3.2's head shape (128 heads, latent 512 + rope 64) in bf16, top-256 of 1024 tokens."""
    from moecore.kernels.sparse_mla import SplitBackward, sparse_mla_attention

    b, s, nh, dv, dr, k = 1, 1024, 128, 512, 64, 256
    q, kv, idx = _inputs(b, s, nh, dv, dr, k, "cuda", torch.bfloat16)
    grad_out = torch.randn(b, s, nh, dv, device="cuda", dtype=torch.bfloat16)
    scale = (128 + dr) ** -0.5
    ref = _run(sparse_mqa_attention_reference, q.float(), kv.float(), idx, scale, dv, grad_out.float())
    for block_h in (16, 32, 64):
        got = _run(lambda *a, bh=block_h: sparse_mla_attention(*a, block_h=bh), q, kv, idx, scale, dv, grad_out)
        for name, r, g in zip(("out", "lse", "dq", "dkv"), ref, got):
            assert rel_err(g.float(), r) < 2e-2, (block_h, name, rel_err(g.float(), r))
    splits = [
        SplitBackward(),
        SplitBackward(a_block_k=32, a_stages=1, a_warps=8, b_block_c=64, b_warps=4),
        SplitBackward(scratch_bytes=300 * nh * k * 4),  # chunks of 300 query rows, the last one partial
        SplitBackward(b_reduce="sorted", scratch_bytes=300 * (nh * k * 4 + k * (dv + dr) * 4)),
    ]
    for split in splits:
        got = _run(
            lambda *a, sp=split: sparse_mla_attention(*a, block_h=64, num_warps=8, backward="split", split=sp),
            q, kv, idx, scale, dv, grad_out,
        )  # fmt: skip
        for name, r, g in zip(("out", "lse", "dq", "dkv"), ref, got):
            assert rel_err(g.float(), r) < 2e-2, (split, name, rel_err(g.float(), r))
    # the sorted reduction sums in a fixed order and dq has no atomics: the same gradients bit for bit
    again = _run(
        lambda *a: sparse_mla_attention(*a, block_h=64, num_warps=8, backward="split", split=splits[-1]),
        q, kv, idx, scale, dv, grad_out,
    )  # fmt: skip
    assert torch.equal(again[2], got[2]) and torch.equal(again[3], got[3])


def _grads(layer, x):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x, torch.arange(x.shape[1], device=x.device))
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device))
    return [out.detach(), x.grad] + [p.grad.clone() for _, p in layer.named_parameters() if p.grad is not None]


@pytest.mark.parametrize("backward", ["atomic", "split"])
def test_dsa_layer_through_kernel_matches_reference(backend, monkeypatch, backward):
    from moecore.kernels.sparse_mla import sparse_mla_attention

    device, _ = setup(backend)
    layer = _layer(_cfg()).to(device)
    x = torch.randn(2, 19, 48).to(device)
    monkeypatch.setattr(dsa, "sparse_mqa_attention", dsa.sparse_mqa_attention_reference)
    ref = _grads(layer, x)
    monkeypatch.setattr(dsa, "sparse_mqa_attention", lambda *a: sparse_mla_attention(*a, backward=backward))
    got = _grads(layer, x)
    tol = 1e-5 if backend == "interpret" else 2e-3
    assert len(ref) == len(got)
    for i, (r, g) in enumerate(zip(ref, got)):
        assert rel_err(g, r) < tol, (i, rel_err(g, r))
