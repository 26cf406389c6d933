"""Top-k router: logits, scores, expert selection and routing weights for every routing option.

Legend for shape suffixes: T tokens, E experts, K experts per token (top-k), H hidden size.

Order of operations (`topk_routing`), one token at a time:
1. logits = x @ W_router^T, computed in `moe.router_dtype` (fp32 or fp64).
2. scores: softmax over all experts (`router_pre_softmax`), the raw logits (softmax after top-k,
   Megatron-Core's default), sigmoid (`router_score_function=sigmoid`) or sqrt(softplus(logit))
   (`sqrtsoftplus`, DeepSeek-V4).
3. selection scores = scores + expert bias (aux-loss-free balancing, DeepSeek-V3); the bias only
   chooses experts, the weights below never see it.
4. group-limited routing (DeepSeek-V2/V3): experts form `router_num_groups` equal groups, each group
   is scored (`max` of its selection scores, DeepSeek-V2; or the sum of its top-2, DeepSeek-V3), the
   best `router_group_topk` groups stay and the other experts are masked to -inf.
5. top-k over the selection scores -> expert indices.
6. weights, gathered from the unbiased scores:
   - softmax, pre-softmax: softmax(all)[idx], divided by their sum if `norm_topk_prob` (no epsilon,
     as Mixtral / Qwen-MoE in transformers);
   - softmax after top-k: softmax over the K selected logits (sums to one by construction);
   - sigmoid / sqrtsoftplus: score[idx], divided by (their sum + 1e-20) if `norm_topk_prob` (DeepSeek-V3, -V4).
7. weights *= `router_topk_scaling_factor` (routed_scaling_factor) when set.

Hugging Face equivalents: Mixtral = softmax, pre-softmax, renorm; Qwen2-MoE = softmax, pre-softmax,
no renorm; Qwen3-MoE = softmax, pre-softmax, renorm; DeepSeek-V2 = softmax, pre-softmax, group `max`,
no renorm, scaling; DeepSeek-V3 = sigmoid + expert bias (`e_score_correction_bias`), group `top2_sum`,
renorm, scaling; DeepSeek-V4 = sqrtsoftplus + expert bias, no groups, renorm, scaling, and in its first layers
hash routing (`HashRouter`: the experts come from a fixed table of the token id, the weights from the scores).

The expert bias is updated once per optimizer step from the token counts accumulated over the
micro-batches of that step: bias += rate * sign(mean(count) - count) (DeepSeek-V3, Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moecore.config import MoEConfig
from moecore.kernels.router import (
    FusedRouting,
    RouterSpec,
    fused_router,
    group_limited_mask,
    kernel_covers,
)
from moecore.kernels.router_gemm import router_linear

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# Per-expert scores that are not a softmax over the experts (their top-k weights are renormalised with + 1e-20)
_BOUNDED_SCORES = {
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: torch.sqrt(torch.nn.functional.softplus(logits)),  # DeepSeek-V4
}


@dataclass
class RouterOutput:
    """What the router hands to the rest of the layer. Tensors keep their autograd graph."""

    logits_TE: torch.Tensor  # router logits, router dtype
    topk_idx_TK: torch.Tensor  # chosen experts, int64
    topk_weight_TK: torch.Tensor  # routing weights (scaling applied), router dtype


def _select_topk(
    scores_TE: torch.Tensor,
    topk: int,
    score_function: str,
    num_groups: int | None,
    group_topk: int | None,
    group_score: str,
    expert_bias_E: torch.Tensor | None,
) -> torch.Tensor:
    """Steps 3-5: the [T, K] int64 indices of the chosen experts (call under no_grad)."""
    select_TE = scores_TE.detach()
    if expert_bias_E is not None:
        select_TE = select_TE + expert_bias_E.to(select_TE.dtype)
    if num_groups is not None and group_topk is not None and num_groups > 1:
        select_TE = group_limited_mask(select_TE, num_groups, group_topk, group_score)
    # Sorted for softmax (Mixtral / Qwen), unsorted for sigmoid (DeepSeek-V3): the renormalising sum
    # in topk_routing then adds the K weights in the same order as those references, bit for bit.
    return select_TE.topk(topk, dim=-1, sorted=score_function == "softmax").indices


def topk_routing(
    logits_TE: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    norm_topk_prob: bool = True,
    scaling_factor: float | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score: str = "max",
    expert_bias_E: torch.Tensor | None = None,
    forced_idx_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick `topk` experts per token and their weights; see the module docstring for the steps.

    `forced_idx_TK` (router replay): use these experts instead of steps 3-5; the weights are still
    gathered from the current scores at those indices and normalised as configured (step 6-7).
    Returns (weights [T, K] in the logits' dtype, indices [T, K] int64).
    """
    if score_function == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1) if pre_softmax else logits_TE
    elif score_function in _BOUNDED_SCORES:
        scores_TE = _BOUNDED_SCORES[score_function](logits_TE)
    else:
        raise ValueError(
            f"moe.router_score_function={score_function!r} is invalid: allowed: softmax | sigmoid | sqrtsoftplus"
        )
    if forced_idx_TK is not None:
        idx_TK = forced_idx_TK.to(device=logits_TE.device, dtype=torch.int64)
    else:
        with torch.no_grad():
            idx_TK = _select_topk(scores_TE, topk, score_function, num_groups, group_topk, group_score, expert_bias_E)
    picked_TK = scores_TE.gather(1, idx_TK)
    if score_function == "softmax" and not pre_softmax:
        weight_TK = torch.softmax(picked_TK, dim=-1)
    elif score_function == "softmax":
        weight_TK = picked_TK / picked_TK.sum(dim=-1, keepdim=True) if norm_topk_prob else picked_TK
    else:
        weight_TK = picked_TK / (picked_TK.sum(dim=-1, keepdim=True) + 1e-20) if norm_topk_prob else picked_TK
    if scaling_factor is not None:
        weight_TK = weight_TK * scaling_factor
    return weight_TK, idx_TK


def scores_for_balancing(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-token scores over all experts that the balancing losses use (P in E * sum_i f_i P_i).

    softmax: softmax of the logits; sigmoid (sqrtsoftplus): the scores divided by (their sum + 1e-20), so
    each row sums to one (Megatron-Core's `compute_routing_scores_for_aux_loss`).
    """
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    s = _BOUNDED_SCORES[score_function](logits_TE)
    return s / (s.sum(dim=-1, keepdim=True) + 1e-20)


class TopKRouter(nn.Module):
    """Linear gate `weight` [E, H] plus, with expert bias on, the fp32 buffer `expert_bias` [E].

    `expert_bias` is persistent (saved in state_dict; DeepSeek-V3 checkpoints call it
    `e_score_correction_bias`) and stays fp32 when the module is cast to another dtype.
    `local_tokens_per_expert` (not saved) accumulates the routed token counts between bias updates.
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__()
        if cfg.router_score_function == "softmax" and not cfg.router_pre_softmax and not cfg.norm_topk_prob:
            raise ValueError(
                "moe.norm_topk_prob=False is invalid with moe.router_pre_softmax=False: a softmax over the top-k "
                "always sums to one; set moe.router_pre_softmax=true (softmax over all experts, as Qwen2-MoE)"
            )
        if cfg.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"moe.router_dtype={cfg.router_dtype!r} is invalid: allowed: fp32 | fp64")
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.topk = cfg.router_topk
        self.router_dtype = ROUTER_DTYPES[cfg.router_dtype]
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=init_std)
        if cfg.router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        # Router replay (moecore/moe/router_replay.py): the run's RouterReplay store and this router's key.
        self.replay = None
        self.replay_key = ""
        self.recompute_memo: dict | None = None  # the checkpointed call's dict (models/recompute.py checkpoint_module)
        self.split_gemm = None  # router_linear's split-bf16 form: None where it applies, False never (benchmarks)

    def _apply(self, fn, recurse: bool = True):
        # Keep the expert bias in fp32 through `.to(dtype)` / `.bfloat16()`: its updates (1e-3) are
        # below bf16 resolution near typical bias values, and selection must not depend on the cast.
        bias = self.expert_bias
        out = super()._apply(fn, recurse)
        if bias is not None and self._buffers["expert_bias"].dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(device=self._buffers["expert_bias"].device, dtype=torch.float32)
        return out

    def router_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Step 1: logits [T, E] in `moe.router_dtype`, also under autocast (with input jitter when training)."""
        x = x_TH
        eps = self.cfg.input_jitter_eps
        if self.training and eps:
            # Switch Transformer input jitter: multiply the router input by U(1 - eps, 1 + eps).
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return router_linear(x, self.weight, self.router_dtype, split=self.split_gemm)

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        logits_TE = self.router_logits(x_TH)
        replay, memo = self.replay, self.recompute_memo
        forced = replay.replayed(self.replay_key, logits_TE.shape[0], memo) if replay is not None else None
        return self._route(logits_TE, forced)

    def _route(self, logits_TE: torch.Tensor, forced: torch.Tensor | None) -> RouterOutput:
        """Steps 2-7 on the logits (`forced`: these experts instead of steps 3-5), recorded for router replay."""
        cfg = self.cfg
        weight_TK, idx_TK = topk_routing(
            logits_TE,
            self.topk,
            score_function=cfg.router_score_function,
            pre_softmax=cfg.router_pre_softmax,
            norm_topk_prob=cfg.norm_topk_prob,
            scaling_factor=cfg.router_topk_scaling_factor,
            num_groups=cfg.router_num_groups,
            group_topk=cfg.router_group_topk,
            group_score=cfg.router_group_score,
            expert_bias_E=self.expert_bias,
            forced_idx_TK=forced,
        )
        if self.replay is not None:
            self.replay.recorded(self.replay_key, idx_TK)
        return RouterOutput(logits_TE=logits_TE, topk_idx_TK=idx_TK, topk_weight_TK=weight_TK)

    def spec(self, need_sums: bool = False, need_z: bool = False) -> RouterSpec:
        """This router's options for the fused kernel (moecore/kernels/router.py)."""
        cfg = self.cfg
        grouped = bool(cfg.router_num_groups and cfg.router_num_groups > 1 and cfg.router_group_topk)
        return RouterSpec(
            topk=self.topk,
            score_function=cfg.router_score_function,
            pre_softmax=cfg.router_pre_softmax,
            norm_topk_prob=cfg.norm_topk_prob,
            scaling_factor=cfg.router_topk_scaling_factor,
            need_sums=need_sums,
            need_z=need_z,
            num_groups=cfg.router_num_groups if grouped else 1,
            group_topk=cfg.router_group_topk if grouped else 1,
            group_score=cfg.router_group_score,
        )

    def fusable(self) -> bool:
        """Whether the fused kernel covers this router: `moe.router_fusion` on, fp32 logits, no router
        replay, and options the kernel implements (group-limited routing: a power-of-two expert count)."""
        ok = self.cfg.router_fusion and self.router_dtype == torch.float32 and self.replay is None
        return ok and kernel_covers(self.spec(), self.num_experts)

    def forward_fused(
        self,
        x_TH: torch.Tensor,
        valid_T: torch.Tensor | None,
        segment: int,
        need_sums: bool,
        need_z: bool,
        impl: str = "auto",
    ) -> tuple[RouterOutput, FusedRouting]:
        """Route and sum the balancing statistics per `segment` tokens in one kernel (call when `fusable()`).

        Same experts and weights as `forward`; see moecore/kernels/router.py for the sums.
        """
        logits_TE = self.router_logits(x_TH)
        spec = self.spec(need_sums, need_z)
        out = fused_router(logits_TE, spec, self.expert_bias, valid_T, segment, impl=impl)
        return RouterOutput(logits_TE=logits_TE, topk_idx_TK=out.idx_TK, topk_weight_TK=out.weight_TK), out

    @torch.no_grad()
    def accumulate_tokens_per_expert(self, counts_E: torch.Tensor) -> None:
        """Add one micro-batch's routed token counts (padding excluded) to the bias-update counts."""
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert += counts_E.to(self.local_tokens_per_expert.dtype)

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor | None = None) -> None:
        """bias += rate * sign(mean(count) - count); then reset the accumulated counts.

        `counts_E` defaults to the accumulated local counts; the caller sums them over the data-parallel
        ranks first when there are several (see MoELayer.update_expert_bias).
        """
        if self.expert_bias is None:
            return
        counts = self.local_tokens_per_expert if counts_E is None else counts_E
        counts = counts.float()
        offset = counts.mean() - counts
        self.expert_bias += self.cfg.router_bias_update_rate * torch.sign(offset)
        self.local_tokens_per_expert.zero_()


class HashRouter(TopKRouter):
    """DeepSeek-V4's hash-routed layers: token t goes to the experts `tid2eid[token_id_t]` (a fixed table,
    [vocab, top-k] int64, saved with the model), weighted by the learned router's scores at those experts
    (step 6-7 of the module docstring). No expert bias: the table alone chooses.

    A model trained from scratch gets a table drawn from `seed`: each token's top-k distinct experts uniformly
    at random, the same on every rank and layout. An imported checkpoint brings its own table.
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int, vocab_size: int, seed: int, init_std: float = 0.02) -> None:
        super().__init__(cfg, hidden_size, init_std)
        self.expert_bias = None
        self.local_tokens_per_expert = None
        self.register_buffer("tid2eid", random_hash_table(vocab_size, cfg.num_experts, cfg.router_topk, seed))

    def fusable(self) -> bool:
        return False

    def forward(self, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None = None) -> RouterOutput:
        if token_ids_T is None:
            raise ValueError("a hash-routed MoE layer (moe.num_hash_layers) needs the token ids of its input")
        logits_TE = self.router_logits(x_TH)
        return self._route(logits_TE, self.tid2eid[token_ids_T.reshape(-1).to(self.tid2eid.device)])


def random_hash_table(vocab_size: int, num_experts: int, topk: int, seed: int) -> torch.Tensor:
    """[vocab, topk] int64: for every token id, `topk` distinct experts drawn uniformly from a CPU generator
    seeded with `seed` (so every rank draws the same table), placed on the default device (a model built under
    `with torch.device("cuda")` gets it there)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.rand(vocab_size, num_experts, generator=gen, device="cpu").topk(topk, dim=-1).indices
    return table.to(torch.empty(0).device)
