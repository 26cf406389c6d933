"""Dense-to-MoE upcycling: the upcycled model's logits equal the dense model's at step 0 (plain and
granular upcycling), the start-up path through the Trainer, and one-line errors for bad input."""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config, ConfigError, load_config
from moecore.models.transformer import MoETransformer
from moecore.moe.upcycle import upcycle_state_dict

VOCAB = 61


def _cfg(num_experts: int, expert_ffn: int = 64, topk: int = 2, **moe) -> Config:
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_layers, m.num_attention_heads, m.num_kv_heads = 32, 3, 2, 1
    m.ffn_hidden_size, m.vocab_size, m.fused_cross_entropy = 64, VOCAB, False
    cfg.moe.num_experts, cfg.moe.ffn_hidden_size, cfg.moe.router_topk = num_experts, expert_ffn, topk
    cfg.moe.router_load_balancing_type, cfg.moe.aux_loss_coeff = "none", 0.0
    cfg.moe.router_dtype = "fp64"  # routing weights sum to one to fp64 precision, like the rest of the model
    for k, v in moe.items():
        setattr(cfg.moe, k, v)
    return cfg.validate()


def _models(moe_cfg: Config, seed: int = 0) -> tuple[MoETransformer, MoETransformer]:
    torch.manual_seed(seed)
    dense = MoETransformer(_cfg(0)).double().eval()
    with torch.no_grad():  # a trained-looking dense model: larger weights than the init, so routing matters
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.manual_seed(seed + 1)
    moe = MoETransformer(moe_cfg).double().eval()
    moe.load_state_dict(upcycle_state_dict(dense.state_dict(), moe_cfg, moe.state_dict()))
    return dense, moe


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _experts_used(moe: MoETransformer, ids: torch.Tensor) -> int:
    out = moe(ids)
    return int(sum((s["tokens_per_expert"] > 0).sum() for s in out.moe_stats))


@pytest.mark.parametrize(
    "moe_kw",
    [
        dict(),  # softmax after top-k (Megatron-Core's default)
        dict(router_pre_softmax=True, norm_topk_prob=True),  # Mixtral / Qwen3-MoE
        dict(router_score_function="sigmoid", norm_topk_prob=True),  # DeepSeek-V3 style
        dict(first_k_dense_replace=1),  # a dense layer stays dense
    ],
)
def test_plain_upcycling_keeps_the_dense_logits(moe_kw):
    cfg = _cfg(4, expert_ffn=64, **moe_kw)
    dense, moe = _models(cfg)
    ids = _ids()
    with torch.no_grad():
        want, got = dense(ids).logits, moe(ids).logits
        assert _experts_used(moe, ids) > 4  # tokens really spread over several experts
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # every expert is the dense MLP
    w13 = moe.state_dict()["layers.1.mlp.experts.w13"]
    ref = torch.cat(
        [dense.state_dict()["layers.1.mlp.gate_proj.weight"], dense.state_dict()["layers.1.mlp.up_proj.weight"]]
    )
    for e in range(4):
        assert torch.equal(w13[e], ref)


@pytest.mark.parametrize(
    "num_experts,expert_ffn,topk,moe_kw",
    [
        (4, 32, 2, {}),  # G=2, 2 copies, one group per token
        (8, 16, 4, {}),  # G=4, 2 copies
        (8, 32, 4, dict(router_pre_softmax=True, norm_topk_prob=True)),  # G=2, two groups per token
    ],
)
def test_granular_upcycling_keeps_the_dense_logits(num_experts, expert_ffn, topk, moe_kw):
    cfg = _cfg(num_experts, expert_ffn=expert_ffn, topk=topk, **moe_kw)
    dense, moe = _models(cfg)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=1e-12, atol=1e-12)
    g = 64 // expert_ffn
    sd, dsd = moe.state_dict(), dense.state_dict()
    # expert e holds FFN columns of slice e mod G, its down projection times G
    e = num_experts - 1
    cols = slice((e % g) * expert_ffn, (e % g + 1) * expert_ffn)
    assert torch.equal(sd["layers.0.mlp.experts.w2"][e], dsd["layers.0.mlp.down_proj.weight"][:, cols] * g)
    # virtual groups: the G experts of a group share one router row
    router = sd["layers.0.mlp.router.weight"]
    assert torch.equal(router[0], router[g - 1]) and not torch.equal(router[0], router[g])


def test_granular_without_the_scale_is_off_by_g():
    """The factor G is needed: without it the MoE output is the dense MLP's divided by G."""
    cfg = _cfg(4, expert_ffn=32, topk=2)
    dense, moe = _models(cfg)
    layer_d, layer_m = dense.layers[0].mlp, moe.layers[0].mlp
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        y_d = layer_d(x)
        layer_m.experts.w2.div_(2.0)
        y_m = layer_m(x)[0]
    torch.testing.assert_close(y_m * 2.0, y_d, rtol=1e-12, atol=1e-12)


def test_scaling_factor_is_divided_out():
    cfg = _cfg(4, expert_ffn=64, router_topk_scaling_factor=2.5)
    dense, moe = _models(cfg)
    with torch.no_grad():
        torch.testing.assert_close(moe(_ids()).logits, dense(_ids()).logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "num_experts,expert_ffn,topk,match",
    [
        (4, 48, 2, "not a multiple of moe.ffn_hidden_size=48"),
        (6, 16, 4, "moe.num_experts=6 is not a multiple of the granularity 4"),
        (4, 32, 1, "moe.router_topk=1 is not a multiple of the granularity 2"),
    ],
)
def test_incompatible_shapes_are_one_line_errors(num_experts, expert_ffn, topk, match):
    cfg = _cfg(num_experts, expert_ffn=expert_ffn, topk=topk)
    torch.manual_seed(0)
    dense, moe = MoETransformer(_cfg(0)), MoETransformer(cfg)
    with pytest.raises(ConfigError, match=match) as err:
        upcycle_state_dict(dense.state_dict(), cfg, moe.state_dict())
    assert "\n" not in str(err.value) and str(err.value).startswith("checkpoint.upcycle_from is invalid")


def test_other_hidden_size_is_refused():
    cfg = _cfg(4)
    dense_cfg = _cfg(0)
    dense_cfg.model.hidden_size, dense_cfg.model.num_attention_heads = 16, 2
    with pytest.raises(ConfigError, match="shape"):
        upcycle_state_dict(MoETransformer(dense_cfg).state_dict(), cfg, MoETransformer(cfg).state_dict())


TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_hidden_size=64",
    "model.fused_cross_entropy=false",
    "train.seq_length=16",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "log.progress=false",
    "log.tensorboard=false",
    "train.device=cpu",
]


def test_trainer_upcycles_at_start_not_on_resume(tmp_path):
    from moecore.train.loop import Trainer, train

    dense_run = train(
        load_config("tiny-moe", TINY + ["moe.num_experts=0", "train.steps=2", f"train.run_dir={tmp_path / 'd'}"])
    )
    ckpt = dense_run.run_dir / "checkpoints" / "step-2"
    moe_args = TINY + [
        "moe.num_experts=4",
        "moe.ffn_hidden_size=32",
        "moe.router_topk=2",
        "moe.shared_expert_intermediate_size=0",
        f"train.run_dir={tmp_path / 'm'}",
    ]
    dense_t = Trainer(load_config("tiny-moe", TINY + ["moe.num_experts=0", "checkpoint.load=" + str(ckpt)]))
    moe_t = Trainer(load_config("tiny-moe", moe_args + [f"checkpoint.upcycle_from={ckpt}", "train.steps=1"]))
    ids = torch.randint(0, dense_t.cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    dense_t.model.eval(), moe_t.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            moe_t.model(ids).logits, dense_t.model(ids).logits, rtol=1e-5, atol=1e-6
        )  # measured 6e-8 in fp32
    moe_t.run()
    # resuming the MoE run must not upcycle again: its weights are the trained ones
    resumed = Trainer(
        load_config(
            "tiny-moe", moe_args + [f"checkpoint.upcycle_from={ckpt}", "checkpoint.resume=true", "train.steps=1"]
        )
    )
    for k, v in moe_t.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k


def test_bad_folders_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.upcycle_from=.*no such checkpoint folder"):
        load_config("tiny-moe", [f"checkpoint.upcycle_from={tmp_path / 'nope'}"]).validate()
    with pytest.raises(ConfigError, match="needs moe.num_experts > 0"):
        load_config("tiny-moe", [f"checkpoint.upcycle_from={tmp_path}", "moe.num_experts=0"]).validate()
    from moecore.moe.upcycle import dense_config

    with pytest.raises(ConfigError, match="not a moecore checkpoint folder"):
        dense_config(tmp_path)
