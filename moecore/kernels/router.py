"""Fused top-k router: scores, expert selection, routing weights and the balancing-loss sums in one launch.

Legend: T tokens, E experts, K experts per token, G segments. A segment is a run of `segment`
consecutive tokens whose loss sums are kept apart: the whole micro-batch (G = 1) for the aux and
global aux losses, one sequence (G = B) for the sequence aux loss.

From router logits [T, E] (fp32 or fp64 in the reference, fp32 in the kernel) one forward launch gives
  per token    weight [T, K] and idx [T, K], exactly as `moecore.moe.router.topk_routing` defines them
               (scores: softmax over all experts / raw logits / sigmoid; selection adds the expert bias;
               weights from the unbiased scores, renormalised, scaled); slots in descending selection order
  per segment  counts [G, E]      routed assignments of valid tokens (the load statistics, expert-bias counts)
               aux_counts [G, E]  top-k counts of the unbiased scores without groups: the c_i of the
                                  balancing losses (equal to counts without expert bias and groups)
               psum [G, E]        sum over valid tokens of the balancing scores P (softmax, or sigmoid
                                  divided by its row sum)                                   (differentiable)
               zsum [G]           sum over valid tokens of logsumexp(logits)^2 (router z-loss) (differentiable)
and one backward launch turns d weight, d psum and d zsum into d logits, recomputing the scores.
The kernel computes psum and aux_counts only with `RouterSpec.need_sums` and zsum only with `need_z`
(otherwise psum / zsum come back empty and aux_counts is counts).
The per-segment sums are written per block of tokens and reduced by the caller: deterministic, no atomics.

Backward formulas (c = scaling factor, g = d weight, s = scores at the K picks, S = their sum):
  renormalised       w_k = c s_k / S          ->  ds_k = (c / S) (g_k - sum_j g_j s_j / S)
  not renormalised   w_k = c s_k              ->  ds_k = c g_k
  softmax after top-k  w = c softmax(l_picked) ->  dl_k = c w'_k (g_k - sum_j g_j w'_j),  w' = w / c
  through softmax p: dl = p (ds - sum(ds p));  through sigmoid s: dl = ds s (1 - s)
  balancing P = s / (sum s + eps) (sigmoid): ds = (dP - sum(dP P)) / (sum s + eps)
  z-loss: d(lse^2)/dl = 2 lse p

Group-limited routing (DeepSeek-V2/V3 `router_num_groups`: each group scored by its best or best-two
selection scores, the best `group_topk` groups kept) runs in the kernel when the expert count is a
power of two (DeepSeek-V3's 256; DeepSeek-V2's 160 takes the reference). Router replay is not fused:
the MoE layer uses the unfused path for it. `fused_router` runs the kernel on CUDA (or with
`impl="triton"`), the reference `fused_router_reference` (plain autograd) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecore.kernels._triton import next_pow2, triton_importable, use_triton

SCORE_CODES = {"softmax_pre": 0, "softmax_post": 1, "sigmoid": 2}
SIGMOID_EPS = 1e-20  # as in moecore.moe.router: sigmoid renormalisation and balancing scores


@dataclass(frozen=True)
class RouterSpec:
    """The routing options the kernel needs (a subset of MoEConfig)."""

    topk: int
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = True  # softmax over all experts before top-k (else softmax over the K picks)
    norm_topk_prob: bool = True
    scaling_factor: float | None = None
    need_sums: bool = False  # aux_counts and psum (a balancing loss is in the objective)
    need_z: bool = False  # zsum (router z-loss)
    num_groups: int = 1  # group-limited routing: expert groups (1: none)
    group_topk: int = 1  # groups a token may pick from
    group_score: str = "max"  # max | top2_sum

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1

    @property
    def score_code(self) -> int:
        if self.score_function == "sigmoid":
            return SCORE_CODES["sigmoid"]
        if self.score_function != "softmax":
            raise ValueError(
                f"moe.router_score_function={self.score_function!r} is invalid: allowed: softmax | sigmoid"
            )
        return SCORE_CODES["softmax_pre" if self.pre_softmax else "softmax_post"]


@dataclass
class FusedRouting:
    """Outputs of the fused router; see the module docstring."""

    weight_TK: torch.Tensor
    idx_TK: torch.Tensor
    counts_GE: torch.Tensor
    aux_counts_GE: torch.Tensor
    psum_GE: torch.Tensor
    zsum_G: torch.Tensor


# ---------------------------------------------------------------- PyTorch reference (plain autograd)


def _scores(logits_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    code = spec.score_code
    if code == 0:
        return torch.softmax(logits_TE, dim=-1)
    if code == 1:
        return logits_TE
    return torch.sigmoid(logits_TE)


def group_limited_mask(select_TE: torch.Tensor, num_groups: int, group_topk: int, group_score: str) -> torch.Tensor:
    """Mask (to -inf) the experts outside each token's best `group_topk` groups of experts.

    group_score `max`: a group's score is its best expert score (DeepSeek-V2 group-limited greedy);
    `top2_sum`: the sum of its two best expert scores (DeepSeek-V3; one expert per group: its score).
    """
    T, E = select_TE.shape
    grouped = select_TE.view(T, num_groups, E // num_groups)
    if group_score == "max":
        gscore = grouped.max(dim=-1).values
    elif group_score == "top2_sum":
        gscore = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(dim=-1)
    else:
        raise ValueError(f"moe.router_group_score={group_score!r} is invalid: allowed: max | top2_sum")
    gidx = gscore.topk(group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
    keep_TE = keep.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
    return select_TE.masked_fill(~keep_TE, float("-inf"))


def _topk_mask(select_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = select_TE.topk(k, dim=-1).indices
    return idx, torch.zeros_like(select_TE).scatter_(1, idx, 1.0)


def fused_router_reference(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    expert_bias_E: torch.Tensor | None = None,
    valid_T: torch.Tensor | None = None,
    segment: int | None = None,
) -> FusedRouting:
    """The same outputs as the kernel through torch ops (differentiable in logits by autograd)."""
    T, E = logits_TE.shape
    seg = segment or T
    G = T // seg  # 0 segments for an empty batch
    K = spec.topk
    scores = _scores(logits_TE, spec)
    with torch.no_grad():
        select = scores.detach() + (expert_bias_E.to(scores.dtype) if expert_bias_E is not None else 0.0)
        if spec.grouped:
            select = group_limited_mask(select, spec.num_groups, spec.group_topk, spec.group_score)
        idx, chosen = _topk_mask(select, K)
    picked = scores.gather(1, idx)
    if spec.score_code == 1:
        weight = torch.softmax(picked, dim=-1)
    elif spec.norm_topk_prob:
        eps = SIGMOID_EPS if spec.score_code == 2 else 0.0
        weight = picked / (picked.sum(dim=-1, keepdim=True) + eps)
    else:
        weight = picked
    if spec.scaling_factor is not None:
        weight = weight * spec.scaling_factor
    v = torch.ones(T, dtype=scores.dtype, device=scores.device) if valid_T is None else valid_T.to(scores.dtype)
    counts = (chosen * v[:, None]).view(G, seg, E).sum(1)
    aux_counts = counts
    if (expert_bias_E is not None or spec.grouped) and spec.need_sums:
        with torch.no_grad():
            aux_counts = (_topk_mask(scores.detach(), K)[1] * v[:, None]).view(G, seg, E).sum(1)
    if spec.score_code == 2:
        balancing = scores / (scores.sum(dim=-1, keepdim=True) + SIGMOID_EPS)
    else:
        balancing = torch.softmax(logits_TE, dim=-1)
    psum = (balancing * v[:, None]).view(G, seg, E).sum(1)
    zsum = (torch.logsumexp(logits_TE, dim=-1).square() * v).view(G, seg).sum(1)
    return FusedRouting(weight, idx, counts.float(), aux_counts.float(), psum, zsum)


# ---------------------------------------------------------------- Triton kernels

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_block(logits_ptr, valid_ptr, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, HAS_VALID: tl.constexpr):
        # This program's rows and columns, its logits [BLOCK_T, BLOCK_E] (-inf past E), their softmax p
        # and logsumexp, and each row's weight in the sums v (0 for padding and rows past T).
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        rmask = rows < T
        cmask = cols < E
        m2 = rmask[:, None] & cmask[None, :]
        lg = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=m2, other=0.0)
        lg = tl.where(cmask[None, :], lg.to(tl.float32), float("-inf"))
        mx = tl.max(lg, 1)
        ex = tl.exp(lg - mx[:, None])
        z = tl.sum(ex, 1)
        if HAS_VALID:
            v = tl.load(valid_ptr + rows, mask=rmask, other=0).to(tl.float32)
        else:
            v = rmask.to(tl.float32)
        return rows, cols, rmask, cmask, lg, ex / z[:, None], mx + tl.log(z), v

    @triton.jit
    def _topk_rows(
        sel, scores, cols, kcols, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        # K passes of arg-max (ties: the smallest expert id); returns picked scores, ids and the 0/1 mask.
        vals = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
        chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for k in tl.static_range(K):
            best = tl.max(sel, 1)
            pick = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), 1)
            hit = cols[None, :] == pick[:, None]
            val = tl.sum(tl.where(hit, scores, 0.0), 1)
            slot = kcols[None, :] == k
            vals = tl.where(slot, val[:, None], vals)
            ids = tl.where(slot, pick[:, None], ids)
            chosen = tl.where(hit, 1.0, chosen)
            sel = tl.where(hit, float("-inf"), sel)
        return vals, ids, chosen

    @triton.jit
    def _group_limit(
        sel, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, G: tl.constexpr, GROUP_TOPK: tl.constexpr, TOP2: tl.constexpr
    ):
        # Keep each row's best GROUP_TOPK of G equal groups of experts (the rest -> -inf). A group's score
        # is its best selection score, or with TOP2 the sum of its best two. Needs BLOCK_E == E.
        EG: tl.constexpr = BLOCK_E // G
        s3 = tl.reshape(sel, (BLOCK_T, G, EG))
        best = tl.max(s3, 2)
        if TOP2 and EG > 1:
            gc = tl.arange(0, EG)
            first = tl.min(tl.where(s3 == best[:, :, None], gc[None, None, :], EG), 2)
            score = best + tl.max(tl.where(gc[None, None, :] == first[:, :, None], float("-inf"), s3), 2)
        else:
            score = best
        gid = tl.arange(0, G)
        keep = tl.zeros((BLOCK_T, G), dtype=tl.float32)
        for _ in tl.static_range(GROUP_TOPK):
            top = tl.max(score, 1)
            pick = tl.min(tl.where(score == top[:, None], gid[None, :], G), 1)
            hit = gid[None, :] == pick[:, None]
            keep = tl.where(hit, 1.0, keep)
            score = tl.where(hit, float("-inf"), score)
        kept = tl.where(keep[:, :, None] > 0, s3, float("-inf"))
        return tl.reshape(kept, (BLOCK_T, BLOCK_E))

    @triton.jit
    def _router_fwd_kernel(
        logits_ptr, bias_ptr, valid_ptr, weight_ptr, idx_ptr, counts_ptr, aux_counts_ptr, psum_ptr, zsum_ptr,
        T, E, scaling,
        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
        SCORE: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
        NEED_SUMS: tl.constexpr, NEED_Z: tl.constexpr,
        N_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr, GROUP_TOP2: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows, cols, rmask, cmask, lg, p, lse, v = _load_block(logits_ptr, valid_ptr, T, E, BLOCK_T, BLOCK_E, HAS_VALID)
        kcols = tl.arange(0, BLOCK_K)
        if SCORE == 0:
            scores = p
        elif SCORE == 1:
            scores = lg
        else:
            scores = tl.where(cmask[None, :], tl.sigmoid(lg), 0.0)
        sel = scores
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        sel = tl.where(cmask[None, :], sel, float("-inf"))
        if N_GROUPS > 1:
            sel = _group_limit(sel, BLOCK_T, BLOCK_E, N_GROUPS, GROUP_TOPK, GROUP_TOP2)
        vals, ids, chosen = _topk_rows(sel, scores, cols, kcols, K, BLOCK_E, BLOCK_T, BLOCK_K)
        kmask = (kcols < K)[None, :]
        if SCORE == 1:
            ek = tl.where(kmask, tl.exp(vals - tl.max(tl.where(kmask, vals, float("-inf")), 1)[:, None]), 0.0)
            w = ek / tl.sum(ek, 1)[:, None]
        elif RENORM:
            denom = tl.sum(tl.where(kmask, vals, 0.0), 1)
            if SCORE == 2:
                denom = denom + 1e-20
            w = vals / denom[:, None]
        else:
            w = vals
        w = w * scaling
        out2 = rows.to(tl.int64)[:, None] * K + kcols[None, :]
        m2 = rmask[:, None] & kmask
        tl.store(weight_ptr + out2, w, mask=m2)
        tl.store(idx_ptr + out2, ids.to(tl.int64), mask=m2)
        # per-block sums over valid tokens (rows past T count as invalid)
        part = pid.to(tl.int64) * E + cols
        tl.store(counts_ptr + part, tl.sum(chosen * v[:, None], 0), mask=cmask)
        if NEED_SUMS:
            if HAS_BIAS or N_GROUPS > 1:  # the balancing counts use a plain top-k (no bias, no groups)
                plain = tl.where(cmask[None, :], scores, float("-inf"))
                _, _, chosen2 = _topk_rows(plain, scores, cols, kcols, K, BLOCK_E, BLOCK_T, BLOCK_K)
                tl.store(aux_counts_ptr + part, tl.sum(chosen2 * v[:, None], 0), mask=cmask)
            if SCORE == 2:
                bal = scores / (tl.sum(scores, 1) + 1e-20)[:, None]
            else:
                bal = p
            tl.store(psum_ptr + part, tl.sum(bal * v[:, None], 0), mask=cmask)
        if NEED_Z:
            tl.store(zsum_ptr + pid, tl.sum(lse * lse * v, 0))

    @triton.jit
    def _router_bwd_kernel(
        logits_ptr, idx_ptr, dw_ptr, dpsum_ptr, dz_ptr, valid_ptr, dlogits_ptr,
        T, E, blocks_per_segment, scaling,
        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
        SCORE: tl.constexpr, RENORM: tl.constexpr, HAS_VALID: tl.constexpr,
        HAS_DW: tl.constexpr, HAS_DPSUM: tl.constexpr, HAS_DZ: tl.constexpr,
    ):  # fmt: skip
        seg = tl.program_id(0) // blocks_per_segment
        rows, cols, rmask, cmask, lg, p, lse, v = _load_block(logits_ptr, valid_ptr, T, E, BLOCK_T, BLOCK_E, HAS_VALID)
        kcols = tl.arange(0, BLOCK_K)
        sig = tl.where(cmask[None, :], tl.sigmoid(lg), 0.0)
        d_scores = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)  # d loss / d scores (d logits for SCORE 1)
        if HAS_DW:
            if SCORE == 0:
                scores = p
            elif SCORE == 1:
                scores = lg
            else:
                scores = sig
            kmask = (kcols < K)[None, :]
            in2 = rows.to(tl.int64)[:, None] * K + kcols[None, :]
            m2 = rmask[:, None] & kmask
            ids = tl.load(idx_ptr + in2, mask=m2, other=0).to(tl.int32)
            g = tl.load(dw_ptr + in2, mask=m2, other=0.0).to(tl.float32)
            picked = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            for k in tl.static_range(K):
                slot = kcols[None, :] == k
                hit = cols[None, :] == tl.sum(tl.where(slot, ids, 0), 1)[:, None]
                picked = tl.where(slot, tl.sum(tl.where(hit, scores, 0.0), 1)[:, None], picked)
            if SCORE == 1:
                ek = tl.where(kmask, tl.exp(picked - tl.max(tl.where(kmask, picked, float("-inf")), 1)[:, None]), 0.0)
                q = ek / tl.sum(ek, 1)[:, None]
                dpick = scaling * q * (g - tl.sum(g * q, 1)[:, None])
            elif RENORM:
                denom = tl.sum(tl.where(kmask, picked, 0.0), 1)
                if SCORE == 2:
                    denom = denom + 1e-20
                u = picked / denom[:, None]
                dpick = (scaling / denom)[:, None] * (g - tl.sum(g * u, 1)[:, None])
            else:
                dpick = scaling * g
            for k in tl.static_range(K):
                slot = kcols[None, :] == k
                hit = cols[None, :] == tl.sum(tl.where(slot, ids, 0), 1)[:, None]
                d_scores += tl.where(hit, tl.sum(tl.where(slot, dpick, 0.0), 1)[:, None], 0.0)
        d_bal = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        if HAS_DPSUM:
            row = tl.load(dpsum_ptr + seg.to(tl.int64) * E + cols, mask=cmask, other=0.0).to(tl.float32)
            d_bal = row[None, :] * v[:, None]
        if SCORE == 0:
            d = d_scores + d_bal
            dl = p * (d - tl.sum(d * p, 1)[:, None])
        elif SCORE == 1:
            dl = d_scores + p * (d_bal - tl.sum(d_bal * p, 1)[:, None])
        else:
            z = tl.sum(sig, 1) + 1e-20
            bal = sig / z[:, None]
            dsig = d_scores + (d_bal - tl.sum(d_bal * bal, 1)[:, None]) / z[:, None]
            dl = dsig * sig * (1.0 - sig)
        if HAS_DZ:
            dz = tl.load(dz_ptr + seg).to(tl.float32)
            dl += (2.0 * dz * v * lse)[:, None] * p
        m2 = rmask[:, None] & cmask[None, :]
        tl.store(dlogits_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], dl, mask=m2)


def _blocking(T: int, E: int, segment: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, number of blocks, blocks per segment, warps): a block never straddles two segments."""
    block_t = max(1, min(32, 2048 // next_pow2(E)))
    if segment != T:  # several segments: the block size must divide the segment length
        while segment % block_t:
            block_t //= 2
    nblocks = -(-T // block_t)
    warps = 4 if block_t * next_pow2(E) <= 2048 else 8
    return block_t, nblocks, (nblocks if segment == T else segment // block_t), warps


class _FusedRouterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, valid, spec: RouterSpec, segment: int):
        logits = logits.contiguous()
        T, E = logits.shape
        K = spec.topk
        G = T // segment
        block_t, nblocks, per_seg, warps = _blocking(T, E, segment)
        dev = logits.device
        weight = torch.empty(T, K, dtype=logits.dtype, device=dev)
        idx = torch.empty(T, K, dtype=torch.int64, device=dev)
        counts = torch.empty(nblocks, E, dtype=torch.float32, device=dev)
        has_bias_sums = (bias is not None or spec.grouped) and spec.need_sums
        aux = torch.empty(nblocks, E, dtype=torch.float32, device=dev) if has_bias_sums else counts
        psum = torch.empty(nblocks, E, dtype=torch.float32, device=dev) if spec.need_sums else counts
        zsum = torch.empty(nblocks, dtype=torch.float32, device=dev) if spec.need_z else counts
        valid_arg = valid.contiguous() if valid is not None else logits
        if T:
            _router_fwd_kernel[(nblocks,)](
                logits, bias if bias is not None else logits, valid_arg, weight, idx, counts, aux, psum, zsum,
                T, E, float(spec.scaling_factor or 1.0),
                K, block_t, next_pow2(E), next_pow2(K), spec.score_code, spec.norm_topk_prob,
                bias is not None, valid is not None, spec.need_sums, spec.need_z,
                spec.num_groups, spec.group_topk, spec.group_score == "top2_sum",
                num_warps=warps,
            )  # fmt: skip

        def per_segment(part: torch.Tensor) -> torch.Tensor:
            return part.view(G, per_seg, *part.shape[1:]).sum(1)

        counts_GE = per_segment(counts)
        aux_GE = per_segment(aux) if has_bias_sums else counts_GE
        # sums that were not asked for come back empty (no fill kernel: this path is launch-bound)
        psum_GE = per_segment(psum).to(logits.dtype) if spec.need_sums else logits.new_empty(0)
        zsum_G = per_segment(zsum).to(logits.dtype) if spec.need_z else logits.new_empty(0)
        ctx.save_for_backward(logits, idx, valid)
        ctx.spec, ctx.segment = spec, segment
        ctx.mark_non_differentiable(idx, counts_GE, aux_GE)
        ctx.set_materialize_grads(False)
        return weight, idx, counts_GE, aux_GE, psum_GE, zsum_G

    @staticmethod
    def backward(ctx, d_weight, _d_idx, _d_counts, _d_aux, d_psum, d_zsum):
        logits, idx, valid = ctx.saved_tensors
        spec: RouterSpec = ctx.spec
        d_psum = d_psum if spec.need_sums else None  # sums that were not computed carry no gradient
        d_zsum = d_zsum if spec.need_z else None
        T, E = logits.shape
        block_t, nblocks, per_seg, warps = _blocking(T, E, ctx.segment)
        d_logits = torch.empty_like(logits)
        if T:
            _router_bwd_kernel[(nblocks,)](
                logits, idx,
                d_weight.contiguous() if d_weight is not None else logits,
                d_psum.contiguous() if d_psum is not None else logits,
                d_zsum.contiguous() if d_zsum is not None else logits,
                valid if valid is not None else logits, d_logits,
                T, E, per_seg, float(spec.scaling_factor or 1.0),
                spec.topk, block_t, next_pow2(E), next_pow2(spec.topk), spec.score_code, spec.norm_topk_prob,
                valid is not None, d_weight is not None, d_psum is not None, d_zsum is not None,
                num_warps=warps,
            )  # fmt: skip
        return d_logits, None, None, None, None


def kernel_covers(spec: RouterSpec, num_experts: int) -> bool:
    """Whether the kernel implements these options for this many experts: group-limited routing needs a
    power-of-two expert count (so the groups are whole blocks of the kernel's tile)."""
    if spec.topk > num_experts or spec.score_function not in ("softmax", "sigmoid"):
        return False
    if spec.grouped:
        pow2 = next_pow2(num_experts) == num_experts
        return pow2 and num_experts % spec.num_groups == 0 and spec.group_topk <= spec.num_groups
    return True


def fused_router_supported(logits_TE: torch.Tensor, spec: RouterSpec, impl: str = "auto") -> bool:
    """Whether `fused_router` would launch the kernel for these logits (else it runs the reference)."""
    return use_triton(impl, logits_TE) and logits_TE.dtype == torch.float32 and kernel_covers(spec, logits_TE.shape[-1])


def fused_router(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    expert_bias_E: torch.Tensor | None = None,
    valid_T: torch.Tensor | None = None,
    segment: int | None = None,
    impl: str = "auto",
) -> FusedRouting:
    """Route T tokens and sum the balancing statistics per segment; see the module docstring.

    `valid_T`: bool / 0-1 mask of the tokens that count in the sums (padding excluded); `segment`:
    tokens per segment (must divide T; default T). Differentiable in logits through weight, psum, zsum.
    """
    T = logits_TE.shape[0]
    segment = segment or max(T, 1)
    if T % segment:
        raise ValueError(f"segment={segment} does not divide the {T} tokens")
    if not fused_router_supported(logits_TE, spec, impl):
        return fused_router_reference(logits_TE, spec, expert_bias_E, valid_T, segment)
    bias = expert_bias_E.float().contiguous() if expert_bias_E is not None else None
    out = _FusedRouterFn.apply(logits_TE, bias, valid_T, spec, segment)
    return FusedRouting(*out)
