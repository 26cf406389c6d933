"""RunLogger (metrics.jsonl, TensorBoard), FLOPs per token against torch's FLOP counter, plots, profiling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from moecore.config import Config, LogConfig
from moecore.train.logger import RunLogger, flops_per_token, gpu_memory_stats, mfu, peak_tflops
from moecore.train.plot import main as plot_main
from moecore.train.profiling import Profiler, enable_oom_snapshot, nvtx_range


def _tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_run_logger_jsonl_and_tensorboard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunLogger(run, LogConfig(), True, {"train": {"steps": 3}}) as log:
        for step in (1, 2, 3):
            log.log(
                step,
                {
                    "loss": torch.tensor(5.0 - step),
                    "lr": 1e-3,
                    "grad_norm": float("nan") if step == 2 else 1.0,
                    "moe/layer_0/tokens_per_expert": torch.tensor([3, 1, 0, 4]),
                },
            )
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["loss"] == 4.0 and recs[1]["grad_norm"] is None
    assert recs[2]["moe/layer_0/tokens_per_expert"] == [3, 1, 0, 4]
    tb = _tb_scalars(run)
    assert [v for _, v in tb["loss"]] == [4.0, 3.0, 2.0] and "moe/layer_0/tokens_per_expert" not in tb
    # Resume from step 2: later records are dropped, then the run continues.
    with RunLogger(run, LogConfig(), True, {}, resume_step=2) as log:
        log.log(3, {"loss": 1.5})
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 4.0), (2, 3.0), (3, 1.5)]
    # Non-main ranks write nothing.
    other = tmp_path / "other"
    with RunLogger(other, LogConfig(), False, {}) as log:
        log.log(1, {"loss": 1.0})
    assert not other.exists()


def test_wandb_missing_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with RunLogger(tmp_path, LogConfig(wandb_project="proj", tensorboard=False), True, {}) as log:
        log.log(1, {"loss": 2.0})
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "wandb is not installed" in err and "proj" in err
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.0


def _swiglu(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w[prefix + "g"])) * F.linear(x, w[prefix + "u"]), w[prefix + "d"])


def _reference_forward(cfg: Config, ids: torch.Tensor, w: dict) -> torch.Tensor:
    """A plain-torch MoE transformer sized from cfg (GQA + top-k MoE with a gated shared expert)."""
    m, e = cfg.model, cfg.moe
    b, s = ids.shape
    nh, nkv, hd = m.num_attention_heads, m.num_kv_heads, m.resolved_head_dim
    x = F.embedding(ids, w["embed"])
    for i in range(m.num_layers):
        q = F.linear(x, w[f"{i}q"]).view(b, s, nh, hd).transpose(1, 2)
        k = F.linear(x, w[f"{i}k"]).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        v = F.linear(x, w[f"{i}v"]).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)  # explicit products: the counter sees every bmm
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        a = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, nh * hd)
        x = x + F.linear(a, w[f"{i}o"])
        h = x.reshape(b * s, -1)
        if e.is_moe_layer(i, m.num_layers):
            probs = F.linear(h, w[f"{i}router"]).softmax(-1)
            top_p, top_i = probs.topk(e.router_topk, dim=-1)
            out = torch.zeros_like(h)
            for ex in range(e.num_experts):
                tok, slot = (top_i == ex).nonzero(as_tuple=True)
                out = out.index_add(0, tok, _swiglu(h[tok], w, f"{i}e{ex}") * top_p[tok, slot, None])
            out = out + torch.sigmoid(F.linear(h, w[f"{i}shared_gate"])) * _swiglu(h, w, f"{i}s")
        else:
            out = _swiglu(h, w, f"{i}m")
        x = x + out.view(b, s, -1)
    return F.linear(x, w["head"])


def _weights(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    h, hd, v = m.hidden_size, m.resolved_head_dim, m.vocab_size
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": (v, h), "head": (v, h)}
    for i in range(m.num_layers):
        shapes.update({f"{i}q": (m.num_attention_heads * hd, h), f"{i}o": (h, m.num_attention_heads * hd)})
        shapes.update({f"{i}k": (m.num_kv_heads * hd, h), f"{i}v": (m.num_kv_heads * hd, h)})
        ffns = {f"{i}m": m.ffn_hidden_size}
        if e.is_moe_layer(i, m.num_layers):
            ffns = {f"{i}e{ex}": e.ffn_hidden_size for ex in range(e.num_experts)}
            ffns[f"{i}s"] = e.shared_expert_intermediate_size
            shapes.update({f"{i}router": (e.num_experts, h), f"{i}shared_gate": (1, h)})
        for p, f in ffns.items():
            shapes.update({p + "g": (f, h), p + "u": (f, h), p + "d": (h, f)})
    return {k: (torch.randn(*sh, generator=g) * 0.1).requires_grad_() for k, sh in shapes.items()}


def test_flops_per_token_matches_torch_flop_counter() -> None:
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.num_kv_heads = 96, 32, 3, 4, 2
    m.ffn_hidden_size = 48
    e.num_experts, e.router_topk, e.ffn_hidden_size = 6, 2, 24
    e.shared_expert_intermediate_size, e.shared_expert_gate, e.layer_freq = 40, True, [0, 1, 1]
    b, s = 2, 10
    w = _weights(cfg)
    ids = torch.randint(0, m.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as fwd:
        logits = _reference_forward(cfg, ids, w)
    assert fwd.get_total_flops() == flops_per_token(cfg, s, training=False, causal=False) * b * s
    with FlopCounterMode(display=False) as train:
        _reference_forward(cfg, ids, w).square().mean().backward()
    assert train.get_total_flops() == flops_per_token(cfg, s, causal=False) * b * s
    assert logits.shape == (b, s, m.vocab_size)
    # Causal counting halves (about) the score products only; activated experts only, not all experts.
    assert flops_per_token(cfg, s) < flops_per_token(cfg, s, causal=False)
    e.router_topk = 3
    assert (
        flops_per_token(cfg, s, training=False, causal=False) - fwd.get_total_flops() / (b * s) == 2 * 2 * 3 * 32 * 24
    )


def test_mfu_and_memory_helpers() -> None:
    assert math.isclose(mfu(1000.0, 6e9, 12.0, num_devices=1), 0.5)
    assert mfu(1000.0, 6e9, None) is None
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("Some CPU") is None
    if not torch.cuda.is_available():
        assert gpu_memory_stats() == {}


def _fake_run(run: Path, steps: int = 30, experts: int = 4) -> None:
    run.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        rec = {"step": step, "loss": 8.0 / step**0.3, "lr": 1e-3}
        for layer in (1, 3):
            load = [10 + step * (ex == 0) for ex in range(experts)]  # expert 0 slowly takes over
            rec[f"moe/layer_{layer}/tokens_per_expert"] = load
            rec[f"moe/layer_{layer}/aux_loss"] = 1.0 + 0.01 * step
            rec[f"moe/layer_{layer}/imbalance"] = max(load) / (sum(load) / experts)
        lines.append(json.dumps(rec))
        if step % 10 == 0:
            lines.append(json.dumps({"step": step, "valid_loss": 7.5 / step**0.3}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n{cut sho")  # a final line cut by a crash


def test_plot_writes_valid_pngs(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    run = tmp_path / "run"
    _fake_run(run)
    assert plot_main([str(run)]) == 0
    for name in ("loss.png", "expert_load.png", "moe_balance.png"):
        path = run / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as im:
            im.verify()  # PIL's own structural check (chunk CRCs)
        with Image.open(path) as im:
            assert im.size[0] > 300 and im.size[1] > 200
    assert "expert_load.png" in capsys.readouterr().out


def test_plot_bad_input(tmp_path: Path, capsys) -> None:
    assert plot_main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert plot_main([str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    assert plot_main([]) == 2


def test_profiler_trace_on_cpu(tmp_path: Path) -> None:
    x = torch.randn(64, 64)
    with Profiler([2, 3], tmp_path / "profile") as prof:
        for step in range(1, 6):
            prof.step_begin(step)
            assert prof.active == (step in (2, 3))
            with nvtx_range(f"moe_step_{step}"):
                x = torch.tanh(x @ x)
            prof.step_end(step)
    trace = json.loads((tmp_path / "profile" / "trace_rank0_steps2-3.json").read_text())
    names = {ev.get("name") for ev in trace["traceEvents"]}
    assert {"moe_step_2", "moe_step_3"} <= names and "moe_step_1" not in names and "moe_step_4" not in names
    assert (tmp_path / "profile" / "summary_rank0.txt").stat().st_size > 0
    with Profiler(None, tmp_path / "none") as prof:
        prof.step_begin(1)
        prof.step_end(1)
    assert not (tmp_path / "none").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_oom_snapshot_on_gpu(tmp_path: Path) -> None:
    import pickle

    assert enable_oom_snapshot(tmp_path, rank=0)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    snap = pickle.loads((tmp_path / "oom_snapshot_rank0.pickle").read_bytes())
    assert "segments" in snap and "device_traces" in snap
    stats = gpu_memory_stats()
    assert set(stats) == {"mem/max_allocated_gb", "mem/max_reserved_gb"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_oom_snapshot_goes_to_the_latest_run_only(tmp_path: Path) -> None:
    """Two runs in one process: an error during the second writes its snapshot alone; after disabling, none."""
    from moecore.train.profiling import disable_oom_snapshot

    first, second = tmp_path / "a", tmp_path / "b"
    assert enable_oom_snapshot(first) and enable_oom_snapshot(second)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert (second / "oom_snapshot_rank0.pickle").exists() and not first.exists()
    (second / "oom_snapshot_rank0.pickle").unlink()
    disable_oom_snapshot()
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert not (second / "oom_snapshot_rank0.pickle").exists()


def test_oom_observer_writes_where_the_latest_run_points_it(tmp_path: Path, monkeypatch) -> None:
    from moecore.train import profiling

    written: list[Path] = []
    monkeypatch.setattr(profiling, "dump_memory_snapshot", lambda path: written.append(path) or True)
    observer = profiling._OomObserver()
    observer(0, 1 << 30, 0, 0)  # no run has pointed it anywhere
    observer.path = tmp_path / "a.pickle"
    observer.path = tmp_path / "b.pickle"
    observer(0, 1 << 30, 0, 0)
    observer.path = None  # disabled
    observer(0, 1 << 30, 0, 0)
    assert written == [tmp_path / "b.pickle"]


def test_oom_snapshot_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert enable_oom_snapshot(tmp_path) is False
