"""Layout-free checkpoints: what one layout saves (model + AdamW state), another layout resumes exactly.

The training-state functions of moecore.checkpoint (torch.distributed.checkpoint underneath) save
sharded tensors as chunks of their global tensors. Here a one-process checkpoint is resumed under
tp2 x ep2 on 4 processes, and a checkpoint written under ep2 x etp2 (dp4) is resumed by one process;
in both cases the next optimizer step gives the reference's loss and weights. Tiny MLA (+ MTP) and gated
DeltaNet models saved under tp2 are resumed by one process the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attn_variants import deltanet_config, mla_config, with_indexer_in_aux
from dist_parity import build, full_state, make_data, make_dims, make_optimizer, tiny_config, train_steps

from moecore.checkpoint import load_training_state, save_training_state
from moecore.models.transformer import MoETransformer
from moecore.parallel.launch import run_local
from moecore.parallel.sharding import global_state_dict

pytestmark = pytest.mark.distributed


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Norm-wise relative error <= 1e-5 (Adam's first steps amplify rounding where gradients are ~eps)."""
    return float((a - b).norm() / b.norm().clamp(min=1e-30)) <= 1e-5


def _layout(**par):
    cfg = tiny_config()
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _ranks(rank: int, world: int, init: dict, data, single_ckpt: str, layout_ckpt: str) -> dict:
    # 1. Resume the one-process checkpoint under tp2 x ep2 and take step 2.
    cfg = _layout(tp=2, ep=2)
    dims = make_dims(cfg, rank, world)
    torch.manual_seed(50 + rank)
    model = MoETransformer(copy.deepcopy(cfg), dims)
    opt = make_optimizer(model)
    extra = load_training_state(single_ckpt, model, opt)
    res = train_steps(model, dims, data, steps=1, opt=opt, first=1)
    state = global_state_dict(model, dims)
    # 2. Under ep2 x etp2, take step 1 from the initial weights and save.
    cfg2 = _layout(ep=2, etp=2)
    dims2 = make_dims(cfg2, rank, world)
    model2 = build(cfg2, dims2, init)
    opt2 = make_optimizer(model2)
    train_steps(model2, dims2, data, steps=1, opt=opt2)
    save_training_state(layout_ckpt, model2, opt2, {"step": 1}, cfg2.to_yaml())
    return {"step": extra["step"], "loss": res["losses"][0], "state": state if rank == 0 else None}


def test_checkpoints_load_under_another_layout(tmp_path):
    data = make_data()
    cfg = tiny_config()
    torch.manual_seed(0)
    ref = MoETransformer(copy.deepcopy(cfg), None)
    init = full_state(ref)
    opt = make_optimizer(ref)
    train_steps(ref, None, data, steps=1, opt=opt)
    single_ckpt, layout_ckpt = tmp_path / "single", tmp_path / "layout"
    save_training_state(single_ckpt, ref, opt, {"step": 1}, cfg.to_yaml())
    ref2 = train_steps(ref, None, data, steps=1, opt=opt, first=1)
    ref_state = {k: v.detach().clone() for k, v in ref.named_parameters()}

    results = run_local(_ranks, 4, init, data, str(single_ckpt), str(layout_ckpt))
    assert all(r["step"] == 1 for r in results)
    for r in results:
        assert abs(r["loss"] - ref2["losses"][0]) <= 1e-5 * abs(ref2["losses"][0])
    for name, t in ref_state.items():
        assert _close(results[0]["state"][name], t), f"tp2 x ep2 resumed: {name}"

    # The ep2 x etp2 checkpoint, resumed by one process.
    torch.manual_seed(7)
    model = MoETransformer(copy.deepcopy(cfg), None)
    opt = make_optimizer(model)
    assert load_training_state(layout_ckpt, model, opt)["step"] == 1
    res = train_steps(model, None, data, steps=1, opt=opt, first=1)
    assert abs(res["losses"][0] - ref2["losses"][0]) <= 1e-5 * abs(ref2["losses"][0])
    for name, p in model.named_parameters():
        assert _close(p.detach(), ref_state[name]), f"ep2 x etp2 saved: {name}"


def _tp_save(rank: int, world: int, variants: dict, init: dict, data, ckpt: str) -> dict:
    """Under tp2 (sequence parallel), take step 1 of each variant from the initial weights and save; returns the
    full weights that were saved."""
    saved = {}
    for name, make in variants.items():
        cfg = make()
        cfg.parallel.tp = 2
        dims = make_dims(cfg, rank, world)
        model = build(cfg, dims, init[name])
        opt = make_optimizer(model)
        train_steps(model, dims, data, steps=1, opt=opt)
        save_training_state(f"{ckpt}-{name}", model, opt, {"step": 1}, cfg.to_yaml())
        saved[name] = global_state_dict(model, dims)
    return saved


def test_tp2_checkpoint_of_mla_and_deltanet_resumes_in_one_process(tmp_path, monkeypatch):
    """MLA + MTP (column/row-parallel heads, tp_partial latents) and gated DeltaNet (sharded A_log/dt_bias,
    replicated conv) saved under tp2 load in one process as the very weights tp2 held, and the next step gives
    the one-process run's loss (and, for MLA, weights; the tiny DeltaNet model's Adam steps amplify rounding to
    about that tolerance, see attn_variants.py)."""
    monkeypatch.setattr(MoETransformer, "forward", with_indexer_in_aux(MoETransformer.forward))  # forked workers too
    data = make_data()
    variants = {"mla": mla_config, "deltanet": deltanet_config}
    inits, refs = {}, {}
    for name, make in variants.items():
        ref = MoETransformer(make(), None)
        inits[name] = full_state(ref)
        opt = make_optimizer(ref)
        train_steps(ref, None, data, steps=1, opt=opt)
        refs[name] = (train_steps(ref, None, data, steps=1, opt=opt, first=1), dict(ref.named_parameters()))
    ckpt = str(tmp_path / "tp2")
    saved = run_local(_tp_save, 2, variants, inits, data, ckpt)[0]
    for name, make in variants.items():
        model = MoETransformer(make(), None)
        opt = make_optimizer(model)
        assert load_training_state(f"{ckpt}-{name}", model, opt)["step"] == 1
        for pname, p in model.named_parameters():
            assert torch.equal(p.detach(), saved[name][pname]), f"{name} tp2 saved: {pname}"
        res = train_steps(model, None, data, steps=1, opt=opt, first=1)
        want, ref_params = refs[name]
        assert abs(res["losses"][0] - want["losses"][0]) <= 1e-5 * abs(want["losses"][0]), name
        if name == "mla":
            for pname, p in model.named_parameters():
                assert _close(p.detach(), ref_params[pname].detach()), f"{name} resumed: {pname}"
