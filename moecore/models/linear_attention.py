"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attention` layers).

The token mixer keeps, per value head, a matrix state S of shape [Dk, Dv] instead of a KV cache.
For each token t (the gated delta rule, Yang et al. 2024, "Gated Delta Networks"):

    S <- exp(g_t) * S                              # gated decay, g_t <= 0
    S <- S + beta_t * k_t (v_t - S^T k_t)^T        # delta rule: move S^T k_t towards v_t at rate beta_t
    o_t = S^T q_t

Two implementations of that rule live here, with the same signature:
- `gated_delta_rule_recurrent`: the token-by-token loop above; the reference the tests trust.
- `gated_delta_rule_chunked`: exact and fast. Within a chunk of C tokens the updates collapse into a
  unit lower-triangular solve (the "WY"/UT form); only the [Dk, Dv] state crosses chunk boundaries,
  so memory is linear in the sequence length (tensors of [.., S, C] plus one state per chunk).
On CUDA our Triton kernels (moecore.kernels.gated_delta, same maths, forward and backward) run instead;
flash-linear-attention's kernel is an explicit option when that optional package is installed.

`GatedDeltaNet` is the whole layer laid out as Qwen3-Next checkpoints store it (names under
`linear_attn.` in Hugging Face files): `in_proj_qkvz` and `in_proj_ba` (outputs grouped per key
head), a causal depthwise `conv1d` + SiLU over q|k|v, L2-normalised q and k, the decay
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the rule above with q/k heads shared by
consecutive value heads, a gated RMSNorm `norm` (RMSNorm(o) * weight * silu(z)) and `out_proj`.
Under context parallel (dims.cp > 1) the conv and the rule run through
moecore/parallel/context_deltanet.py (conv halo, affine state composition across ranks).

Tensor parallel splits the heads: each rank holds Hk/tp key heads with the Hv/tp value heads they
serve (in_proj_qkvz / in_proj_ba column-parallel, out_proj row-parallel, A_log / dt_bias sharded by
value head); the conv weight and the gated norm's weight are replicated (see `GatedDeltaNet`).

Shape legend: B batch, S sequence, Hk key heads, Hv value heads, Dk key head dim, Dv value head dim,
N chunks, C chunk length.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from moecore.config import ConfigError, ModelConfig
from moecore.kernels._triton import triton_importable
from moecore.kernels.gated_delta import MAX_HEAD_DIM as GATED_DELTA_MAX_HEAD_DIM
from moecore.kernels.gated_delta import gated_delta_rule_triton
from moecore.parallel.sharding import mark_tp_partial, set_shard
from moecore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_region_input, tp_size

if TYPE_CHECKING:
    from moecore.parallel.dims import ParallelDims

L2NORM_EPS = 1e-6  # the epsilon Qwen3-Next (and flash-linear-attention) use inside the q/k L2 norm


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as Qwen3-Next computes it)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Repeat the Hk q/k heads to the Hv value heads (each key head serves Hv/Hk consecutive value
    heads) and move to [B, Hv, S, D] / [B, Hv, S] in float32 (float64 when v is float64)."""
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    return tuple(x.transpose(1, 2).to(work) for x in (q, k, v, g, beta))


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (reference).

    q, k: [B, S, Hk, Dk]; v: [B, S, Hv, Dv]; g (log decay, <= 0), beta: [B, S, Hv];
    scale multiplies q (default Dk**-0.5); initial_state: [B, Hv, Dk, Dv].
    Returns (o [B, S, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] in float32 — float64 inputs stay float64).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for t in range(s):
        k_t = k[:, :, t]
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)  # S^T k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k_t[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, state))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o.transpose(1, 2).to(out_dtype), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel gated delta rule; same arguments and results as `gated_delta_rule_recurrent`.

    Inside a chunk with start state S0 and cumulative log decay G_t = g_1 + ... + g_t, unrolling
    the recurrence gives S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T, where the written
    values u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{s<t} e^{G_t - G_s} (k_t.k_s) u_s).
    So (I + A) U = beta*V - (beta*e^G*K) S0 with A strictly lower triangular, A_ts =
    beta_t e^{G_t-G_s} k_t.k_s: one triangular solve per chunk gives U = U0 - W S0 with U0, W
    independent of S0, computed for all chunks at once. The scan then only carries S0 across chunks.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} is invalid: must be >= 1")
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    c = chunk_size
    pad = (-s) % c
    if pad:  # padded tokens have k = v = beta = 0 and g = 0: they leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    cum = g.cumsum(-1)  # G_t within each chunk, [B, H, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # e^{G_t - G_s} for s <= t; the upper triangle is masked before exp (it could overflow there).
    decay_ts = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (k @ k.transpose(-1, -2)) * decay_ts * beta[..., None]  # diagonal ignored by the unit solve below
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u0, w = sol.split([dv, dk], dim=-1)  # U = U0 - W S0

    q = q * scale
    attn = (q @ k.transpose(-1, -2)) * decay_ts  # intra-chunk q_t.k_s e^{G_t-G_s}, s <= t
    q_from_start = q * cum.exp()[..., None]  # reads e^{G_t} S0
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # writes decayed to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ state
        outs.append(q_from_start[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2)[:, :, :s]
    return o.transpose(1, 2).to(out_dtype), state


def _fla_chunk_fn():
    """flash-linear-attention's chunked kernel, or None when the optional package is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _fla_backward_ok(device: torch.device) -> bool:
    """False where flash-linear-attention's chunked backward is known to refuse to run: Hopper GPUs with
    Triton >= 3.4 and < 3.7.1 and no tilelang (its issue #640); backend fla then refuses to train."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return True
    try:
        import triton
    except ImportError:
        return True
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if not (3, 4, 0) <= version < (3, 7, 1):
        return True
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_chosen(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `gated_delta_rule` runs our Triton kernel for this backend and these tensors."""
    return backend == "triton" or (
        backend == "auto"
        and q.is_cuda
        and triton_importable()
        and max(k.shape[-1], v.shape[-1]) <= GATED_DELTA_MAX_HEAD_DIM
        and v.dtype != torch.float64
    )


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> torch.Tensor:
    """The rule for training. backend: triton (`gated_delta_rule_triton`; with TRITON_INTERPRET=1 also on
    CPU), fla (flash-linear-attention's kernel, CUDA, when installed), torch (`gated_delta_rule_chunked`),
    auto (triton for CUDA tensors when triton imports and the head dims are <= 128, else torch).
    Returns o [B, S, Hv, Dv]."""
    if backend not in ("auto", "triton", "fla", "torch"):
        raise ValueError(f"backend={backend!r} is invalid: allowed: auto | triton | fla | torch")
    if _triton_chosen(backend, q, k, v):
        return gated_delta_rule_triton(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)[0]
    fla_fn = _fla_chunk_fn() if backend == "fla" and q.is_cuda else None
    if backend == "fla" and fla_fn is None:
        raise ValueError(
            "backend='fla' needs CUDA tensors and the flash-linear-attention package (pip install flash-linear-attention)"
        )
    if fla_fn is not None:
        if (
            torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, k, v, g, beta))
            and not _fla_backward_ok(q.device)
        ):
            raise ValueError(
                "backend='fla' cannot run backward on this GPU with this Triton (flash-linear-attention issue #640): use backend='triton'"
            )
        hk, hv = k.shape[2], v.shape[2]
        if hv != hk:
            q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        o, _ = fla_fn(q.to(v.dtype), k.to(v.dtype), v, g=g.float(), beta=beta.to(v.dtype), scale=scale)
        return o
    return gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)[0]


def gated_delta_rule_with_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule from `initial_state` [B, Hv, Dk, Dv] (zeros when None), returning (o, final state) as
    `gated_delta_rule_chunked`: the Triton kernel where `gated_delta_rule` would pick it, else the PyTorch
    chunked rule (flash-linear-attention is not used here: backend fla runs as auto). Context parallel uses it."""
    if _triton_chosen("auto" if backend == "fla" else backend, q, k, v):
        return gated_delta_rule_triton(
            q, k, v, g, beta, scale=scale, chunk_size=chunk_size, initial_state=initial_state
        )
    return gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * silu(z) over the last dim; weight stored as is (initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention token mixer: x [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dims: ParallelDims | None = None) -> None:
        super().__init__()
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "linear_chunk_size",
        ):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"model.{name}={getattr(cfg, name)!r} is invalid: must be >= 1")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError(
                f"model.linear_num_value_heads={cfg.linear_num_value_heads} is invalid: must be a multiple of model.linear_num_key_heads={cfg.linear_num_key_heads}"
            )
        tp = tp_size(dims)
        if cfg.linear_num_key_heads % tp:  # value heads are a multiple of key heads: they divide too
            raise ConfigError(f"parallel.tp={tp} does not divide model.linear_num_key_heads={cfg.linear_num_key_heads}")
        self.layer_idx = layer_idx
        self.dims = dims
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads  # global head counts
        # Tensor parallel: this rank's key heads and the value heads they serve (sizes below are local).
        self.num_k_heads, self.num_v_heads = hk // tp, hv // tp
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.chunk_size = cfg.linear_chunk_size
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        key_all, value_all = hk * self.head_k_dim, hv * self.head_v_dim
        conv_all = 2 * key_all + value_all
        self.backend = "auto"  # auto | triton | fla | torch, see gated_delta_rule
        self.recompute_core = "core_attn" in cfg.recompute_modules  # recompute the rule in backward
        # Context parallel (moecore/parallel/context_deltanet.py): conv halo and state passing over this group.
        self.cp_group = dims.cp_group if dims is not None and getattr(dims, "cp", 1) > 1 else None

        h = cfg.hidden_size
        # Output features grouped per key head: [q_h (Dk) | k_h (Dk) | v (r*Dv) | z (r*Dv)] for each of
        # the Hk key heads, r = Hv/Hk value heads per key head; in_proj_ba likewise [b (r) | a (r)].
        # That grouping makes a column-parallel split (contiguous blocks of output rows) hand each rank
        # whole key heads with their value heads' v, z, b and a.
        heads = "model.linear_num_key_heads"
        self.in_proj_qkvz = ColumnParallelLinear(h, 2 * key_all + 2 * value_all, False, dims, name=heads)
        self.in_proj_ba = ColumnParallelLinear(h, 2 * hv, False, dims, name=heads)
        # Depthwise causal conv over the channels q (all heads) | k (all heads) | v (all heads). Under TP a
        # rank's channels are three separate blocks of it, so the (small) weight stays whole on every rank,
        # each rank convolving its heads' channels (`_conv_weight`); its gradient is a partial sum over TP.
        self.conv1d = nn.Conv1d(conv_all, conv_all, cfg.linear_conv_kernel_dim, groups=conv_all, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.norm_eps)  # one weight shared by every value head
        self.out_proj = RowParallelLinear(value_all, h, False, dims, name=heads)
        if tp > 1:
            r = dims.tp_group.rank
            for p in (self.dt_bias, self.A_log):  # per value head: this rank's contiguous block
                set_shard(p, "tensor_parallel", (hv,), (r * self.num_v_heads,))
            mark_tp_partial(self.conv1d)
            mark_tp_partial(self.norm)
        self.init_std = cfg.init_std
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Projections ~ N(0, init_std); conv as PyTorch's default; per value head, A ~ U(1, 16) and
        dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (Mamba-2's time-step init)."""
        for lin in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj):
            nn.init.normal_(lin.weight, std=self.init_std)
        self.conv1d.reset_parameters()
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        self.norm.reset_parameters()

    def _split_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, S, H] -> q, k [B, S, Hk*Dk], v, z [B, S, Hv*Dv], b, a [B, S, Hv] (heads in order)."""
        bsz, s, _ = x.shape
        r = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(bsz, s, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, s, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        return tuple(t.reshape(bsz, s, -1) for t in (q, k, v, z, b, a))

    def _conv_weight(self) -> torch.Tensor:
        """The conv filters of this rank's channels [conv_dim, 1, K]: its q, k and v blocks of the whole weight."""
        w = self.conv1d.weight
        if w.shape[0] == self.conv_dim:
            return w
        r = self.dims.tp_group.rank
        kd, vd, tp = self.key_dim, self.value_dim, self.dims.tp
        q, k, v = w.split([kd * tp, kd * tp, vd * tp])
        return torch.cat([q[r * kd : (r + 1) * kd], k[r * kd : (r + 1) * kd], v[r * vd : (r + 1) * vd]])

    def _conv_silu(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv over the sequence + SiLU: [B, S, conv_dim] -> same."""
        if self.cp_group is not None:
            from moecore.parallel.context_deltanet import causal_conv1d_cp

            return F.silu(causal_conv1d_cp(qkv, self._conv_weight(), self.cp_group))
        kernel = self.conv1d.weight.shape[-1]
        y = F.conv1d(F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), self._conv_weight(), groups=self.conv_dim)
        return F.silu(y).transpose(1, 2)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Everything before the recurrence: q, k (L2-normalised) [B, S, Hk, Dk], v [B, S, Hv, Dv],
        g, beta [B, S, Hv] and the output gate z [B, S, Hv, Dv] (this rank's heads under tensor parallel)."""
        x = tp_region_input(x, self.dims)  # tensor parallel: the whole sequence (sequence-parallel shards gathered)
        bsz, s, _ = x.shape
        q, k, v, z, b, a = self._split_projections(x)
        q, k, v = self._conv_silu(torch.cat([q, k, v], dim=-1)).split(
            [self.key_dim, self.key_dim, self.value_dim], dim=-1
        )
        q = l2_normalize(q.reshape(bsz, s, self.num_k_heads, self.head_k_dim).float())
        k = l2_normalize(k.reshape(bsz, s, self.num_k_heads, self.head_k_dim).float())
        v = v.reshape(bsz, s, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay per step, <= 0
        return q, k, v, g, beta, z.reshape(bsz, s, self.num_v_heads, self.head_v_dim)

    def finish(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per value head, then out_proj: o, z [B, S, Hv, Dv] -> [B, S, H]."""
        y = self.norm(o.to(z.dtype), z)
        return self.out_proj(y.flatten(2))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]. position_ids is accepted for a uniform token-mixer signature and
        unused: the recurrence and the causal conv carry the order."""
        q, k, v, g, beta, z = self.prepare(x)
        rule = gated_delta_rule
        if self.cp_group is not None:  # x holds this rank's two chunks of the sequence
            from moecore.parallel.context_deltanet import gated_delta_rule_cp

            rule = functools.partial(gated_delta_rule_cp, group=self.cp_group, rule=gated_delta_rule_with_state)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            o = torch.utils.checkpoint.checkpoint(
                rule, q, k, v, g, beta, None, self.chunk_size, self.backend, use_reentrant=False
            )
        else:
            o = rule(q, k, v, g, beta, chunk_size=self.chunk_size, backend=self.backend)
        return self.finish(o, z)

    def forward_recurrent(self, x: torch.Tensor) -> torch.Tensor:
        """Same as forward with the token-by-token reference rule (for tests)."""
        q, k, v, g, beta, z = self.prepare(x)
        return self.finish(gated_delta_rule_recurrent(q, k, v, g, beta)[0], z)
