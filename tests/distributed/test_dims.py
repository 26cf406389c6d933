"""ParallelDims validation and rank layout, shard metadata, and the one-process path (no processes started)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moecore.config import Config, ConfigError, ParallelConfig
from moecore.models.transformer import MoETransformer
from moecore.parallel.data_parallel import global_grad_norm
from moecore.parallel.dims import ParallelDims, _mesh_groups, single_process_dims
from moecore.parallel.layout import validate_layout
from moecore.parallel.sharding import ShardSpec, _chunks, get_shard, set_shard
from moecore.parallel.tensor_parallel import vocab_parallel_cross_entropy


@pytest.mark.parametrize(
    "par, world, kwargs, message",
    [
        ({"ep": 3}, 3, {"num_experts": 8}, "parallel.ep=3 does not divide moe.num_experts=8"),
        ({"pp": 2}, 3, {}, "parallel.pp=2: tp*cp*pp=2 does not divide the world size 3"),
        ({"cp": 3}, 4, {}, "parallel.cp=3: tp*cp*pp=3 does not divide the world size 4"),
        ({"tp": 2}, 3, {}, "parallel.tp=2: tp*cp*pp=2 does not divide the world size 3"),
        ({"ep": 2, "etp": 2}, 2, {"num_experts": 8}, "etp*ep*pp=4 (parallel.etp=2) does not divide the world size 2"),
        ({"tp": 4}, 4, {"num_attention_heads": 6}, "parallel.tp=4 does not divide model.num_attention_heads=6"),
        ({"ep": 2}, 2, {}, "parallel.ep=2 needs MoE layers"),
    ],
)
def test_invalid_layouts_are_refused_naming_the_field(par, world, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(ParallelConfig(**par), world, 0, "cpu", **kwargs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.num_kv_heads": 1}, "parallel.tp=2 does not divide model.num_kv_heads=1"),
        (
            {"model.attention_type": "mla", "model.num_attention_heads": 1, "model.num_kv_heads": 1},
            "parallel.tp=2 is invalid: must divide model.num_attention_heads=1",
        ),
        (
            {
                "model.num_layers": 2,
                "model.layer_types": ["linear_attention", "full_attention"],
                "model.linear_num_key_heads": 1,
            },
            "parallel.tp=2 does not divide model.linear_num_key_heads=1",
        ),
        (  # gpt-oss's down bias splits its hidden columns over etp (models/biased_moe.py)
            {
                "parallel.tp": 1,
                "parallel.etp": 3,
                "moe.num_experts": 4,
                "moe.ffn_hidden_size": 48,
                "model.hidden_size": 64,
                "model.expert_linear_bias": True,
            },
            "parallel.etp=3 does not divide model.hidden_size=64",
        ),
        ({"train.seq_length": 7}, "parallel.tp=2 does not divide train.seq_length=7"),
        (
            {"parallel.etp": 3, "moe.ffn_hidden_size": 16, "parallel.tp": 1},
            "parallel.etp=3 does not divide moe.ffn_hidden_size=16",
        ),
        (
            {"parallel.fsdp": True, "parallel.distributed_optimizer": True},
            "parallel.fsdp=true shards the optimizer state itself",
        ),
        ({"parallel.cp": 2, "train.seq_length": 18}, "train.seq_length=18 is not divisible by 2"),
        (
            {"parallel.cp": 2, "model.attention_dropout": 0.1},
            "model.attention_dropout=0.1 is not supported with parallel.cp=2",
        ),
        (
            {"parallel.cp": 2, "parallel.cp_comm": "a2a", "model.num_attention_heads": 6, "model.head_dim": 16},
            "parallel.cp_comm='a2a' splits the 3 attention heads of a tensor-parallel rank over parallel.cp=2",
        ),
    ],
)
def test_config_preflight_refuses_unsupported_layouts(overrides, message):
    cfg = Config()
    cfg.model.vocab_size = 64
    cfg.parallel.tp = 2
    cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.seq_length = 8, 2, 16
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    world = 6 if cfg.parallel.etp == 3 else 2 * cfg.parallel.cp * cfg.parallel.pp
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate_layout(cfg, world)


def test_rank_layout_folds_attention_and_expert_meshes():
    # world 8, tp 2 (dense mesh: tp, cp, dp, pp) and ep 2 x etp 2 (expert mesh: etp, ep, edp, pp).
    assert _mesh_groups(8, [2, 1, 4, 1], 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp
    assert _mesh_groups(8, [2, 1, 4, 1], 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # dp
    assert _mesh_groups(8, [2, 2, 2, 1], 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # etp == tp groups
    assert _mesh_groups(8, [2, 2, 2, 1], 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # ep
    assert _mesh_groups(8, [2, 2, 2, 1], 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # edp
    assert _mesh_groups(8, [2, 2, 2, 1], (0, 1)) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # ep x etp
    # Every rank is in exactly one group of each kind.
    for groups in (_mesh_groups(8, [2, 2, 2, 1], a) for a in (0, 1, 2, (0, 1))):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_single_process_dims_need_no_torch_distributed():
    dims = single_process_dims()
    assert (dims.dp, dims.edp, dims.tp, dims.ep) == (1, 1, 1, 1)
    assert all(g.size == 1 and g.pg is None for g in dims.groups.values())
    assert dims.is_main and not dims.is_distributed


def test_model_with_one_process_dims_equals_model_without_dims():
    cfg = Config()
    cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.num_layers = 64, 32, 2
    cfg.moe.ffn_hidden_size, cfg.moe.shared_expert_intermediate_size, cfg.moe.first_k_dense_replace = 16, 16, 1
    torch.manual_seed(0)
    a = MoETransformer(copy.deepcopy(cfg), None)
    torch.manual_seed(0)
    b = MoETransformer(copy.deepcopy(cfg), single_process_dims())
    ids = torch.randint(0, 64, (2, 8))
    oa, ob = a(ids, labels=ids), b(ids, labels=ids)
    assert torch.equal(oa.loss, ob.loss)
    oa.loss.backward()
    ob.loss.backward()
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), na
    assert global_grad_norm(b, None) == pytest.approx(
        float(torch.nn.utils.get_total_norm([p.grad for p in a.parameters()])), rel=1e-6
    )


def test_expert_shard_chunks_cover_the_global_block():
    # w13 [E=4, 2F=12, H=2] split over ep (2 experts) and etp (F 6 -> 3): gate rows and up rows.
    E, F_, H = 4, 6, 2
    full = torch.arange(E * 2 * F_ * H, dtype=torch.float32).view(E, 2 * F_, H)
    local = torch.empty(2, 2 * 3, H)
    set_shard(local, "expert", (E, 2 * F_, H), (2, 0, 3, 0), view_shape=(E, 2, F_, H), local_view=(2, 2, 3, H))
    spec = get_shard(local)
    shard = spec.local_of(full)
    assert torch.equal(shard[:, :3], full[2:4, 3:6]) and torch.equal(shard[:, 3:], full[2:4, 9:12])
    pieces = _chunks(spec)
    assert len(pieces) == 2
    covered = torch.zeros_like(full, dtype=torch.bool)
    for offs, sizes, view_sl in pieces:
        block = tuple(slice(o, o + n) for o, n in zip(offs, sizes))
        assert torch.equal(full[block], shard.view(spec.local_view)[view_sl].reshape(sizes))
        covered[block] = True
    assert int(covered.sum()) == shard.numel()


def test_shard_spec_rejects_inconsistent_views():
    with pytest.raises(ValueError, match="does not refine"):
        ShardSpec("expert", (4, 12), (4, 6), (4, 5, 2), (4, 5, 1), (0, 0, 0))
    with pytest.raises(ValueError, match="kind="):
        ShardSpec("sharded", (4,), (4,), (4,), (4,), (0,))


def test_vocab_parallel_cross_entropy_on_one_process_is_torch_cross_entropy():
    logits, labels = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(3, 5)
    assert torch.equal(vocab_parallel_cross_entropy(logits, labels, None), ref)
