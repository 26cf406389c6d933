"""Router replay: a recorded forward's expert choice is reproduced after the router weights change, the
weights follow the current scores, recomputation and files work, and mismatches are clear errors."""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config, ConfigError, load_config
from moecore.models.transformer import MoETransformer
from moecore.moe.router_replay import RouterReplay, attach_router_replay, setup_router_replay

VOCAB = 53


def _cfg(**moe) -> Config:
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_layers, m.num_attention_heads, m.num_kv_heads = 32, 2, 2, 1
    m.ffn_hidden_size, m.vocab_size, m.fused_cross_entropy = 64, VOCAB, False
    cfg.moe.num_experts, cfg.moe.ffn_hidden_size, cfg.moe.router_topk = 8, 16, 2
    for k, v in moe.items():
        setattr(cfg.moe, k, v)
    return cfg.validate()


def _ids(batch: int = 2, seq: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _routers(model):
    return [layer.mlp.router for layer in model.layers if layer.is_moe]


def _capture(model) -> list[torch.Tensor]:
    """The top-k indices each router chose in the next forward (a forward hook, independent of the store)."""
    seen: list[torch.Tensor] = []
    for r in _routers(model):
        r.register_forward_hook(lambda mod, inp, out: seen.append(out.topk_idx_TK.clone()))
    return seen


def _perturb(model, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in _routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.5)


@pytest.mark.parametrize("moe_kw", [dict(), dict(router_pre_softmax=True), dict(router_score_function="sigmoid")])
def test_replay_reproduces_the_recorded_choice(tmp_path, moe_kw):
    torch.manual_seed(0)
    model = MoETransformer(_cfg(**moe_kw))
    seen = _capture(model)
    store = attach_router_replay(model, RouterReplay("record"))
    batches = [_ids(seed=0), _ids(batch=1, seq=7, seed=1)]  # two micro-batches of different shapes
    with torch.no_grad():
        for ids in batches:
            model(ids)
    recorded = [t.clone() for t in seen]
    store.save(tmp_path / "routes.pt")
    assert store.num_forwards("layers.0.mlp.router") == 2

    _perturb(model)
    attach_router_replay(model, None)
    seen.clear()
    with torch.no_grad():
        for ids in batches:
            model(ids)
    free = [t.clone() for t in seen]
    changed = sum(int((torch.sort(a, 1)[0] != torch.sort(b, 1)[0]).any(1).sum()) for a, b in zip(free, recorded))
    assert changed > 5  # the perturbation really changes the routing, so the replay check below means something

    attach_router_replay(model, RouterReplay.load(tmp_path / "routes.pt"))
    seen.clear()
    logits_TE = []
    for r in _routers(model):
        r.register_forward_hook(lambda mod, inp, out: logits_TE.append((out.logits_TE, out.topk_weight_TK)))
    with torch.no_grad():
        for ids in batches:
            model(ids)
    assert len(seen) == len(recorded) == 4
    for got, want in zip(seen, recorded):
        assert torch.equal(got, want.long())
    # the weights are the current router's scores at the replayed experts, normalised as configured
    cfg = _cfg(**moe_kw).moe
    for (logits, weight), idx in zip(logits_TE, recorded):
        idx = idx.long()
        if cfg.router_score_function == "sigmoid":
            picked = torch.sigmoid(logits).gather(1, idx)
            ref_w = picked / (picked.sum(-1, keepdim=True) + 1e-20)
        elif cfg.router_pre_softmax:
            picked = torch.softmax(logits, dim=-1).gather(1, idx)
            ref_w = picked / picked.sum(-1, keepdim=True)
        else:
            ref_w = torch.softmax(logits.gather(1, idx), dim=-1)
        torch.testing.assert_close(weight, ref_w, rtol=0, atol=0)


def test_replay_with_backward_and_recompute_gives_gradients():
    torch.manual_seed(0)
    cfg = _cfg()
    cfg.model.recompute_modules = ["moe"]
    model = MoETransformer(cfg)
    store = attach_router_replay(model, RouterReplay("record"))
    ids = _ids()
    model(ids, labels=ids).loss.backward()  # the recomputation inside backward records nothing more
    assert store.num_forwards("layers.1.mlp.router") == 1
    rec0, rec1 = (store.records[f"layers.{i}.mlp.router"][0].long() for i in (0, 1))

    _perturb(model)
    model.zero_grad()
    free = _capture(model)
    with torch.no_grad():
        model(ids)
    assert not torch.equal(free[1], rec1)  # the perturbed router alone would route otherwise
    for r in _routers(model):
        r._forward_hooks.clear()
    replay = RouterReplay("replay", store.records, store.topk)
    attach_router_replay(model, replay)
    seen = _capture(model)
    model(ids, labels=ids).loss.backward()
    assert len(seen) == 4  # forward of layers 0, 1, then their recomputation in backward: 1, 0
    for got, want in zip(seen, (rec0, rec1, rec1, rec0)):
        assert torch.equal(got, want)
    assert model.layers[1].mlp.router.weight.grad.abs().sum() > 0


def test_token_count_mismatch_is_a_clear_error():
    torch.manual_seed(0)
    model = MoETransformer(_cfg())
    store = attach_router_replay(model, RouterReplay("record"))
    with torch.no_grad():
        model(_ids(batch=2, seq=10))
    attach_router_replay(model, RouterReplay("replay", store.records, store.topk))
    with pytest.raises(ValueError, match=r"routes 8 tokens but 20 were recorded") as err:
        with torch.no_grad():
            model(_ids(batch=1, seq=8))
    assert "\n" not in str(err.value)


def test_running_past_the_recording_and_other_models_are_errors():
    torch.manual_seed(0)
    model = MoETransformer(_cfg())
    store = attach_router_replay(model, RouterReplay("record"))
    with torch.no_grad():
        model(_ids())
    attach_router_replay(model, RouterReplay("replay", store.records, store.topk))
    with torch.no_grad():
        model(_ids())
        with pytest.raises(ValueError, match="called for forward 2 but the recording holds 1 forwards"):
            model(_ids())
    other = MoETransformer(_cfg(first_k_dense_replace=1))
    with pytest.raises(ValueError, match="recorded routers do not match"):
        attach_router_replay(other, RouterReplay("replay", store.records, store.topk))
    with pytest.raises(ValueError, match="recorded top-k 2 != moe.router_topk=3"):
        attach_router_replay(MoETransformer(_cfg(router_topk=3)), RouterReplay("replay", store.records, store.topk))


def test_config_fields_and_setup(tmp_path):
    with pytest.raises(ConfigError, match="moe.router_replay_mode='play' is invalid: allowed: none | record | replay"):
        load_config("tiny-moe", ["moe.router_replay_mode=play"]).validate()
    with pytest.raises(ConfigError, match="moe.router_replay_path=None is invalid"):
        load_config("tiny-moe", ["moe.router_replay_mode=record"]).validate()
    with pytest.raises(ConfigError, match="no such file to replay"):
        load_config(
            "tiny-moe", ["moe.router_replay_mode=replay", f"moe.router_replay_path={tmp_path / 'x.pt'}"]
        ).validate()
    cfg = _cfg(router_replay_mode="record", router_replay_path=str(tmp_path / "r.pt"))
    model = MoETransformer(cfg)
    store = setup_router_replay(model, cfg.moe)
    with torch.no_grad():
        model(_ids())
    store.save(cfg.moe.router_replay_path)
    cfg.moe.router_replay_mode = "replay"
    replay = setup_router_replay(model, cfg.validate().moe)
    assert replay.mode == "replay" and replay.num_forwards("layers.0.mlp.router") == 1


def test_training_run_records_then_replays(tmp_path):
    from moecore.train.loop import train

    args = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_attention_heads=2",
        "model.num_kv_heads=1",
        "moe.num_experts=4",
        "moe.ffn_hidden_size=32",
        "train.seq_length=16",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.eval_interval=0",
        "train.steps=2",
        "train.device=cpu",
        "log.progress=false",
        "log.tensorboard=false",
        f"moe.router_replay_path={tmp_path / 'routes.pt'}",
    ]
    rec = train(load_config("tiny-moe", args + ["moe.router_replay_mode=record", f"train.run_dir={tmp_path / 'a'}"]))
    store = RouterReplay.load(tmp_path / "routes.pt")
    assert store.num_forwards("layers.1.mlp.router") == 4  # 2 steps x 2 micro-batches
    assert store.records["layers.1.mlp.router"][0].shape == (32, 2)
    rep = train(load_config("tiny-moe", args + ["moe.router_replay_mode=replay", f"train.run_dir={tmp_path / 'b'}"]))
    assert rep.losses == rec.losses  # same seed, same data, same routes: the same run


def test_a_pipeline_stage_without_routers_records_and_replays_nothing(tmp_path):
    """Under pipeline parallel a rank may hold dense layers only: its store records nothing and its (empty) file
    replays; a whole model without a router is still an error."""
    stage = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="it has no MoE router"):
        attach_router_replay(stage, RouterReplay("record"))
    store = attach_router_replay(stage, RouterReplay("record"), require_router=False)
    stage(torch.randn(2, 4))
    path = store.save(tmp_path / "routes.pt.rank-0")
    replay = attach_router_replay(stage, RouterReplay.load(path), require_router=False)
    assert replay.records == {} and replay.mode == "replay"
