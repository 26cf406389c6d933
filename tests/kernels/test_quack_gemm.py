"""QuACK's grouped GEMMs as the expert FFN's backend (moecore/kernels/quack_gemm.py).

On any machine: the tile rule against the tiles measured fastest, the plan's choice of backend, and that a "quack"
GEMM falls back to torch's where QuACK's kernels cannot run. On a Hopper GPU with the `quack` extra installed
(marked gpu): each GEMM kind, with experts that have no rows, against a float64 loop over the experts, and the
expert FFN's output and gradients through QuACK's GEMMs against the reference.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config, ConfigError, MoEConfig
from moecore.kernels import quack_gemm
from moecore.kernels.grouped_ffn import GemmPlan, _GroupedFFN, default_plan, expert_ffn, expert_ffn_reference
from moecore.kernels.quack_gemm import TILES, grouped_mm, grouped_wgrad, tile_for
from moecore.moe.chunked import chunked_experts
from moecore.moe.minimal import minimal_experts
from tests.kernels.conftest import expert_ffn_inputs, rel_err, routed_inputs

# GPU ms of QuACK's tiles (128x256, 128x192, 128x128) per GEMM kind, one H100, 2026-12-06 (benchmarks/
# grouped_gemm_tiles.py --quack; docs/benchmarks.md, "QuACK's grouped GEMMs"), at (rows per expert, hidden, ffn)
KIND_ORDER = ("fwd13", "fwd2", "dgrad2", "dgrad13", "wgrad2", "wgrad13")
MEASURED_MS = {
    "deepseek_v3": ((256, 7168, 2048), [
        (7.670, 8.614, 14.380), (4.226, 4.002, 3.945), (3.793, 4.267, 7.311),
        (7.832, 9.887, 14.212), (4.020, 3.656, 4.098), (8.358, 7.098, 7.880)]),
    "qwen3_next": ((320, 2048, 512), [
        (1.496, 1.680, 1.587), (0.863, 0.859, 0.757), (0.801, 1.540, 0.978),
        (1.547, 1.555, 1.308), (0.787, 1.285, 0.839), (1.335, 1.266, 1.283)]),
    "qwen3_30b_a3b": ((1024, 2048, 768), [
        (1.252, 1.218, 1.609), (0.728, 0.650, 0.692), (0.657, 0.632, 0.776),
        (1.282, 1.244, 1.472), (0.631, 0.578, 0.682), (1.187, 1.121, 1.387)]),
    "mixtral_8x7b": ((4096, 4096, 14336), [
        (11.710, 11.543, 13.302), (5.495, 7.089, 8.219), (5.478, 5.551, 7.007),
        (11.569, 17.478, 21.908), (5.264, 5.328, 8.006), (11.169, 13.249, 13.423)]),
    "qwen3_235b_a22b": ((1024, 4096, 1536), [
        (5.282, 5.232, 6.961), (2.459, 2.458, 2.696), (2.506, 2.504, 3.455),
        (5.319, 7.832, 7.056), (2.405, 2.247, 2.671), (4.642, 4.604, 5.646)]),
    "kimi_k2": ((170, 7168, 2048), [
        (9.363, 9.871, 18.110), (4.674, 4.847, 5.557), (4.423, 5.404, 8.814), (9.041, 9.864, 16.865)]),
}  # fmt: skip


def _out_width(kind: str, hidden: int, ffn: int) -> int:
    return {"fwd13": 2 * ffn, "fwd2": hidden, "dgrad2": ffn, "dgrad13": hidden, "wgrad2": ffn, "wgrad13": hidden}[kind]


@pytest.mark.parametrize("shape", list(MEASURED_MS))
def test_tile_rule_is_within_5_percent_of_the_fastest_measured_tile(shape):
    (rows, hidden, ffn), per_kind = MEASURED_MS[shape]
    for kind, times in zip(KIND_ORDER, per_kind):
        ms = dict(zip(TILES, times))
        pick = tile_for(kind, rows, _out_width(kind, hidden, ffn))
        assert ms[pick] <= 1.05 * min(times), (shape, kind, pick, ms)


def test_tile_rule_rejects_unknown_kind_and_every_tile_is_a_config():
    with pytest.raises(ValueError, match="fwd3"):
        tile_for("fwd3", 256, 1024)
    for tm, tn, pingpong, cm, cn in TILES.values():
        assert tm % 64 == 0 and tn % 64 == 0 and isinstance(pingpong, bool) and cm * cn == 2


def test_default_plan_takes_quack_where_it_runs(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(quack_gemm, "quack_available", lambda device: True)
    for E, rows, H, F in ((256, 65536, 7168, 2048), (512, 163840, 2048, 512), (128, 131072, 2048, 768)):
        assert default_plan(E, rows, H, F, cuda) == GemmPlan.uniform("quack")
        assert default_plan(E, rows, H, F, cuda, "torch") != GemmPlan.uniform("quack")
    # few large experts keep the cuBLAS loops
    assert default_plan(8, 32768, 4096, 14336, cuda) == GemmPlan("loop", "loop", "loop", "grouped", "loop", "loop")
    assert default_plan(256, 65536, 7168, 2048, torch.device("cpu")) == GemmPlan()
    with pytest.raises(ValueError, match="backend"):
        default_plan(256, 65536, 7168, 2048, cuda, "cutlass")
    monkeypatch.setattr(quack_gemm, "quack_available", lambda device: False)
    assert default_plan(256, 65536, 7168, 2048, cuda) == default_plan(256, 65536, 7168, 2048, cuda, "torch")


def test_choice_is_the_fastest_candidate_once_per_shape(monkeypatch):
    timed = []
    ms = {"128x256": 3.0, "128x192": 2.0, "128x128": 4.0, "torch": 2.5}

    def fake_time(fn, reps=3):
        cand = fn()
        timed.append(cand)
        if cand == "128x128":
            raise RuntimeError("does not compile")
        return ms[cand]

    monkeypatch.setattr(quack_gemm, "_time_ms", fake_time)
    monkeypatch.setattr(quack_gemm, "_CHOICES", {})
    assert quack_gemm.choose(("k", 1), "128x256", lambda c: c) == "128x192"
    assert timed == list(quack_gemm.CANDIDATES)
    assert quack_gemm.choose(("k", 1), "128x256", lambda c: c) == "128x192"  # memorised: nothing timed again
    assert len(timed) == len(quack_gemm.CANDIDATES)
    ms["torch"] = 1.0
    assert quack_gemm.choose(("k", 2), "128x256", lambda c: c) == "torch"  # torch's GEMM where it is faster
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert quack_gemm.choose(("k", 3), "128x128", lambda c: c) == "128x128"  # under capture: the rule's guess


def test_run_summary_names_the_expert_gemms(monkeypatch):
    from moecore.train.summary import kernels_line

    cfg = Config()
    cfg.moe.num_experts = 8
    cuda = torch.device("cuda")
    assert kernels_line(cfg, torch.device("cpu")) is None
    monkeypatch.setattr(quack_gemm, "quack_available", lambda device: True)
    assert "QuACK" in kernels_line(cfg, cuda) and "epilogue" not in kernels_line(cfg, cuda)
    cfg.moe.swiglu_epilogue = True
    assert "moe.swiglu_epilogue" in kernels_line(cfg, cuda)
    cfg.moe.gemm_backend = "torch"
    assert "moe.gemm_backend=torch" in kernels_line(cfg, cuda)
    cfg.moe.gemm_backend = "auto"
    monkeypatch.setattr(quack_gemm, "quack_available", lambda device: False)
    assert "QuACK not installed" in kernels_line(cfg, cuda)
    # DeepSeek-V4's clipped and gpt-oss's biased, clamped experts take the same fused expert FFN
    cfg.model.activation = "swiglu_clipped"
    assert kernels_line(cfg, cuda).endswith("(QuACK not installed, or not a Hopper GPU)")
    cfg.model.activation, cfg.model.expert_linear_bias = "swiglu_clamped", True
    assert kernels_line(cfg, cuda).endswith("(QuACK not installed, or not a Hopper GPU)")


def test_gemm_backend_is_validated():
    MoEConfig(num_experts=4, gemm_backend="torch").validate()
    with pytest.raises(ConfigError, match="moe.gemm_backend"):
        MoEConfig(num_experts=4, gemm_backend="cutlass").validate()


def test_quack_plan_falls_back_to_torch_where_quack_cannot_run():
    # CPU fp32 tensors: every "quack" GEMM runs as torch's grouped GEMM, with the reference's values
    E, H, Fd, counts = 4, 16, 8, [5, 0, 7, 4]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, "cpu", torch.float32, seed=3)
    assert not quack_gemm.quack_runs(x, w13)
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3]).backward(dy)
    ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    _GroupedFFN.apply(ts[0], ts[1], ts[2], c, ts[3], GemmPlan.uniform("quack"), "torch").backward(dy)
    for a, b in zip(ts, ref):
        assert rel_err(a.grad, b.grad) < 1e-5


@pytest.fixture
def stand_in_quack(monkeypatch) -> list:
    """QuACK's launch replaced by torch's grouped GEMM on CPU, with QuACK's operand conventions (B [E, K, N], A
    m-major for weight gradients, A_idx gathering A's rows or columns); its tiles "time" faster than torch's kernel,
    so the path under test runs. Returns the launches as (tile, gathered) pairs."""
    launched = []

    def stand_in(A, B, out, tile, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None):
        launched.append((tile, A_idx is not None))
        if cu_seqlens_m is not None:
            return out.copy_(torch._grouped_mm(A if A_idx is None else A[A_idx.long()], B, offs=cu_seqlens_m[1:]))
        A = A if A_idx is None else A.t()[A_idx.long()].t()  # columns gathered, m-major as QuACK takes A
        return out.copy_(torch._grouped_mm(A, B, offs=cu_seqlens_k[1:]))

    def stand_in_time(fn, reps=3):
        n = len(launched)
        fn()
        return 1.0 if len(launched) > n else 2.0

    monkeypatch.setattr(quack_gemm, "quack_runs", lambda *t: True)
    monkeypatch.setattr(quack_gemm, "launch", stand_in)
    monkeypatch.setattr(quack_gemm, "_time_ms", stand_in_time)
    monkeypatch.setattr(quack_gemm, "_CHOICES", {})
    monkeypatch.setattr(quack_gemm, "CHOICE_TIMES", {})
    return launched


def test_quack_path_through_the_expert_ffn_with_a_stand_in_kernel(stand_in_quack):
    """The backend's Python path on CPU (choosing by timing, the memo, `out=` slices, experts without rows) with
    QuACK's launch replaced by torch's grouped GEMM: the expert FFN's values and gradients equal the reference's."""
    launched = stand_in_quack
    E, H, Fd, counts = 4, 16, 8, [5, 0, 7, 4]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, "cpu", torch.float32, seed=5)
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3]).backward(dy)
    for _ in range(2):  # the second pass takes the memorised choices
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
        _GroupedFFN.apply(ts[0], ts[1], ts[2], c, ts[3], GemmPlan.uniform("quack"), "torch").backward(dy)
        for a, b in zip(ts, ref):
            assert rel_err(a.grad, b.grad) < 1e-5
    assert len(quack_gemm._CHOICES) == 6 and set(quack_gemm._CHOICES.values()) == {next(iter(TILES))}
    assert not any(gathered for _, gathered in launched)
    n = len(launched)
    # a weight gradient written into a slice of a larger tensor, and no rows at all
    bounds = torch.tensor([0, 5, 5, 12, 16], dtype=torch.int32)
    big = torch.full((E + 2, 2 * Fd, H), float("nan"))
    h = torch.randn(16, 2 * Fd)
    quack_gemm.grouped_wgrad(h, x, bounds, "wgrad13", out=big[1 : E + 1])
    assert len(launched) == n + 1  # the memorised tile wrote into the slice
    assert torch.allclose(big[1 : E + 1], torch._grouped_mm(h.t(), x, offs=bounds[1:]))
    assert torch.isnan(big[0]).all() and torch.isnan(big[E + 1]).all()
    empty = quack_gemm.grouped_wgrad(h[:0], x[:0], torch.zeros(E + 1, dtype=torch.int32), "wgrad13")
    assert empty.shape == (E, 2 * Fd, H) and torch.count_nonzero(empty) == 0
    assert quack_gemm.grouped_mm(x[:0], w13, torch.zeros(E + 1, dtype=torch.int32), True, "fwd13").shape == (0, 2 * Fd)


def test_minimal_experts_gather_rows_in_quack_loads_with_a_stand_in_kernel(stand_in_quack):
    """moe.activation_memory=minimal with QuACK's GEMMs: FC1, both FC2 GEMMs of the backward and dW13 (computed
    transposed, into a transposed view) take gathered rows; values and gradients equal the path without QuACK."""
    x, w13, w2, idx, w, dout = routed_inputs(9, 16, 4, 2, 8, "cpu", torch.float32, seed=2)
    results = []
    for plan in (GemmPlan(), GemmPlan.uniform("quack")):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        out, _ = minimal_experts(ts[0], idx, ts[3], ts[1], ts[2], plan=plan)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in ts])
    # (kind, layout) -> choice; timing "copy" chose the GEMMs without rows as well
    choices = {(key[0], key[-1]): tile for key, tile in quack_gemm._CHOICES.items()}
    gathered = {kl: tile for kl, tile in choices.items() if "rows" in kl[1]}
    assert sorted(gathered) == [("dgrad2", "rows"), ("fwd13", "rows"), ("wgrad13", "rowst"), ("wgrad2", "rows")]
    assert set(gathered.values()) <= set(TILES)  # the gathering tiles ran: as "fast" as the copy, and timed first
    assert ("wgrad13", "t") in choices and choices[("fwd2", "")] in TILES
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_load_spread_is_the_busiest_expert_over_the_mean_as_a_power_of_two():
    assert quack_gemm.spread_of(320, 163840, 512) == 1  # random routing at Qwen3-Next's shape: ~1.0-1.2x the mean
    assert quack_gemm.spread_of(640, 163840, 512) == 2  # 2x
    assert quack_gemm.spread_of(15520, 163840, 512) == 6  # the skewed bench's busiest expert: 48.5x
    assert quack_gemm.spread_of(0, 0, 8) == 1
    tracker = quack_gemm.LoadSpread()
    assert tracker.value == 1
    assert tracker.observe(torch.tensor([40, 1, 1, 1, 0, 1, 0, 4]), 48) == 3  # 6.7x; on the CPU read at once
    assert tracker.observe(torch.tensor([], dtype=torch.int64), 0) == 3  # no experts: the last value stays
    import copy

    assert copy.deepcopy(tracker).value == 1  # a copied layer starts afresh


def test_skewed_loads_time_the_dynamically_scheduled_tiles_too(monkeypatch):
    dyn = tuple(t + quack_gemm.DYNAMIC for t in quack_gemm.DYNAMIC_TILES)
    assert quack_gemm._candidates(spread=quack_gemm.SKEWED - 1) == quack_gemm.CANDIDATES
    assert quack_gemm._candidates(spread=quack_gemm.SKEWED) == (*quack_gemm.CANDIDATES, *dyn)
    assert not set(dyn) & set(quack_gemm._candidates(gathered=True, spread=6))  # QuACK gathers only statically
    assert set(dyn) < set(quack_gemm._candidates(into_out=True, spread=6))
    # into a given gradient tensor torch's kernel would need a whole second gradient: not timed there
    assert "torch" not in quack_gemm._candidates(into_out=True) and "torch" in quack_gemm._candidates()
    # "<tile>+dyn" is the tile's config with the dynamic scheduler (QuACK's GemmConfig stood in for)
    import sys
    import types

    fake = types.ModuleType("quack.gemm_config")
    fake.GemmConfig = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "quack.gemm_config", fake)
    for tile in quack_gemm.DYNAMIC_TILES:
        static = quack_gemm.tile_config(tile)
        assert not static["is_dynamic_persistent"]
        assert quack_gemm.tile_config(tile + quack_gemm.DYNAMIC) == {**static, "is_dynamic_persistent": True}


def test_minimal_experts_key_their_choices_by_the_observed_load_spread(stand_in_quack):
    """A skewed routing seen by the layer's tracker gives its GEMMs choices of their own (keyed by the spread),
    timed among the dynamically scheduled tiles too where the rows are not gathered; the values are unchanged."""
    launched = stand_in_quack
    x, w13, w2, idx, w, dout = routed_inputs(24, 16, 8, 2, 8, "cpu", torch.float32, seed=4)
    idx[:, 0] = 0  # every token's first choice is expert 0: 24 of 48 rows, 4x the mean
    idx[:, 1] = torch.arange(24) % 7 + 1
    tracker = quack_gemm.LoadSpread()
    results = []
    for plan, spread in ((GemmPlan(), None), (GemmPlan.uniform("quack"), tracker)):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        out, _ = minimal_experts(ts[0], idx, ts[3], ts[1], ts[2], plan=plan, load_spread=spread)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in ts])
    assert tracker.value == quack_gemm.SKEWED
    assert {key[-2] for key in quack_gemm._CHOICES} == {quack_gemm.SKEWED}
    timed = {c for times in quack_gemm.CHOICE_TIMES.values() for c in times}
    assert "128x256+dyn" in timed and launched
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_experts_key_each_chunks_choices_by_its_spread(stand_in_quack):
    """moe.activation_memory=chunked reads the bounds on the host anyway: each chunk's choices are keyed by that
    chunk's own spread (one chunk: the layer's, 4x; in chunks of 24 rows: expert 0 alone, then 7 even ones: 1)."""
    x, w13, w2, idx, w, dout = routed_inputs(24, 16, 8, 2, 8, "cpu", torch.float32, seed=4)
    idx[:, 0], idx[:, 1] = 0, torch.arange(24) % 7 + 1  # expert 0: 24 of 48 rows
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    minimal_experts(ref[0], idx, ref[3], ref[1], ref[2])[0].backward(dout)
    for chunk_rows, spreads in ((48, {quack_gemm.SKEWED}), (24, {1})):
        quack_gemm._CHOICES.clear()
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        plan = GemmPlan.uniform("quack")
        chunked_experts(ts[0], idx, ts[3], ts[1], ts[2], chunk_rows, plan=plan)[0].backward(dout)
        assert {key[-2] for key in quack_gemm._CHOICES} == spreads
        for got, want in zip(ts, ref):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- on a Hopper GPU with QuACK installed


def _skip_unless_quack() -> torch.device:
    dev = torch.device("cuda")
    if not torch.cuda.is_available() or not quack_gemm.quack_available(dev):
        pytest.skip("needs a Hopper GPU and the quack extra")
    return dev


COUNTS = [0, 300, 0, 17, 1024, 129, 0]  # ragged, with experts of no rows first, inside and last


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(TILES))
def test_quack_gemms_match_float64_per_expert(tile, monkeypatch):
    dev = _skip_unless_quack()
    monkeypatch.setattr(quack_gemm, "CANDIDATES", (tile,))  # the tile under test is the only choice
    monkeypatch.setattr(quack_gemm, "_CHOICES", {})
    g = torch.Generator().manual_seed(7)
    E, K, N, M = len(COUNTS), 256, 192, sum(COUNTS)
    a = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
    b_nk = torch.randn(E, N, K, generator=g).to(dev, torch.bfloat16)
    b_kn = torch.randn(E, K, N, generator=g).to(dev, torch.bfloat16)
    c = torch.randn(M, N, generator=g).to(dev, torch.bfloat16)
    bounds = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    bounds[1:] = torch.cumsum(torch.tensor(COUNTS, device=dev), 0)
    y_nt = grouped_mm(a, b_nk, bounds, True, "fwd13")
    y_nn = grouped_mm(a, b_kn, bounds, False, "dgrad13")
    dw = grouped_wgrad(a, c, bounds, "wgrad13", out=torch.full((E, K, N), float("nan"), device=dev).bfloat16())
    # the same values as torch's grouped GEMM, bit for bit (the choice between them changes only the speed)
    offs = bounds[1:]
    assert torch.equal(y_nt, torch._grouped_mm(a, b_nk.transpose(1, 2), offs=offs))
    assert torch.equal(y_nn, torch._grouped_mm(a, b_kn, offs=offs))
    assert torch.equal(dw, torch._grouped_mm(a.t(), c, offs=offs))
    # rows gathered in the loads (x[token of row]: every token read by several rows), and a weight gradient stored
    # through a transposed view, against torch's GEMMs on a gathered copy
    x = torch.randn(M // 3 + 1, K, generator=g).to(dev, torch.bfloat16)
    rows = torch.randint(0, x.shape[0], (M,), generator=g).to(dev, torch.int32)
    xg = x.index_select(0, rows)
    want_nt, want_w = torch._grouped_mm(xg, b_nk.mT, offs=offs), torch._grouped_mm(xg.t(), c, offs=offs)
    assert torch.equal(grouped_mm(x, b_nk, bounds, True, "fwd13", rows=rows), want_nt)  # the chosen way
    assert torch.equal(
        quack_gemm.launch(x, b_nk.mT, torch.empty_like(want_nt), tile, cu_seqlens_m=bounds, A_idx=rows), want_nt
    )
    for gather in (rows, None):  # the tile gathering in its loads, and the choice; a transposed output
        dwt = torch.full((E, N, K), float("nan"), device=dev).bfloat16()
        if gather is None:
            grouped_wgrad(x, c, bounds, "wgrad13", out=dwt.transpose(1, 2), rows=rows)
        else:
            quack_gemm.launch(x.t(), c, dwt.transpose(1, 2), tile, cu_seqlens_k=bounds, A_idx=rows)
        assert torch.equal(dwt.transpose(1, 2), want_w)
    s = 0
    for e, n in enumerate(COUNTS):
        rows, other = a[s : s + n].double(), c[s : s + n].double()
        if n:
            assert rel_err(y_nt[s : s + n], rows @ b_nk[e].double().t()) < 1e-2
            assert rel_err(y_nn[s : s + n], rows @ b_kn[e].double()) < 1e-2
            assert rel_err(dw[e], rows.t() @ other) < 1e-2
        else:
            assert torch.count_nonzero(dw[e]) == 0  # written, not left as NaN
        s += n


@pytest.mark.gpu
def test_minimal_experts_through_quack_match_the_torch_plan():
    """The minimal layer's Function with QuACK gathering rows in its loads against the same Function on torch's
    GEMMs (which gather copies first)."""
    dev = _skip_unless_quack()
    x, w13, w2, idx, w, dout = routed_inputs(1000, 256, 8, 3, 128, dev, torch.bfloat16, seed=6, scale=0.05)
    results = []
    for plan in (GemmPlan.uniform("grouped"), GemmPlan.uniform("quack")):
        ts = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        out, _ = minimal_experts(ts[0], idx, ts[3], ts[1], ts[2], plan=plan)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in ts])
    for got, want in zip(results[1], results[0]):
        assert rel_err(got.float(), want.float()) < 1e-2


@pytest.mark.gpu
def test_expert_ffn_through_quack_matches_reference():
    dev = _skip_unless_quack()
    E, H, Fd, counts = 6, 256, 128, [700, 0, 1900, 10, 1300, 0]
    x, w13, w2, c, p, dy = expert_ffn_inputs(E, H, Fd, counts, dev, torch.bfloat16, seed=4)
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    expert_ffn_reference(ref[0], ref[1], ref[2], c, ref[3]).backward(dy)
    ts = [t.clone().requires_grad_() for t in (x, w13, w2, p)]
    out = expert_ffn(ts[0], ts[1], ts[2], c, ts[3], plan=GemmPlan.uniform("quack"))
    out.backward(dy)
    assert rel_err(out.detach(), expert_ffn_reference(x, w13, w2, c, p)) < 2e-2
    for a, b in zip(ts, ref):
        assert rel_err(a.grad, b.grad) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [t + quack_gemm.DYNAMIC for t in quack_gemm.DYNAMIC_TILES])
def test_dynamically_scheduled_tiles_equal_torch_bit_for_bit(tile, monkeypatch):
    dev = _skip_unless_quack()
    monkeypatch.setattr(quack_gemm, "CANDIDATES", (tile,))
    monkeypatch.setattr(quack_gemm, "_CHOICES", {})
    g = torch.Generator().manual_seed(8)
    counts = [2000, 3, 0, 17, 1, 129, 0, 5]  # skewed: one expert holds most rows
    E, K, N, M = len(counts), 256, 384, sum(counts)
    a = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
    b_nk = torch.randn(E, N, K, generator=g).to(dev, torch.bfloat16)
    c = torch.randn(M, N, generator=g).to(dev, torch.bfloat16)
    bounds = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    bounds[1:] = torch.cumsum(torch.tensor(counts, device=dev), 0)
    offs = bounds[1:]
    for _ in range(2):  # twice: the scheduler's tile counter starts from zero on every call
        assert torch.equal(grouped_mm(a, b_nk, bounds, True, "fwd13"), torch._grouped_mm(a, b_nk.mT, offs=offs))
        dwt = torch.full((E, N, K), float("nan"), device=dev).bfloat16()
        grouped_wgrad(a, c, bounds, "wgrad13", out=dwt.transpose(1, 2))
        assert torch.equal(dwt.transpose(1, 2), torch._grouped_mm(a.t(), c, offs=offs))
    assert set(quack_gemm._CHOICES.values()) == {tile}


@pytest.mark.gpu
def test_load_spread_reads_cuda_counts_without_waiting():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tracker = quack_gemm.LoadSpread()
    counts = torch.tensor([40, 1, 1, 1, 0, 1, 0, 4], device="cuda", dtype=torch.int32)
    # The first queue allocates the pinned host buffer, which can wait for the GPU (measured on an H100: it did, and
    # the copy behind the sleep below had landed by the next call); land one copy of even counts first.
    tracker.queue(counts * 0 + 6, 48)
    torch.cuda.synchronize()
    assert tracker.current(counts, 48) == 1  # even counts: 1x the mean
    torch.cuda._sleep(10**9)  # ~0.5 s of GPU work queued ahead of the copy the next call queues
    assert tracker.observe(counts, 48) == 1  # nothing new landed yet: the last value
    assert tracker.observe(counts, 48) == 1  # the copy waits behind the sleep: not landed, and not waited for
    torch.cuda.synchronize()
    assert tracker.observe(counts * 0 + 6, 48) == 3  # the first call's counts (6.7x the mean)
    torch.cuda.synchronize()
    assert tracker.observe(counts, 48) == 1  # the second call's: 6 rows each, 1x the mean
    # `current` alone queues nothing (the layer queues after its GEMMs' launches): the value stays the last landed
    even = counts * 0 + 6
    torch.cuda.synchronize()
    assert tracker.current(even, 48) == 3  # the fourth call's queued counts (6.7x the mean)
    torch.cuda.synchronize()
    assert tracker.current(even, 48) == 3  # `current` queued nothing
    tracker.queue(even, 48)
    torch.cuda.synchronize()
    assert tracker.current(counts, 48) == 1  # the queued counts: 1x the mean
