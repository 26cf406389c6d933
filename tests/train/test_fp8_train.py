"""train.precision=fp8 on CPU through the emulated FP8 GEMMs (fp8.emulate=true): which modules turn FP8, the run
against the bf16 run, checkpoints in fp32 that load into any precision, and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from moecore.cli import main
from moecore.config import ConfigError, load_config
from moecore.kernels.fp8_gemm import Fp8Recipe
from moecore.kernels.fp8_quant import quantize_rowwise_reference
from moecore.models.fp8 import Fp8ColumnParallelLinear, Fp8Linear, Fp8RowParallelLinear, apply_fp8
from moecore.models.transformer import MoETransformer
from moecore.train.loop import Trainer, train

TINY = [  # every GEMM dimension a multiple of 16
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_kv_heads=1",
    "model.ffn_hidden_size=64",
    "moe.num_experts=4",
    "moe.ffn_hidden_size=32",
    "moe.shared_expert_intermediate_size=32",
    "moe.shared_expert_gate=true",  # (exportable as Qwen2-MoE)
    "moe.first_k_dense_replace=1",
    "train.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "optim.warmup_steps=1",
    "log.interval=1",
    "log.progress=false",
    "log.tensorboard=false",
    "train.device=cpu",  # the CPU's FP8 paths (emulation, refusals) also where a GPU is visible
]
FP8 = ["train.precision=fp8", "fp8.emulate=true"]


def _run(tmp_path, name: str, *extra: str):
    cfg = load_config("tiny-moe", TINY + [f"train.run_dir={tmp_path / name}", *extra])
    result = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, {r["step"]: r for r in rows}


def test_apply_fp8_swaps_the_chosen_modules_only():
    cfg = load_config("tiny-moe", TINY + ["model.vocab_size=64"])
    model = MoETransformer(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = apply_fp8(model, Fp8Recipe("rowwise", emulate=True), ["experts", "attention"])
    kinds = {type(m) for m in model.modules()}
    assert Fp8ColumnParallelLinear in kinds and Fp8RowParallelLinear in kinds
    assert Fp8Linear not in kinds  # the shared experts' nn.Linear were not asked for
    assert sum(n.endswith("experts") for n in done["fp8"]) == 1  # one MoE layer (the first is dense)
    assert not any(n.startswith("layers.0.mlp") for n in done["fp8"])  # the dense MLP (layer 0) stays bf16
    assert model.state_dict().keys() == before.keys()  # same parameters, same names: checkpoints unchanged
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_fp8_run_tracks_the_bf16_run_and_checkpoints_stay_fp32(tmp_path):
    """Three steps from the same weights: losses within 1% of bf16's (measured: < 0.1%; the FP8 GEMMs' ~4%
    relative error per product barely moves a cross-entropy near ln(vocab)). The checkpoint holds the fp32
    masters, which an fp32 run loads exactly."""
    _, ref = _run(tmp_path, "bf16", "train.steps=3", "train.precision=bf16")
    _, got = _run(tmp_path, "fp8", "train.steps=3", "train.exit_interval=3", *FP8, "fp8.recipe=tensorwise")
    for step in range(1, 4):
        a, b = got[step]["loss"], ref[step]["loss"]
        assert abs(a - b) / b < 1e-2, (step, a, b)
    assert any(got[s]["loss"] != ref[s]["loss"] for s in range(1, 4))  # FP8 did change the arithmetic
    ckpt = tmp_path / "fp8" / "checkpoints" / "step-3"
    from moecore.hf.convert import convert_to_hf
    from moecore.hf.io import SafetensorsReader

    convert_to_hf(ckpt, tmp_path / "hf")  # an FP8 run exports bf16
    with SafetensorsReader(tmp_path / "hf") as reader:
        assert {reader.dtype(n) for n in reader.names()} == {torch.bfloat16}
    fp32 = Trainer(load_config("tiny-moe", TINY + [f"checkpoint.load={ckpt}", f"train.run_dir={tmp_path / 'x'}"]))
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in fp32.model.parameters())  # true fp32 values


def test_fp8_trainer_runs_each_recipe_in_fp8(tmp_path):
    for recipe, fmt, wgrad in (
        ("rowwise", "hybrid", "fp8"),
        ("tensorwise", "e4m3", "fp8"),
        ("rowwise", "e4m3", "bf16"),
        ("rowwise", "e4m3", "auto"),
    ):
        run_dir = tmp_path / f"{recipe}-{fmt}-{wgrad}"
        cfg = load_config(
            "tiny-moe",
            TINY
            + FP8
            + [f"fp8.recipe={recipe}", f"fp8.format={fmt}", f"fp8.wgrad={wgrad}", f"train.run_dir={run_dir}"],
        )
        trainer = Trainer(cfg)
        out = trainer.train_step()
        assert torch.isfinite(torch.tensor(out["loss"]))
        experts = [m for m in trainer.model.modules() if type(m).__name__ == "GroupedExperts"]
        assert experts and all(m.last_path == "fp8" for m in experts)
        assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters() if p.dim() == 2)
        trainer.rt.shutdown()


BAD = [
    (TINY + ["train.precision=fp8"], "fp8"),  # no CUDA here and no emulation
    (TINY + FP8 + ["fp8.recipe=blockwise"], "model.hidden_size"),  # 32 is not a multiple of the 128 block
    (TINY + FP8 + ["fp8.recipe=delayed"], "fp8.recipe"),
    (TINY + FP8 + ["fp8.format=e5m2"], "fp8.format"),
    (TINY + FP8 + ["fp8.wgrad=fp16"], "fp8.wgrad"),
    (TINY + FP8 + ["fp8.grouped_gemm=cutlass"], "fp8.grouped_gemm"),
    (TINY + FP8 + ["fp8.recipe=tensorwise", "fp8.padding=wgrad"], "fp8.padding"),
    (TINY + FP8 + ["fp8.modules=[router]"], "fp8.modules"),
    (TINY + FP8 + ["model.ffn_hidden_size=72"], "model.ffn_hidden_size"),
    (TINY + FP8 + ["fp8.recipe=tensorwise", "fp8.format=hybrid", "moe.sync_free=true"], "moe.sync_free"),
]


@pytest.mark.parametrize("overrides,word", BAD, ids=[o[-1] for o, _ in BAD])
def test_refusals_are_one_line_exit_2(overrides, word, capsys):
    assert main(["train", "tiny-moe", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moecore: error:") and word in err, err


def test_config_names_the_misaligned_field():
    cfg = load_config("tiny-moe", TINY + ["train.precision=fp8", "moe.ffn_hidden_size=40"])
    with pytest.raises(ConfigError, match="moe.ffn_hidden_size=40"):
        cfg.validate()
    cfg = load_config("tiny-moe", TINY + ["train.precision=fp8", "moe.ffn_hidden_size=40", "fp8.modules=[attention]"])
    cfg.validate()  # the experts stay bf16: their width does not matter


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_primary_weights_hold_fp8_and_follow_the_masters(tmp_path, recipe):
    """With fp8.primary_weights the FP8 GEMM weights exist only as FP8 values + scales between steps, quantised
    from the fp32 masters after every update (rowwise: in both GEMM layouts); the run computes exactly what the
    run without them computes (the same quantised weights either way) and the checkpoint holds the fp32 masters."""
    dims = ["model.hidden_size=128", "model.ffn_hidden_size=128", "moe.ffn_hidden_size=128"]
    dims += ["moe.shared_expert_intermediate_size=128", "model.num_attention_heads=2", "model.num_kv_heads=2"]
    dims += (
        ["model.head_dim=64"] if recipe == "tensorwise" else ["model.head_dim=64", "fp8.modules=[experts,dense_mlp]"]
    )
    base = TINY + FP8 + dims + [f"fp8.recipe={recipe}", "train.steps=2"]
    _, ref = _run(tmp_path, "plain", *base)
    cfg = load_config("tiny-moe", base + ["fp8.primary_weights=true", f"train.run_dir={tmp_path / 'primary'}"])
    trainer = Trainer(cfg)
    mixed = trainer.rt.mixed
    assert mixed.recast
    for p in mixed.recast:
        assert p.data.untyped_storage().nbytes() == 2  # the bf16 weight is gone
        assert p.fp8_primary.q.dtype == torch.float8_e4m3fn
    result = trainer.run()
    for step, loss in result.losses:
        assert loss == ref[step]["loss"], step
    for p, rebuild in mixed.recast.items():  # the FP8 copy is the quantised master after the last update
        held = p.fp8_primary.q.clone()
        rebuild(mixed.masters[p])
        assert torch.equal(held.view(torch.uint8), p.fp8_primary.q.view(torch.uint8))
    state = trainer.model.state_dict()  # outside a checkpoint: the values the FP8 weights compute with
    name, p = next((n, p) for n, p in trainer.model.named_parameters() if p in mixed.recast)
    assert state[name].dtype == torch.bfloat16 and state[name].stride() != p.stride()
    assert (state[name].float() - mixed.masters[p]).abs().max() <= mixed.masters[p].abs().max() / 8
    from moecore.train.memory import tensor_bytes

    held = tensor_bytes(trainer.model)["params"]  # the FP8 weights: 1 byte per element and layout (+ scales)
    layouts = 2 if recipe == "rowwise" else 1
    fp8_elems = sum(p.numel() for p in mixed.recast)
    bf16_all = sum(2 * p.numel() for p in trainer.model.parameters())
    fp8_bytes = bf16_all - (2 - layouts) * fp8_elems
    assert fp8_bytes <= held < fp8_bytes + 4 * layouts * fp8_elems // 100
    if recipe == "rowwise":  # the transposed copy is the rowwise quantisation of the transposed weight
        p = next(iter(mixed.recast))
        w = mixed.masters[p].to(p.dtype)
        wt = w.transpose(-2, -1).reshape(-1, w.shape[-2]) if w.dim() == 3 else w.t()
        q, s = quantize_rowwise_reference(wt.contiguous(), torch.float8_e4m3fn)
        assert torch.equal(p.fp8_primary_t.q.reshape(q.shape).view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(p.fp8_primary_t.s.reshape(s.shape), s)


def test_primary_weights_refusals():
    cfg = load_config(
        "tiny-moe",
        TINY
        + ["train.precision=fp8", "fp8.primary_weights=true", "fp8.recipe=tensorwise", "optim.master_weights=bf16"],
    )
    with pytest.raises(ConfigError, match="master_weights"):
        cfg.validate()
    from moecore.train.runtime import check_fp8_runtime

    cfg = load_config("tiny-moe", TINY + FP8 + ["fp8.primary_weights=true", "fp8.recipe=tensorwise"])
    check_fp8_runtime(cfg, torch.device("cpu"), 1)
    check_fp8_runtime(cfg, torch.device("cpu"), 2)  # data / tensor / expert parallel, distributed optimizer
    fsdp = ["fp8.primary_weights=true", "parallel.fsdp=true"]
    for recipe in ("tensorwise", "blockwise"):  # FSDP all-gathers their one FP8 copy
        check_fp8_runtime(load_config("tiny-moe", TINY + FP8 + fsdp + [f"fp8.recipe={recipe}"]), torch.device("cpu"), 2)
    cfg = load_config("tiny-moe", TINY + FP8 + fsdp + ["fp8.recipe=rowwise"])
    with pytest.raises(ConfigError, match="parallel.fsdp=true needs fp8.recipe=blockwise or tensorwise"):
        check_fp8_runtime(cfg, torch.device("cpu"), 2)


def test_gpu_refuses_what_failed_on_the_h200(monkeypatch):
    """On an FP8-capable GPU (stood in for here), the tensorwise recipe is refused in one line, and the hybrid format
    where triton does not import (its e5m2 gradient GEMMs run in moecore's Triton kernels: cuBLAS rejects them);
    rowwise and blockwise pass the same check in both formats."""
    from moecore.kernels import _triton, fp8_gemm
    from moecore.train.runtime import check_fp8_runtime

    monkeypatch.setattr(fp8_gemm, "fp8_unsupported_reason", lambda device, scaling: None)
    real = [o for o in FP8 if o != "fp8.emulate=true"] + ["fp8.emulate=false"]
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match="fp8.recipe='tensorwise'"):
        check_fp8_runtime(load_config("tiny-moe", TINY + real + ["fp8.recipe=tensorwise"]), cuda, 1)
    for recipe in ("rowwise", "blockwise"):
        for fmt in ("e4m3", "hybrid"):
            cfg = load_config("tiny-moe", TINY + real + [f"fp8.recipe={recipe}", f"fp8.format={fmt}"])
            monkeypatch.setattr(_triton, "triton_importable", lambda: True)
            check_fp8_runtime(cfg, cuda, 1)
            monkeypatch.setattr(_triton, "triton_importable", lambda: False)
            if fmt == "hybrid":
                with pytest.raises(ConfigError, match="fp8.format='hybrid' needs the triton package"):
                    check_fp8_runtime(cfg, cuda, 1)
