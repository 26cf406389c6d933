"""train.cuda_graphs: captured decoder-layer parts replay to the same training as eager execution.

On CPU the graphs are simulated (moecore/models/cuda_graphs.py `simulate`: the replay re-runs the
captured step on the same static tensors), which checks the plumbing — static inputs and outputs,
gradient slots, the MoE aux outputs, buffer restore, eager fallback — under gradient accumulation and
activation recomputation, bit for bit. On a GPU (marked gpu) real CUDA graphs run 20 training steps of
a tiny recipe against eager execution.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from moecore.config import ConfigError, load_config
from moecore.models.cuda_graphs import apply_cuda_graphs
from moecore.models.transformer import MoETransformer

TINY = [
    "model.hidden_size=32",
    "model.num_layers=3",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_hidden_size=64",
    "moe.num_experts=4",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
    "moe.first_k_dense_replace=1",
    "moe.router_enable_expert_bias=true",
    "moe.router_load_balancing_type=[aux_loss,seq_aux_loss]",
    "moe.aux_loss_coeff=[0.01,0.001]",
    "train.seq_length=16",
    "train.eval_interval=0",
]


def _train(model: MoETransformer, steps: int = 3, micro_batches: int = 2) -> tuple[list, list]:
    """A few SGD steps with gradient accumulation; (losses, per-step MoE stats of the last micro-batch)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    losses, stats = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            mask = (torch.rand(2, 16, generator=gen) > 0.2).float()
            out = model(ids, labels=ids.roll(-1, 1), loss_mask=mask)
            out.loss.backward()
            losses.append(out.loss.detach())
            stats.append([{k: v.clone() for k, v in s.items() if k != "layer"} for s in out.moe_stats])
        opt.step()
        for m in model.moe_layers():
            m.update_expert_bias()
    return losses, stats


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("attention", []),
        ("attention", ["model.recompute_granularity=full"]),
        ("moe_static", []),
        ("moe_static", ["model.recompute_granularity=selective", "model.recompute_modules=[moe,norm]"]),
        ("full", ["moe.sync_free=true"]),
        ("full", ["moe.sync_free=true", "moe.activation_memory=minimal", "moe.router_enable_expert_bias=false",
                  "model.recompute_granularity=full"]),
    ],
)  # fmt: skip
def test_simulated_graphs_train_like_eager(mode, extra):
    cfg = load_config(
        "tiny-moe", [*TINY, *extra, "model.vocab_size=64", f"train.cuda_graphs={mode}", "train.device=cuda"]
    )
    cfg.train.device = "auto"
    torch.manual_seed(0)
    eager = MoETransformer(cfg)
    graphed = copy.deepcopy(eager)
    assert apply_cuda_graphs(graphed, mode, simulate=True) == 3
    want_loss, want_stats = _train(eager)
    got_loss, got_stats = _train(graphed)
    for layer in graphed.layers:  # every layer captured its part on the first step
        g = layer.cuda_graphs
        parts = [g.attention, g.moe_head, g.whole]
        assert any(p is not None and p.capture is not None for p in parts)

    # Not bit for bit: a captured block sums the gradient contributions of its input (e.g. the norm's
    # composite ops on CPU) before autograd adds the residual's, a different association of the same fp32
    # sum; so fp32 tolerances (a few ulps, grown over 3 SGD steps).
    def close(a, b, name):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item()), msg=name)

    close(torch.stack(got_loss), torch.stack(want_loss), "loss")
    for a, b in zip(got_stats, want_stats):
        for sa, sb in zip(a, b):
            assert sa.keys() == sb.keys()
            for k in sa:
                close(sa[k], sb[k], k)
    for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
        close(p, q, n)
    for (n, b), c in zip(graphed.named_buffers(), eager.buffers()):
        close(b, c, n)  # the expert-bias counts were not disturbed by the capture's warm-up
    # evaluation (no gradients) runs eagerly
    graphed.eval()
    eager.eval()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        close(graphed(ids).logits, eager(ids).logits, "eval logits")
    ids = torch.randint(0, 64, (2, 16))  # the captured shape, gradients on, eval mode: still eager
    blocks = [b for layer in graphed.layers for b in (layer.cuda_graphs.attention, layer.cuda_graphs.moe_head,
              layer.cuda_graphs.whole) if b is not None]  # fmt: skip
    replays = [b.replays for b in blocks]
    assert min(replays) >= 6  # one per training micro-batch (3 steps x 2), again where recomputed
    close(graphed(ids).logits, eager(ids).logits, "eval logits with grad")
    assert [b.replays for b in blocks] == replays


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.cuda_graphs=attention", "train.device=cpu"], "needs a CUDA device"),
        (["train.cuda_graphs=full", "train.device=cuda"], "needs moe.sync_free=true"),
        (["train.cuda_graphs=attention", "train.device=cuda", "parallel.pp=2"], "needs parallel.pp=1"),
        (["train.cuda_graphs=attention", "train.device=cuda", "train.precision=fp16"], "train.precision"),
        (["train.cuda_graphs=moe_static", "train.device=cuda", "moe.router_load_balancing_type=global_aux_loss",
          "moe.aux_loss_coeff=0.01"],
         "global_aux_loss"),
        (["train.cuda_graphs=full", "train.device=cuda", "moe.sync_free=true", "model.recompute_granularity=full"],
         "expert bias"),
        (["train.cuda_graphs=everything"], "none | attention | moe_static | full"),
        (["train.cuda_graphs=attention", "train.device=cuda", "train.precision=fp8", "fp8.primary_weights=true"],
         "fp8.primary_weights=true"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=re.escape(match)) as e:
        load_config("tiny-moe", [*TINY, *overrides]).validate()
    assert str(e.value).startswith("train.cuda_graphs=") and "\n" not in str(e.value)


def test_trainer_refuses_graphs_without_cuda(tmp_path):
    """train.device=auto on a machine without CUDA: the one-line ConfigError (the CLI prints it, exit code 2)."""
    from moecore.train.loop import Trainer

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = load_config("tiny-moe", [*TINY, f"train.run_dir={tmp_path}", "train.cuda_graphs=attention"])
    with pytest.raises(ConfigError, match=r"^train.cuda_graphs='attention' is invalid: needs a CUDA device"):
        Trainer(cfg)


def test_bench_train_takes_the_graph_overrides(capsys):
    """`moecore bench train ... train.cuda_graphs=...`: the override reaches the config (and is validated)."""
    from moecore.bench import main
    from moecore.bench.train import bench_config

    cfg = bench_config("qwen3-30b-a3b", "bf16", extra=["train.cuda_graphs=full", "moe.sync_free=true"]).validate()
    assert (cfg.train.cuda_graphs, cfg.moe.sync_free) == ("full", True)
    assert main(["train", "--model", "qwen3-30b-a3b", "train.cuda_graphs=full"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.cuda_graphs='full' is invalid" in err and "moe.sync_free" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- GPU: real CUDA graphs

GPU_TOLERANCE = 5e-3  # per-step loss, absolute, bf16 (docs/train.md): when replays differ from eager at all


def _gpu_losses(tmp_path, name: str, mode: str, extra: list) -> list[float]:
    from moecore.train.loop import train

    overrides = [
        *TINY, "train.steps=20", "train.global_batch_size=4", "train.micro_batch_size=2", "train.precision=bf16",
        "train.device=cuda", "log.interval=1", "log.progress=false", "log.tensorboard=false",
        "moe.router_enable_expert_bias=true", f"train.run_dir={tmp_path / name}", f"train.cuda_graphs={mode}",
        "model.hidden_size=64", "moe.ffn_hidden_size=64", "model.ffn_hidden_size=128", *extra,
    ]  # fmt: skip
    torch.manual_seed(0)
    return [loss for _, loss in train(load_config("tiny-moe", overrides)).losses]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "mode,extra",
    [
        ("attention", []),
        ("attention", ["model.recompute_granularity=full"]),
        ("moe_static", []),
        ("full", ["moe.sync_free=true"]),
        ("full", ["moe.sync_free=true", "moe.activation_memory=minimal", "model.recompute_modules=[moe_act,norm]",
                  "model.recompute_granularity=selective"]),
        ("attention", ["train.precision=fp8"]),  # the FP8 linears' quantisation captured with the attention block
        ("moe_static", ["train.precision=fp8"]),
        ("full", ["train.precision=fp8", "moe.sync_free=true"]),  # the FP8 expert FFN (rowwise, sync-free) too
    ],
)  # fmt: skip
def test_gpu_graphs_train_like_eager(tmp_path, mode, extra):
    """20 steps, 2 micro-batches per step (gradient accumulation): losses equal eager's, bit for bit or within
    GPU_TOLERANCE (bf16; replays can pick other GEMM algorithms for the graph pool's addresses)."""
    eager = _gpu_losses(tmp_path, "eager", "none", extra)
    graphed = _gpu_losses(tmp_path, "graphed", mode, extra)
    assert len(eager) == len(graphed) == 20
    diff = max(abs(a - b) for a, b in zip(eager, graphed))
    print(f"cuda_graphs={mode} {extra}: max |loss diff| over 20 steps = {diff:.3g} (bit-identical: {diff == 0})")
    assert diff <= GPU_TOLERANCE, (eager, graphed)
