"""The runtime around the training loop: device, precision, parallel state, reductions, progress.

`Runtime` is what lets one loop serve one CPU process and many GPUs: every reduction over the
data-parallel ranks, the gradient synchronisation and the global-norm clipping go through it, and
each is a no-op (or a local computation) when the run has one process. The parallel work itself
(process groups, bucketed gradient reduction, norms over sharded parameters) lives in
`moecore.parallel`; this file only calls it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moecore.config import Config
from moecore.parallel.dims import ParallelDims, destroy_distributed, init_distributed


@dataclass
class Runtime:
    """Device, autocast dtype and parallel state of this process."""

    dims: ParallelDims
    device: torch.device
    autocast_dtype: torch.dtype | None
    grad_reducer: object | None = None  # moecore.parallel.data_parallel.GradReducer when world > 1
    scaler: torch.amp.GradScaler | None = None  # dynamic loss scaling for fp16
    precision: str = "fp32"  # resolved train.precision: fp32 | bf16 | fp16
    master_weights: bool = True  # bf16: keep fp32 master weights (optim.master_weights=fp32)
    mixed: object | None = None  # moecore.optim.mixed_precision.MixedPrecision with precision bf16 / fp8
    qk_clip: object | None = None  # moecore.models.qk_clip.QKClip with optim.muon_qk_clip > 0
    fp8: object | None = None  # moecore.config.FP8Config with precision fp8 (bf16 + FP8 GEMMs)

    # ------------------------------------------------------------------ identity
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def grad_replicas(self) -> int:
        """Ranks the dense gradients are averaged over: data x context parallel (dp * cp)."""
        return self.dims.dp * self.dims.cp

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_group.rank

    @property
    def is_main(self) -> bool:
        return self.dims.is_main

    # ------------------------------------------------------------------ model and gradients
    def wrap_model(
        self, model: torch.nn.Module, micro_batches: int = 1, fsdp_roots: list[torch.nn.Module] | None = None
    ) -> torch.nn.Module:
        """Precision (bf16 parameters, fp32 masters and gradient sums) and the data-parallel gradient hooks.

        `micro_batches`: per rank and step; with more than one (or several ranks) gradients are summed,
        in fp32 main gradients. The precision hooks go first: the data-parallel ones read what they sum.
        `fsdp_roots`: with parallel.fsdp, the modules sharded as FSDP roots instead of the model (pipeline
        parallel: this rank's stage modules).
        """
        if self.precision == "fp8":  # FP8 GEMMs in the modules of fp8.modules, bf16 everywhere else
            from moecore.kernels.fp8_gemm import Fp8Recipe
            from moecore.models.fp8 import apply_fp8

            apply_fp8(model, Fp8Recipe.from_config(self.fp8), self.fp8.modules)
        if self.dims.cfg.fsdp:  # FSDP2 (over a one-rank mesh on one process): sharded weights, its own bf16 policy
            from moecore.parallel.fsdp import FullyShardedModel

            bf16 = self.precision in ("bf16", "fp8")
            if bf16 and not self.master_weights:  # optim.master_weights=bf16: the shards are the bf16 weights
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            param_dtype = torch.bfloat16 if bf16 and self.master_weights else None
            primary = self.precision == "fp8" and self.fp8.primary_weights  # FP8 weights gathered as FP8 bytes
            self.grad_reducer = FullyShardedModel(
                model,
                self.dims,
                param_dtype,
                reduce_dtype=torch.float32 if bf16 else None,
                fp8_gather=primary,
                roots=fsdp_roots,
            )
            return model
        if self.precision in ("bf16", "fp8"):
            from moecore.optim.mixed_precision import MixedPrecision

            sum_in_fp32 = micro_batches > 1 or self.world_size > 1
            self.mixed = MixedPrecision(model, torch.bfloat16, self.master_weights, sum_in_fp32=sum_in_fp32)
            if self.precision == "fp8" and self.fp8.primary_weights:  # FP8 weights between steps
                from moecore.models.fp8 import enable_primary_weights

                enable_primary_weights(model, self.mixed)
        if self.world_size > 1:
            from moecore.parallel.data_parallel import GradReducer

            self.grad_reducer = GradReducer(model, self.dims)
        return model

    def grad_sync_context(self, model: torch.nn.Module, last: bool):
        """Defer gradient reduction on all micro-batches but the last of a step."""
        if self.grad_reducer is None or last:
            return contextlib.nullcontext()
        return self.grad_reducer.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def finish_grad_sync(self, model: torch.nn.Module) -> None:
        if self.grad_reducer is not None:
            self.grad_reducer.finish()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Global gradient norm (every parameter counted once across all groups), clipped to max_norm.

        The optimizer's fused update applies the clipping coefficient where it can (`grad_scale`);
        otherwise the gradients are scaled in place.
        """
        if self.scaler is not None:
            self.unscale_gradients()
        norm = self._clipped_norm(model, max_norm)
        self.agree_on_overflow(norm)
        return norm

    def unscale_gradients(self) -> None:
        """fp16: divide this step's gradients by the loss scale (the distributed optimizer's are its shards)."""
        expose = getattr(self._optimizer, "expose_shard_grads", None)
        if expose is not None:
            expose()
        self.scaler.unscale_(self._optimizer)

    def agree_on_overflow(self, grad_norm: float | torch.Tensor) -> None:
        """fp16: make the loss scaler's overflow finding the same on every rank, from the global gradient norm.

        `unscale_` finds infinities in this rank's gradients only. Gradients that are not reduced over every
        rank (an expert's under expert parallel, a tensor-parallel shard, a pipeline stage's) can overflow on
        one rank alone; that rank would skip the step and lower its scale while the others step, and the copies
        of every replicated weight would part. The norm is global, so it is non-finite on every rank or none."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        state = self.scaler._per_optimizer_states[id(self._optimizer)]  # torch.amp.GradScaler's per-step record
        bad = torch.as_tensor(grad_norm, dtype=torch.float32).isfinite().logical_not()
        for found_inf in state["found_inf_per_device"].values():
            found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.device, found_inf.dtype)))

    def _clipped_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        from moecore.optim.mixed_precision import grad_of

        for owner in (getattr(self, "_optimizer", None), self.grad_reducer):
            if hasattr(owner, "clip_grad_norm"):  # sharded gradients: the norm of their owner
                return float(owner.clip_grad_norm(max_norm))
        params = [p for p in model.parameters() if grad_of(p) is not None]
        grads = [grad_of(p) for p in params]
        from moecore.parallel.data_parallel import apply_clip, global_grad_norm

        if self.world_size > 1 or all(g.dtype == torch.float32 for g in grads):
            # One algorithm for every layout (per-tensor fp32 norms, squares summed in fp64), so that a
            # one-process run and a parallel run of the same gradients report the same norm.
            norm = global_grad_norm(params, self.dims if self.world_size > 1 else None)
        else:  # bf16 gradients on one process: one foreach norm, squares summed in fp32
            norm = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).norm()
        apply_clip(grads, norm, max_norm, getattr(self, "_optimizer", None))
        return float(norm)

    def build_optimizer(self, model: torch.nn.Module, cfg: Config):
        """The optimizer of `optim`, on this run's precision and layout.

        bf16 with AdamW: `FusedAdamW` (master, moments and bf16 weight in one pass). Otherwise the
        optimizer of `optim.name` (sharded by the distributed optimizer when asked for), driven on the
        fp32 master weights when there are any.
        """
        from moecore.optim.adamw import build_optimizer as build_named
        from moecore.parallel.distributed_muon import distributed_muon

        def build_optimizer(model, ocfg):  # Muon's matrices orthogonalised once each over the ranks
            return build_named(model, ocfg, distributed_muon(self.dims, ocfg.muon_ns_steps))

        if self.mixed is not None and cfg.optim.name == "adamw" and not self._sharded_optimizer(cfg):
            from moecore.optim.adamw import param_groups
            from moecore.optim.fused_adamw import FusedAdamW

            o = cfg.optim
            state_dtype = torch.bfloat16 if o.state_dtype == "bf16" else torch.float32
            opt = FusedAdamW(
                param_groups(model, o.weight_decay), self.mixed, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                weight_decay=o.weight_decay, state_dtype=state_dtype,
            )  # fmt: skip
        elif self._fsdp_fused(cfg):  # FSDP shards (fp32 masters or bf16 weights), updated in fp32 arithmetic
            from moecore.optim.adamw import param_groups
            from moecore.optim.fused_adamw import FusedAdamW

            o = cfg.optim
            state_dtype = torch.bfloat16 if o.state_dtype == "bf16" else torch.float32
            opt = FusedAdamW(
                param_groups(model, o.weight_decay), None, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                weight_decay=o.weight_decay, state_dtype=state_dtype,
            )  # fmt: skip
        elif self._sharded_optimizer(cfg):  # keeps its own fp32 master shards
            opt = self.wrap_optimizer(model, build_optimizer(model, cfg.optim), cfg)
        else:
            opt = build_optimizer(model, cfg.optim)
            if self.mixed is not None:
                from moecore.optim.mixed_precision import MasterWeightOptimizer

                opt = MasterWeightOptimizer(opt, self.mixed)
        self.attach_optimizer(opt)
        if cfg.optim.muon_qk_clip > 0:  # MuonClip: rescale q/k of heads whose max logit passed tau, after each step
            from moecore.models.qk_clip import QKClip

            self.qk_clip = QKClip(model, cfg.optim.muon_qk_clip, self.dims)
        return opt

    def _fsdp_fused(self, cfg: Config) -> bool:
        # Under FSDP with bf16 compute (fp32 master shards or bf16 shards) or bf16 moments, the fused update on the
        # local shards: one pass per parameter instead of torch's AdamW over DTensors (57.4 vs 43.2 ms per step on
        # the H200 Qwen3 proxy, docs/benchmarks.md). fp32 runs keep torch's AdamW, as one process does.
        fsdp = cfg.parallel.fsdp and cfg.optim.name == "adamw"
        return fsdp and (cfg.optim.state_dtype == "bf16" or self.precision in ("bf16", "fp8"))

    def _sharded_optimizer(self, cfg: Config) -> bool:
        return cfg.parallel.distributed_optimizer and self.world_size > 1

    def wrap_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config):
        """The distributed optimizer (AdamW state sharded over data parallel) when asked for and world > 1."""
        if not self._sharded_optimizer(cfg):
            return optimizer
        from moecore.parallel.distributed_optimizer import DistributedOptimizer

        state_dtype = torch.bfloat16 if cfg.optim.state_dtype == "bf16" else torch.float32
        return DistributedOptimizer(
            model, optimizer, self.dims, grad_sync=self.grad_reducer, mixed=self.mixed, state_dtype=state_dtype
        )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def master_weights_in_model(self):
        """Parameters hold their fp32 master weights inside the block (for checkpoint save and load)."""
        optimizer = getattr(self, "_optimizer", None)
        if hasattr(optimizer, "master_weights_in_model"):
            return optimizer.master_weights_in_model()
        if self.mixed is None:
            return contextlib.nullcontext()
        return self.mixed.fp32_view()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            # Skips the step when the gradients overflowed, and adapts the scale.
            self.scaler.step(optimizer)
            self.scaler.update()
        if self.qk_clip is not None:
            self.qk_clip.apply(self.master_weights_in_model)

    # ------------------------------------------------------------------ reductions
    def sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the data-parallel (and context-parallel) ranks."""
        g = self.dims.dp_cp_group
        if g.pg is None:
            return t
        t = t.clone()
        dist.all_reduce(t, group=g.pg)
        return t

    def mean_over_dp(self, value: float) -> float:
        if self.dims.dp_cp_group.pg is None:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        return (self.sum_over_dp(t) / self.dims.dp_cp_group.size).item()

    def reduce_expert_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Tokens per expert of this rank's micro-batches -> of the whole global batch."""
        return self.sum_over_dp(counts.to(self.device))

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        destroy_distributed()

    # ------------------------------------------------------------------ reporting
    def perf_metrics(self, tokens_per_s: float, flops_per_token: float, cfg: Config) -> dict:
        """Achieved TFLOP/s per device, MFU against log.peak_tflops (or the device's datasheet peak), memory."""
        from moecore.train.logger import gpu_memory_stats, mfu, peak_tflops

        out = gpu_memory_stats(self.device) if self.device.type == "cuda" else {}
        out["tflops_per_device"] = tokens_per_s * flops_per_token / self.world_size / 1e12
        peak = cfg.log.peak_tflops or (peak_tflops() if self.device.type == "cuda" else None)
        value = mfu(tokens_per_s, flops_per_token, peak, self.world_size)
        if value is not None:
            out["mfu"] = value
        return out

    def progress(self, console, total: int, start: int, enabled: bool):
        from moecore.train.progress import TrainProgress

        return TrainProgress(console, total=total, start=start, enabled=enabled and self.is_main)


def _pick_device(cfg: Config, dims: ParallelDims) -> torch.device:
    if cfg.train.device == "cpu":
        return torch.device("cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        from moecore.config import ConfigError

        raise ConfigError("train.device='cuda' is invalid: no CUDA device is available; allowed here: auto | cpu")
    return dims.device


def setup_runtime(cfg: Config) -> Runtime:
    """Initialise torch.distributed when launched by torchrun, build ParallelDims, choose precision."""
    dims = init_distributed(
        cfg.parallel,
        seed=cfg.train.seed,
        device=cfg.train.device,
        num_experts=cfg.moe.num_experts,
        num_attention_heads=cfg.model.num_attention_heads,
        vocab_size=cfg.model.vocab_size or None,
    )
    device = _pick_device(cfg, dims)
    if cfg.train.cpu_threads is not None:
        torch.set_num_threads(cfg.train.cpu_threads)
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp8":
        check_fp8_runtime(cfg, device, dims.world_size)
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[precision]
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    master = cfg.optim.master_weights == "fp32"
    return Runtime(
        dims=dims, device=device, autocast_dtype=autocast, scaler=scaler, precision=precision, master_weights=master,
        fp8=cfg.fp8 if precision == "fp8" else None,
    )  # fmt: skip


def check_fp8_runtime(cfg: Config, device: torch.device, world_size: int = 1) -> None:
    """Refuse train.precision=fp8 where it cannot run (one line, ConfigError): no FP8-capable GPU (unless
    fp8.emulate), or a combination not implemented yet."""
    from moecore.config import ConfigError
    from moecore.kernels._triton import triton_importable
    from moecore.kernels.fp8_gemm import fp8_unsupported_reason

    f = cfg.fp8
    if not f.emulate:
        reason = fp8_unsupported_reason(device, f.recipe)
        if reason is not None:
            raise ConfigError(f"train.precision='fp8' cannot run here: {reason} (fp8.emulate=true emulates it)")
        # Measured on an H200 (torch 2.11, docs/benchmarks.md "FP8"): cuBLAS rejects e5m2 operands with row- and
        # block-wise scales (the hybrid format's gradient GEMMs then run in moecore's Triton kernels), and
        # tensorwise training went non-finite after 187 of 300 steps of the accuracy run.
        if f.format == "hybrid" and not triton_importable():
            raise ConfigError(
                "fp8.format='hybrid' needs the triton package on GPUs (torch's scaled GEMMs reject e5m2 gradients "
                "with row/block scales; moecore's Triton GEMMs take them); install triton or use e4m3"
            )
        if f.recipe == "tensorwise":
            raise ConfigError(
                "fp8.recipe='tensorwise' is not supported on GPUs yet (its training went non-finite in the H200 "
                "accuracy run); use rowwise or blockwise"
            )
    if f.primary_weights and cfg.parallel.fsdp and f.recipe == "rowwise":
        raise ConfigError(
            "fp8.primary_weights=true with parallel.fsdp=true needs fp8.recipe=blockwise or tensorwise (FSDP gathers "
            "their one FP8 copy; rowwise weights keep two layouts, gathered in bf16 either way): use false for rowwise"
        )
