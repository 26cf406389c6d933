"""The `moe` section: routing, load balancing, capacity, expert layout and MoE memory options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moecore.config.errors import _check_choice, _check_range, _fail


@dataclass
class MoEConfig:
    """Mixture-of-Experts options; names are Megatron-Core's `--moe-*` flags in snake_case."""

    num_experts: int = 8  # 0: no MoE layers (dense model)
    router_topk: int = 2
    router_score_function: str = "softmax"  # softmax | sigmoid | sqrtsoftplus (DeepSeek-V4: sqrt(softplus(logit)))
    router_pre_softmax: bool = False  # softmax over all experts before top-k (else softmax over the top-k)
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to one
    router_topk_scaling_factor: float | None = None  # multiply the routing weights (routed_scaling_factor)
    router_num_groups: int | None = None  # group-limited routing: number of expert groups
    router_group_topk: int | None = None  # groups a token may pick from
    router_group_score: str = "max"  # max (DeepSeek-V2) | top2_sum (DeepSeek-V3)
    router_enable_expert_bias: bool = False  # aux-loss-free balancing bias, used for selection only
    router_bias_update_rate: float = 1e-3
    router_dtype: str = "fp32"  # fp32 | fp64
    router_fusion: bool = True  # one Triton kernel for scores, top-k, weights and loss sums (CUDA; see docs/moe.md)
    input_jitter_eps: float | None = None
    router_load_balancing_type: Any = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none, or a list
    aux_loss_coeff: Any = 1e-2  # one float, or a list with one coefficient per balancing type
    z_loss_coeff: float | None = None
    expert_capacity_factor: float | None = None  # None: dropless
    token_drop_policy: str = "probs"  # probs | position
    pad_expert_input_to_capacity: bool = False
    ffn_hidden_size: int = 128  # per-expert FFN width
    shared_expert_intermediate_size: int | None = None  # None/0: no shared expert
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert output (Qwen2-MoE)
    layer_freq: Any = 1  # int N: every N-th layer is MoE; or a list of 0/1 per layer
    first_k_dense_replace: int = 0  # the first k layers are dense (DeepSeek)
    # DeepSeek-V4's hash routing: the first n MoE layers pick their experts from a fixed table of the token id
    # (`router.tid2eid` [vocab, top-k]); their learned router only weighs the picked experts
    num_hash_layers: int = 0
    token_dispatcher_type: str = "alltoall"  # allgather | alltoall
    grouped_gemm: bool = (
        True  # grouped GEMM where it runs (fused expert FFN kernels on CUDA); a loop of GEMMs otherwise
    )
    apply_probs_on_input: bool = False  # multiply routing probs inside the activation instead of at combine
    router_replay_mode: str = "none"  # none | record | replay: save / reuse every forward's top-k experts (RL)
    router_replay_path: str | None = None  # the file recorded to (record) or read from (replay)
    # standard | minimal | chunked: minimal keeps only the layer input, the FC1 output and the routing for
    # backward (no top-k copies of hidden-sized rows; moecore/moe/minimal.py); chunked keeps the input and the
    # routing only, computes FC1 again in backward and walks the routed rows in chunks (moecore/moe/chunked.py)
    activation_memory: str = "standard"
    activation_chunk_rows: int = 8192  # chunked: routed rows per chunk (whole experts; one bigger expert alone)
    sync_free: bool = False  # no host synchronisation from routing to combine (CUDA-graph capturable)
    # auto: the expert GEMMs through QuACK's grouped GEMMs where they run (the `quack` extra, a Hopper GPU),
    # torch / Triton per shape elsewhere; torch: never QuACK's (moecore/kernels/grouped_ffn.py, default_plan)
    gemm_backend: str = "auto"
    # minimal mode with QuACK: the SwiGLU and its backward in the expert GEMMs' epilogues (moecore/kernels/
    # quack_swiglu.py; probabilities at the combine). Off by default: slower than the standard path on an H100
    # (docs/benchmarks.md, run CD)
    swiglu_epilogue: bool = False

    BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

    @property
    def balancing_types(self) -> list[str]:
        t = self.router_load_balancing_type
        return list(t) if isinstance(t, (list, tuple)) else [t]

    @property
    def aux_loss_coeffs(self) -> list[float]:
        c = self.aux_loss_coeff
        if isinstance(c, (list, tuple)):
            return [float(x) for x in c]
        return [float(c)] * len(self.balancing_types)

    def is_moe_layer(self, layer_idx: int, num_layers: int) -> bool:
        """Whether decoder layer `layer_idx` (0-based) holds an MoE block."""
        if self.num_experts == 0 or layer_idx < self.first_k_dense_replace:
            return False
        if isinstance(self.layer_freq, (list, tuple)):
            return bool(self.layer_freq[layer_idx])
        return layer_idx % int(self.layer_freq) == 0

    def validate(self, num_layers: int | None = None) -> None:
        _check_range("moe.num_experts", self.num_experts, 0)
        _check_choice("moe.router_replay_mode", self.router_replay_mode, ("none", "record", "replay"))
        if self.router_replay_mode != "none" and self.num_experts == 0:
            _fail("moe.router_replay_mode", self.router_replay_mode, "needs moe.num_experts > 0 (a dense model)")
        if self.router_replay_mode != "none" and not self.router_replay_path:
            _fail("moe.router_replay_path", self.router_replay_path, f"set a file path with {self.router_replay_mode}")
        replay_files = (Path(str(self.router_replay_path)), Path(f"{self.router_replay_path}.rank-0"))
        if self.router_replay_mode == "replay" and not any(f.is_file() for f in replay_files):
            _fail("moe.router_replay_path", self.router_replay_path, "no such file to replay (record it first)")
        _check_choice("moe.activation_memory", self.activation_memory, ("standard", "minimal", "chunked"))
        _check_range("moe.activation_chunk_rows", self.activation_chunk_rows, 1)
        if not isinstance(self.sync_free, bool):
            _fail("moe.sync_free", self.sync_free, "true | false")
        _check_choice("moe.gemm_backend", self.gemm_backend, ("auto", "torch"))
        if not isinstance(self.swiglu_epilogue, bool):
            _fail("moe.swiglu_epilogue", self.swiglu_epilogue, "true | false")
        if self.swiglu_epilogue and (self.activation_memory != "minimal" or self.apply_probs_on_input):
            _fail("moe.swiglu_epilogue", True, "needs moe.activation_memory=minimal and apply_probs_on_input=false")
        if self.num_experts == 0:
            return
        _check_range("moe.router_topk", self.router_topk, 1, self.num_experts)
        _check_choice("moe.router_score_function", self.router_score_function, ("softmax", "sigmoid", "sqrtsoftplus"))
        _check_range("moe.num_hash_layers", self.num_hash_layers, 0)
        _check_choice("moe.router_dtype", self.router_dtype, ("fp32", "fp64"))
        _check_choice("moe.token_drop_policy", self.token_drop_policy, ("probs", "position"))
        _check_choice("moe.token_dispatcher_type", self.token_dispatcher_type, ("allgather", "alltoall"))
        _check_choice("moe.router_group_score", self.router_group_score, ("max", "top2_sum"))
        _check_range("moe.ffn_hidden_size", self.ffn_hidden_size, 1)
        _check_range("moe.router_bias_update_rate", self.router_bias_update_rate, 0.0)
        _check_range("moe.first_k_dense_replace", self.first_k_dense_replace, 0)
        if self.expert_capacity_factor is not None:
            _check_range("moe.expert_capacity_factor", self.expert_capacity_factor, 0.0)
            if self.expert_capacity_factor <= 0:
                _fail("moe.expert_capacity_factor", self.expert_capacity_factor, "must be > 0 (or null for dropless)")
        elif self.pad_expert_input_to_capacity:
            _fail("moe.pad_expert_input_to_capacity", True, "needs moe.expert_capacity_factor to be set")
        if self.input_jitter_eps is not None:
            _check_range("moe.input_jitter_eps", self.input_jitter_eps, 0.0, 1.0)
        if self.z_loss_coeff is not None:
            _check_range("moe.z_loss_coeff", self.z_loss_coeff, 0.0)
        for t in self.balancing_types:
            _check_choice("moe.router_load_balancing_type", t, self.BALANCING_TYPES)
        if len(self.aux_loss_coeffs) != len(self.balancing_types):
            _fail(
                "moe.aux_loss_coeff",
                self.aux_loss_coeff,
                f"needs one coefficient per balancing type ({len(self.balancing_types)})",
            )
        for c in self.aux_loss_coeffs:
            _check_range("moe.aux_loss_coeff", c, 0.0)
        if self.router_pre_softmax and self.router_score_function != "softmax":
            _fail("moe.router_pre_softmax", True, "only applies with moe.router_score_function=softmax")
        if self.router_score_function == "softmax" and not self.router_pre_softmax and not self.norm_topk_prob:
            _fail(
                "moe.norm_topk_prob",
                False,
                "a softmax over the top-k always sums to one; with moe.router_pre_softmax=false keep it true",
            )
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            _fail(
                "moe.router_group_topk",
                self.router_group_topk,
                "set both moe.router_num_groups and moe.router_group_topk, or neither",
            )
        if self.router_num_groups is not None:
            if self.router_num_groups < 1 or self.num_experts % self.router_num_groups:
                _fail(
                    "moe.router_num_groups", self.router_num_groups, f"must divide moe.num_experts={self.num_experts}"
                )
            _check_range("moe.router_group_topk", self.router_group_topk, 1, self.router_num_groups)
            per_group = self.num_experts // self.router_num_groups
            if self.router_group_topk * per_group < self.router_topk:
                _fail(
                    "moe.router_group_topk",
                    self.router_group_topk,
                    f"selected groups hold fewer than moe.router_topk={self.router_topk} experts",
                )
        if self.shared_expert_intermediate_size is not None:
            _check_range("moe.shared_expert_intermediate_size", self.shared_expert_intermediate_size, 0)
        if isinstance(self.layer_freq, (list, tuple)):
            if num_layers is not None and len(self.layer_freq) != num_layers:
                _fail(
                    "moe.layer_freq",
                    self.layer_freq,
                    f"a list needs one 0/1 entry per layer (model.num_layers={num_layers})",
                )
            for v in self.layer_freq:
                _check_choice("moe.layer_freq", v, (0, 1))
        else:
            if not isinstance(self.layer_freq, int) or self.layer_freq < 1:
                _fail("moe.layer_freq", self.layer_freq, "an int >= 1 or a list of 0/1 per layer")
