"""The expert FFN's SwiGLU in the epilogues of QuACK's grouped GEMMs (`moe.swiglu_epilogue`, Hopper, `quack` extra).

Legend: M sorted rows, E experts, H hidden, F expert FFN width; w13 [E, 2F, H] holds gate rows then up rows.

QuACK's gated GEMMs take the SwiGLU in the FC1 GEMM's epilogue and its backward in the epilogue of the GEMM that
makes the activation's gradient, so the two SwiGLU passes over [M, 2F] (forward: read h, write a; backward: read
h and da, write dh and a) are not made. Their epilogues read gate and up from adjacent columns, so h and dh are kept
in the interleaved order

    hi[:, 2j] = gate_j,   hi[:, 2j + 1] = up_j          (`interleave` / `deinterleave`: the reference's order)

and QuACK's `concat_layout` views w13's [gate; up] rows as interleaved inside the kernels that meet it (FC1
forward, the input gradient through w13, dW13's output): the parameter keeps its layout. The gated forward
epilogue takes no per-row probability, so the probabilities are applied at the combine; the backward's epilogue
scales by them (`colvec_scale`) and reduces their gradient (`colvec_reduce`):

    gated_fc1:   hi, s = x w13^T (interleaved), silu(gate) * up
    dgated_fc2:  G = g w2 (g: dOut of each row's token);  dp = sum_f G * s;  dhi = SwiGLU'(hi) (p G);  a_p = p s
    fc1_dgrad:   dx_rows = dhi w13 (w13's rows viewed interleaved)
    fc1_wgrad:   dW13 = dhi^T x (its rows written back in [gate; up] order)

Each GEMM shape is timed once under QuACK's tiles (`quack_gemm.choose`; no torch kernel does these). QuACK's
epilogues compute the activation from the fp32 accumulator, where the unfused path rounds h to bf16 first: the two
agree to bf16 rounding, not bit for bit. Measured on an H100 (docs/benchmarks.md, run CD), the two fused GEMMs cost
more than the SwiGLU passes they save at DeepSeek-V3's shape (+1.23 ms against 0.81) and nearly as much at
Qwen3-Next's (+0.34 against 0.50), so `moe.swiglu_epilogue` is off by default.
"""

from __future__ import annotations

import torch

from moecore.kernels import quack_gemm
from moecore.kernels.quack_gemm import TILES, choose, launch, shape_key, tile_config, tile_for


def interleave(h: torch.Tensor) -> torch.Tensor:
    """[..., 2F] in [gate | up] order -> the interleaved order (gate_j, up_j adjacent). A copy."""
    g, u = h.chunk(2, dim=-1)
    return torch.stack((g, u), dim=-1).flatten(-2)


def deinterleave(hi: torch.Tensor) -> torch.Tensor:
    """The inverse of `interleave`. A copy."""
    return torch.cat((hi[..., 0::2], hi[..., 1::2]), dim=-1)


def _launch_gated(A, B, preact, postact, tile: str, **varlen) -> None:
    """QuACK's gated GEMM (SwiGLU epilogue) with an explicit tile; B [E, K, 2F] with [gate; up] columns."""
    from quack.gemm_interface import gemm_gated_tuned

    run = getattr(gemm_gated_tuned, "fn", gemm_gated_tuned)
    run(A, B, preact, postact, activation="swiglu", config=tile_config(tile), concat_layout=("B",), **varlen)


def _launch_dgated(A, B, preact, dpreact, postact, scale, tile: str, **varlen) -> torch.Tensor:
    """QuACK's GEMM with the SwiGLU backward in its epilogue, scaling by and reducing against `scale` per row."""
    from quack.gemm_interface import gemm_dgated_tuned

    run = getattr(gemm_dgated_tuned, "fn", gemm_dgated_tuned)
    return run(
        A, B, preact, dpreact, postact, colvec_scale=scale, activation="swiglu", colvec_reduce=True,
        dynamic_scheduler=False, config=tile_config(tile), **varlen,
    )  # fmt: skip


def _tile(kind: str, a: torch.Tensor, n: int, E: int, run) -> str:
    """The tile for this fused GEMM's shape: timed once among QuACK's tiles (the rule's guess under capture)."""
    key = shape_key(kind, a, a.shape[0], n, E, "swiglu")
    return choose(key, tile_for(kind, a.shape[0] / max(E, 1), n), run, tuple(TILES))


def gated_fc1(x: torch.Tensor, w13: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi [M, 2F] interleaved, s = silu(gate) * up [M, F]) for sorted rows x [M, H] and w13 [E, 2F, H]."""
    M, F2 = x.shape[0], w13.shape[1]
    hi, s = x.new_empty(M, F2), x.new_empty(M, F2 // 2)

    def run(tile: str) -> tuple[torch.Tensor, torch.Tensor]:
        _launch_gated(x, w13.transpose(1, 2), hi, s, tile, cu_seqlens_m=bounds)
        return hi, s

    return run(_tile("fwd13", x, F2, w13.shape[0], run))


def dgated_fc2(
    g: torch.Tensor, w2: torch.Tensor, hi: torch.Tensor, p: torch.Tensor, bounds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dhi [M, 2F] interleaved, a_p = p * s [M, F], dp [M] fp32) from g [M, H] (dOut of each row's token),
    w2 [E, H, F], hi from `gated_fc1` and the rows' probabilities p [M]."""
    dhi, a_p = torch.empty_like(hi), hi.new_empty(hi.shape[0], hi.shape[1] // 2)
    scale = p.float().contiguous()

    def run(tile: str) -> torch.Tensor:  # writes dhi and a_p, returns dp
        return _launch_dgated(g, w2, hi, dhi, a_p, scale, tile, cu_seqlens_m=bounds)

    dp = run(_tile("dgrad2", g, a_p.shape[1], w2.shape[0], run))
    return dhi, a_p, dp


def fc1_dgrad(dhi: torch.Tensor, w13: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """dx_rows [M, H] = dhi @ w13[e] per expert, w13's [gate; up] rows read in dhi's interleaved order."""
    out = dhi.new_empty(dhi.shape[0], w13.shape[2])

    def run(tile: str) -> torch.Tensor:
        return launch(dhi, w13, out, tile, cu_seqlens_m=bounds, concat_layout=("B",))

    return run(_tile("dgrad13", dhi, w13.shape[2], w13.shape[0], run))


def fc1_wgrad(dhi: torch.Tensor, x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """dW13 [E, 2F, H] = dhi[rows of e]^T @ x[rows of e] in [gate; up] row order (zeros for an expert without rows)."""
    E = bounds.numel() - 1
    out = dhi.new_empty(E, dhi.shape[1], x.shape[1])
    if x.shape[0] == 0:
        return out.zero_()

    def run(tile: str) -> torch.Tensor:
        return launch(dhi.t(), x, out, tile, cu_seqlens_k=bounds, concat_layout=("out",))

    return run(_tile("wgrad13", dhi, x.shape[1], E, run))


def runs(x: torch.Tensor, ffn: int) -> bool:
    """Whether the fused SwiGLU GEMMs run for rows like x (bf16 / fp16 on a Hopper GPU with QuACK, hidden a
    multiple of 8) and an expert FFN width `ffn` (a multiple of 8)."""
    return ffn % 8 == 0 and quack_gemm.quack_runs(x)
