"""Routed experts stored as grouped tensors, run as one grouped GEMM or as a loop of GEMMs.

Legend: E experts, H hidden, F expert FFN width, N permuted rows (sorted by expert), T tokens, K top-k.

Weights: `w13` [E, 2F, H] holds each expert's gate rows then up rows (SwiGLU; GeLU experts have no
gate, so `w13` is [E, F, H]); `w2` [E, H, F] is the down projection. This is Hugging Face's
`gate_up_proj` / `down_proj` layout, so conversion is a rename.

Expert e applied to a row x: SwiGLU y = w2[e] @ (silu(g) * u) with [g; u] = w13[e] @ x;
GeLU y = w2[e] @ gelu_tanh(w13[e] @ x). DeepSeek-V4's clipped SwiGLU (`swiglu_limit` L, from
`model.activation=swiglu_clipped`) is SwiGLU on min(g, L) and clamp(u, -L, L), on every path below.
With per-row routing probabilities p (the `moe.apply_probs_on_input` option) the activation is
multiplied by p before w2, which equals weighting the output because w2 is linear.

Three implementations of the same maths:
- `experts_grouped_mm`: `torch._grouped_mm` over all experts at once, no host synchronisation. It
  runs on CPU (fp32 / bf16 / fp16 in torch >= 2.9) and on CUDA GPUs of compute capability >= 9.0
  in bf16 with 16-byte aligned rows (H and F multiples of 8); `grouped_mm_supported` says where.
- `experts_loop`: one matmul pair per expert over its contiguous rows (reads the counts on the host);
  the exact fallback everywhere else (fp64, older GPUs, odd sizes).
- `experts_reference`: the textbook loop over experts on the unpermuted tokens, for tests.

Recomputation (`model.recompute_modules` "moe_act", `GroupedExperts.recompute_act`): the first two
paths checkpoint the activation (x probs), so autograd keeps only its input h instead of also the
activation's intermediates (for SwiGLU silu(g) and silu(g) * u, two [N, F] tensors); the fused
expert FFN (moecore/kernels/grouped_ffn.py) already keeps only x, h and p and recomputes the
activation in its backward, with or without the option.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moecore.kernels.fp8_grouped import fp8_expert_ffn
from moecore.kernels.grouped_ffn import expert_ffn, fused_expert_ffn_available
from moecore.kernels.quack_gemm import LoadSpread

ACTIVATIONS = ("swiglu", "gelu")


def activation_fn(h: torch.Tensor, activation: str, limit: float | None = None) -> torch.Tensor:
    """SwiGLU on [.., 2F] (gate half then up half) -> [.., F], with g and u clipped to `limit` first when given
    (DeepSeek-V4); GeLU (tanh approximation) elementwise."""
    if activation == "swiglu":
        g, u = h.chunk(2, dim=-1)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return F.silu(g) * u
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    raise ValueError(f"activation={activation!r} is invalid: allowed: swiglu | gelu")


def _activate(
    h: torch.Tensor, activation: str, probs_N: torch.Tensor | None, recompute: bool, limit: float | None = None
) -> torch.Tensor:
    """activation(h) (* probs per row); with `recompute`, checkpointed: recomputed from h in backward."""

    def act(h: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        a = activation_fn(h, activation, limit)
        return a if p is None else a * p.to(a.dtype).unsqueeze(-1)

    if recompute and torch.is_grad_enabled() and (h.requires_grad or (probs_N is not None and probs_N.requires_grad)):
        return checkpoint(act, h, probs_N, use_reentrant=False)
    return act(h, probs_N)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def grouped_mm_unsupported_reason(x: torch.Tensor, hidden_size: int, ffn_hidden_size: int) -> str | None:
    """Why `torch._grouped_mm` cannot run for rows like `x` on this device and dtype; None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.device.type == "cpu":
        ok = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return None if ok else f"{x.dtype} rows on CPU (fp32, bf16 or fp16 needed)"
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        if major < 9:
            return f"compute capability {major}.{minor} (9.0 or newer needed)"
        if x.dtype != torch.bfloat16:
            return f"{x.dtype} activations (bf16 needed: train.precision=bf16)"
        if hidden_size % 8 or ffn_hidden_size % 8:
            return f"hidden {hidden_size} / expert FFN {ffn_hidden_size} not multiples of 8"
        return None
    return f"device {x.device.type}"


def grouped_mm_supported(x: torch.Tensor, hidden_size: int, ffn_hidden_size: int) -> bool:
    """Whether `torch._grouped_mm` runs for rows like `x` on this device and dtype."""
    return grouped_mm_unsupported_reason(x, hidden_size, ffn_hidden_size) is None


def experts_grouped_mm(
    x_NH: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    probs_N: torch.Tensor | None = None,
    recompute_act: bool = False,
    limit: float | None = None,
) -> torch.Tensor:
    """All experts in two grouped GEMMs; rows of expert e are x[offs[e-1]:offs[e]]."""
    offs = torch.cumsum(tokens_per_expert.to(x_NH.device), 0, dtype=torch.int32)
    x = x_NH.contiguous()
    h = _ContiguousGrad.apply(torch._grouped_mm(x, w13.to(x.dtype).transpose(-2, -1), offs=offs))
    a = _activate(h, activation, probs_N, recompute_act, limit)
    return _ContiguousGrad.apply(torch._grouped_mm(a, w2.to(x.dtype).transpose(-2, -1), offs=offs))


def experts_loop(
    x_NH: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    probs_N: torch.Tensor | None = None,
    recompute_act: bool = False,
    limit: float | None = None,
) -> torch.Tensor:
    """Same result as `experts_grouped_mm`, one F.linear pair per expert with at least one row.

    The weights are split into per-expert views once (`unbind`): its backward stacks the per-expert
    gradients into one [E, ...] tensor, where indexing `w13[e]` per expert would allocate and add a
    full-size zero gradient for every expert.
    """
    counts = tokens_per_expert.tolist()
    w13_e, w2_e = w13.unbind(0), w2.unbind(0)
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = x_NH[start : start + n]
        p = None if probs_N is None else probs_N[start : start + n]
        a = _activate(F.linear(seg, w13_e[e].to(seg.dtype)), activation, p, recompute_act, limit)
        outs.append(F.linear(a, w2_e[e].to(a.dtype)))
        start += n
    if not outs:
        return x_NH.new_zeros(0, w2.shape[1])
    return torch.cat(outs, dim=0)


def experts_reference(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    limit: float | None = None,
) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{idx[t, k]}(x[t]), looping over experts on the original token order."""
    out = torch.zeros_like(x_TH, dtype=torch.promote_types(x_TH.dtype, weight_TK.dtype))
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(idx_TK == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = F.linear(activation_fn(F.linear(x_TH[tok], w13[e]), activation, limit), w2[e])
        out = out.index_add(0, tok, y.to(out.dtype) * weight_TK[tok, slot].to(out.dtype).unsqueeze(-1))
    return out.to(x_TH.dtype)


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer: parameters `w13` [E, 2F, H] (or [E, F, H] for GeLU), `w2` [E, H, F].

    forward(x [N, H] sorted by expert, tokens_per_expert [E], probs [N] | None) -> [N, H].
    `grouped_gemm=False` forces the loop of GEMMs; `recompute_act` (set by MoELayer from
    `model.recompute_modules` "moe_act") recomputes the activation in backward (module docstring);
    `swiglu_limit`: DeepSeek-V4's clipped SwiGLU (set from model.swiglu_limit), None for the plain one.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        init_std: float = 0.02,
        grouped_gemm: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is invalid: allowed: swiglu | gelu")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.grouped_gemm = grouped_gemm
        self.recompute_act = False
        self.swiglu_limit: float | None = None
        self.gemm_plan = None  # GemmPlan for the fused expert FFN; None: default_plan per shape (benchmarks)
        self.sync_free = False  # moe.sync_free: no GEMM that reads the counts on the host
        self.gemm_backend = "auto"  # moe.gemm_backend: whether default_plan may take QuACK's grouped GEMMs
        self.load_spread = LoadSpread()  # how unevenly recent steps loaded the experts: QuACK's tiles are keyed by it
        self.name = "experts"  # the module's name in the model, for the slow-path warning (set by the model)
        self.warned = False
        self.last_path = None  # "fused" | "grouped_mm" | "loop" | "fp8" | "minimal" | "chunked": what the last forward ran (tests, diagnostics)
        self.fp8_recipe = None  # an Fp8Recipe under train.precision=fp8 (moecore/models/fp8.py): FP8 GEMMs
        rows = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.w13 = nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        nn.init.normal_(self.w13, std=init_std)
        nn.init.normal_(self.w2, std=init_std)

    def uses_grouped_mm(self, x_NH: torch.Tensor) -> bool:
        return self.grouped_gemm and grouped_mm_supported(x_NH, self.hidden_size, self.ffn_hidden_size)

    def swiglu_options(self) -> dict:
        """The SwiGLU's form beyond the plain one, as the fused and low-memory expert Functions take it (`limit`,
        `alpha`, `b13`, `b2`): here DeepSeek-V4's clip or nothing; gpt-oss's experts add their form and biases."""
        return {"limit": self.swiglu_limit}

    def _warn_slow_path(self, x_NH: torch.Tensor) -> None:
        """On a GPU, say once (per module) why the experts leave the fused kernel for a slower path."""
        if self.warned or not x_NH.is_cuda:
            return
        self.warned = True
        if not self.grouped_gemm:
            reason = "moe.grouped_gemm=false"
        elif self.activation != "swiglu":
            reason = f"activation {self.activation} (the fused expert FFN is SwiGLU)"
        elif not fused_expert_ffn_available(x_NH):
            reason = "triton does not import"
        else:
            reason = grouped_mm_unsupported_reason(x_NH, self.hidden_size, self.ffn_hidden_size)
        if reason is None:
            return
        weights = f"weights {self.w13.dtype}"
        warnings.warn(
            f"{self.name}: the fused expert FFN cannot run ({reason}; {weights}); using a slower path", stacklevel=3
        )

    def forward(
        self, x_NH: torch.Tensor, tokens_per_expert: torch.Tensor, probs_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.fp8_recipe is not None:  # FP8 expert FFN (moecore/kernels/fp8_grouped.py), rows padded inside
            self.last_path = "fp8"
            return fp8_expert_ffn(
                x_NH,
                self.w13,
                self.w2,
                tokens_per_expert,
                probs_N,
                self.fp8_recipe,
                self.gemm_backend,
                self.swiglu_limit,
            )
        if x_NH.is_cuda and not self.warned:
            self._warn_slow_path(x_NH)
        if self.activation == "swiglu" and fused_expert_ffn_available(x_NH) and self.uses_grouped_mm(x_NH):
            # Fused expert FFN (moecore/kernels/grouped_ffn.py): GEMM per shape, fused SwiGLU * probs.
            self.last_path = "fused"
            counts = tokens_per_expert.to(x_NH.device)
            return expert_ffn(
                x_NH,
                self.w13,
                self.w2,
                counts,
                probs_N,
                self.gemm_plan,
                sync_free=self.sync_free,
                backend=self.gemm_backend,
                load_spread=self.load_spread,
                **self.swiglu_options(),
            )
        if self.uses_grouped_mm(x_NH):
            self.last_path = "grouped_mm"
            return experts_grouped_mm(
                x_NH,
                tokens_per_expert,
                self.w13,
                self.w2,
                self.activation,
                probs_N,
                self.recompute_act,
                self.swiglu_limit,
            )
        self.last_path = "loop"
        return experts_loop(
            x_NH, tokens_per_expert, self.w13, self.w2, self.activation, probs_N, self.recompute_act, self.swiglu_limit
        )
