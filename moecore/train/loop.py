"""The training loop: one code path from one CPU process to many GPUs.

One optimizer step:
  1. fetch this data-parallel rank's micro-batches of the global batch;
  2. count the loss tokens of the whole global batch (all ranks), so that the LM loss is the mean
     over every token of the global batch whatever the layout or accumulation;
  3. forward + backward each micro-batch: LM loss sum / global tokens + routing losses /
     micro-batches (Megatron's per-micro-batch aux loss) + MTP loss / micro-batches;
  4. finish the data-parallel gradient reduction, clip by the global norm, step, set the LR;
  5. update the aux-loss-free expert biases from the token counts of the step;
  6. log, validate, checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moecore.checkpoint import latest_checkpoint, load_model_weights, load_training_state
from moecore.checkpoint.saver import CheckpointSaver
from moecore.config import Config, ConfigError
from moecore.models.transformer import MoETransformer
from moecore.optim.schedule import lr_at
from moecore.parallel.context import split_batch_for_cp
from moecore.parallel.layout import validate_layout
from moecore.train.guards import StepGuard
from moecore.train.memory import memory_metrics
from moecore.train.moe_metrics import moe_metrics
from moecore.train.resume import resolve_resume
from moecore.train.runtime import Runtime, setup_runtime
from moecore.train.signals import StopRequest
from moecore.train.summary import run_summary


@dataclass
class TrainResult:
    """What `train` returns: per-step losses and where things were written."""

    run_dir: Path
    losses: list = field(default_factory=list)  # (step, loss)
    val_losses: list = field(default_factory=list)  # (step, val_loss)
    last_step: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    seconds: float = 0.0
    stopped_by: str | None = None  # the stop signal (SIGTERM, ...) that ended the run early, after a checkpoint
    checkpoint: Path | None = None  # the newest checkpoint this run saved
    stages: list = field(default_factory=list)  # pipeline parallel: per stage rank, its layers, parameters, peak memory
    memory: dict = field(default_factory=dict)  # memory/{params,grads,optim}_gb of this rank at the last log


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.train.run_dir:
        return Path(cfg.train.run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.recipe}-{stamp}"


def check_resume(cfg: Config) -> Path | None:
    """The checkpoint to resume from, or a ConfigError if checkpoint.resume cannot be honoured."""
    if not cfg.checkpoint.resume:
        return None
    if not cfg.train.run_dir:
        raise ConfigError("checkpoint.resume=True is invalid: set train.run_dir to the run folder to resume")
    run_dir = Path(cfg.train.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"train.run_dir={cfg.train.run_dir!r} is invalid: folder does not exist, nothing to resume")
    return latest_checkpoint(run_dir)


def preflight(cfg: Config) -> None:
    """Every check that can refuse the run before any work: config, layout for the launch, resume folder."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_layout(cfg, world_size)
    check_resume(cfg)
    if cfg.train.precision == "fp8":  # no FP8-capable GPU: refuse before the run prints anything
        from moecore.train.runtime import check_fp8_runtime

        use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
        check_fp8_runtime(cfg, device, world_size)


def autocast_context(rt: Runtime):
    if rt.autocast_dtype is None:
        return torch.autocast(device_type=rt.device.type, enabled=False)
    return torch.autocast(device_type=rt.device.type, dtype=rt.autocast_dtype)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Trainer:
    """Holds the model, optimizer, data and runtime of one run; `run()` trains it."""

    def __init__(self, cfg: Config, console=None) -> None:
        from moecore.data import build_data

        self.cfg = cfg
        check_resume(cfg)
        self.rt = setup_runtime(cfg)
        if cfg.train.cuda_graphs != "none" and self.rt.device.type != "cuda":
            raise ConfigError(f"train.cuda_graphs={cfg.train.cuda_graphs!r} is invalid: needs a CUDA device; use none")
        self.resume_from = resolve_resume(cfg)  # the newest intact checkpoint (verified on every rank)
        self.console = console
        self.data = build_data(cfg, dp_rank=self.rt.dp_rank, dp_size=self.rt.dp_size)
        if cfg.model.vocab_size <= 0:
            cfg.model.vocab_size = self.data.vocab_size
        validate_layout(cfg, self.rt.world_size)
        if self.rt.device.type == "cuda" and cfg.train.preflight_memory != "off":
            from moecore.plan.preflight import check_memory

            total = torch.cuda.get_device_properties(self.rt.device).total_memory
            warning = check_memory(cfg, self.rt.world_size, total)
            if warning and self.rt.is_main:
                print(f"moecore: warning: {warning}", flush=True)
        self.run_dir = resolve_run_dir(cfg)
        torch.manual_seed(cfg.train.seed)
        self.pipeline = None
        if cfg.parallel.pp > 1:  # this rank's pipeline stages only (moecore/parallel/pipeline.py)
            from moecore.parallel.pipeline import parallelize_pipeline

            # bf16 / fp8 runs pass bf16 hidden states between stages (under FSDP2 too, whose fp32 masters compute in bf16)
            hidden = torch.bfloat16 if self.rt.precision in ("bf16", "fp8") else None
            self.pipeline = parallelize_pipeline(cfg, self.rt.dims, self.rt.device, hidden)
            self.model = self.pipeline.model
        else:
            with torch.device(self.rt.device):
                self.model = MoETransformer(cfg, self.rt.dims)
        self.step = 0
        t = cfg.train
        self.micro_batches_per_rank = t.global_batch_size // (t.micro_batch_size * self.rt.dp_size)
        # Starting weights load into the fp32 model, before bf16 training turns them into masters.
        if self.resume_from is None and cfg.checkpoint.load and not cfg.checkpoint.resume:
            load_model_weights(Path(cfg.checkpoint.load), self.model)
        elif self.resume_from is None and cfg.checkpoint.upcycle_from:  # a resumed run has its MoE weights
            from moecore.moe.upcycle import upcycle_from_checkpoint

            upcycle_from_checkpoint(self.model, cfg.checkpoint.upcycle_from, cfg)
        roots = self.pipeline.stage_modules if self.pipeline is not None else None
        self.model = self.rt.wrap_model(self.model, self.micro_batches_per_rank, fsdp_roots=roots)
        self.optimizer = self.rt.build_optimizer(self.model, cfg)
        if self.resume_from is not None:
            with self.rt.master_weights_in_model():
                extra = load_training_state(self.resume_from, self.model, self.optimizer, verify_files=False)
            self.step = extra["step"]
            self.data.train.load_state_dict(extra["data"])
        if cfg.train.cuda_graphs != "none":  # captured on each layer's first training forward
            from moecore.models.cuda_graphs import apply_cuda_graphs

            apply_cuda_graphs(self.model, cfg.train.cuda_graphs)
        from moecore.moe.router_replay import setup_router_replay

        self.router_replay = setup_router_replay(
            self.model, cfg.moe, self.rt.dims.rank, self.rt.world_size, require_router=self.pipeline is None
        )
        async_save = cfg.checkpoint.async_save
        self.saver = CheckpointSaver(self.rt.device.type == "cuda" if async_save is None else async_save)
        self.stop = StopRequest(cfg.train.stop_signals)
        self.guard = StepGuard(cfg.train, self.rt.device, self.run_dir, self.stop, self.saver, self.rt.scaler)

    # ------------------------------------------------------------------ one step
    def train_step(self, with_moe_metrics: bool = True) -> dict:
        """One optimizer step. `with_moe_metrics`: aggregate the per-layer MoE statistics (host syncs;
        the loop asks for them only on steps it logs)."""
        if self.pipeline is not None:
            return self._pipeline_step(with_moe_metrics)
        cfg, rt = self.cfg, self.rt
        model = self.model
        model.train()
        batches = [_to(self.data.train.next_micro_batch(), rt.device) for _ in range(self.micro_batches_per_rank)]
        # context parallel: this rank's chunks of every sequence, with their global positions
        batches = [split_batch_for_cp(b, rt.dims) for b in batches]
        local_tokens = sum(b["loss_mask"].sum() for b in batches)
        global_tokens = rt.sum_over_dp(local_tokens.detach().double()).clamp(min=1)
        n_mb_global = self.micro_batches_per_rank * rt.dp_size
        lm_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        mtp_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        mtp_depth_sums: list[float] = []
        indexer_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        stats_per_mb = []
        self.optimizer.zero_grad(set_to_none=True)
        for i, b in enumerate(batches):
            # Only the last micro-batch's backward reduces gradients over the data-parallel ranks.
            with rt.grad_sync_context(model, last=i == len(batches) - 1):
                with autocast_context(rt):
                    out = model(
                        b["input_ids"], labels=b["labels"], loss_mask=b["loss_mask"], position_ids=b.get("position_ids")
                    )
                    # Gradient reduction averages over the dp x cp ranks, hence the factor replicas = dp * cp:
                    # sum over ranks of (replicas * grad_r / replicas) == gradient of the global-batch objective
                    # (under CP each rank's terms are its share of its sequences': moecore/parallel/context.py).
                    replicas = rt.grad_replicas
                    objective = out.lm_loss_sum / global_tokens.to(out.lm_loss_sum.dtype) * replicas
                    if out.aux_loss is not None:
                        objective = objective + out.aux_loss * (replicas / n_mb_global)
                    if out.mtp_loss is not None:
                        objective = objective + out.mtp_loss * (replicas / n_mb_global)
                    if out.indexer_loss is not None:  # DSA lightning indexer (moecore/models/dsa.py)
                        objective = objective + out.indexer_loss * (replicas / n_mb_global)
                        indexer_sum += out.indexer_loss.detach().double()
                rt.backward(objective)
            lm_sum += out.lm_loss_sum.detach().double()
            if out.mtp_loss is not None:
                mtp_sum += out.mtp_loss.detach().double()
                for d, v in enumerate(out.mtp_losses):
                    if d == len(mtp_depth_sums):
                        mtp_depth_sums.append(0.0)
                    mtp_depth_sums[d] += float(v)
            stats_per_mb.append(out.moe_stats)
        rt.finish_grad_sync(model)
        grad_norm = rt.clip_grad_norm(model, cfg.optim.clip_grad)
        if self.guard.check(self.step + 1, lm_sum, grad_norm):  # non-finite, on_nonfinite=skip (train/guards.py)
            return self.guard.skip_step(self, lm_sum, global_tokens, grad_norm)
        lr = lr_at(self.step + 1, cfg.train.steps, cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rt.optimizer_step(self.optimizer)
        for moe_layer in model.moe_layers():
            moe_layer.update_expert_bias()
        self.step += 1
        loss = (rt.sum_over_dp(lm_sum) / global_tokens).item()
        metrics = {"loss": loss, "lr": lr, "grad_norm": float(grad_norm), "tokens": int(global_tokens.item())}
        if rt.qk_clip is not None:  # optim.muon_qk_clip: the step's largest attention logit (before clipping)
            metrics["attn/max_logit"] = rt.qk_clip.last_max_logit
        if self.model.mtp is not None:
            metrics["mtp_loss"] = rt.sum_over_dp(mtp_sum).item() / n_mb_global
            for d, v in enumerate(mtp_depth_sums):  # unscaled loss of each prediction depth
                metrics[f"mtp/depth_{d + 1}_loss"] = rt.mean_over_dp(v / self.micro_batches_per_rank)
        if cfg.model.attention_type == "dsa":
            metrics["indexer_loss"] = rt.sum_over_dp(indexer_sum).item() / n_mb_global
        if with_moe_metrics:
            metrics.update(moe_metrics(stats_per_mb, rt))
        return metrics

    def _pipeline_step(self, with_moe_metrics: bool) -> dict:
        """`train_step` under pipeline parallel: the schedule runs forward + backward of every micro-batch
        (same objective as above, `moecore.parallel.pipeline`); metrics of every stage are gathered."""
        from moecore.parallel.pipeline import clip_grad_norm_pipeline
        from moecore.train.pipeline_metrics import pipeline_metrics

        cfg, rt, pipe, model = self.cfg, self.rt, self.pipeline, self.model
        model.train()
        self._pipeline_weights_ready()
        batches = [_to(self.data.train.next_micro_batch(), rt.device) for _ in range(self.micro_batches_per_rank)]
        # context parallel: this rank's chunks of every sequence, with their global positions (the same for all)
        batches = [split_batch_for_cp(b, rt.dims) for b in batches]
        ids, labels, mask = (torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels", "loss_mask"))
        global_tokens = rt.sum_over_dp(mask.sum().detach().double()).clamp(min=1)
        n_mb_global = self.micro_batches_per_rank * rt.dp_size
        replicas = rt.grad_replicas  # dp x cp, as in train_step
        self.optimizer.zero_grad(set_to_none=True)
        # fp16: the schedule's losses carry the loss scale (the scaler cannot reach inside torch's schedule); scaling
        # a one is the scaler's public way to start its step and hand out the scale, as a tensor (no host sync)
        loss_scale = 1.0 if rt.scaler is None else rt.scaler.scale(torch.ones((), device=rt.device))
        with rt.grad_sync_context(model, last=False), autocast_context(rt):
            record = pipe.step(
                ids, labels, mask, global_tokens, replicas * loss_scale, replicas / n_mb_global * loss_scale,
                self.micro_batches_per_rank, batches[0].get("position_ids"),
            )  # fmt: skip
        # Copies of the embedding / head on several stages stay equal: their gradients are summed over the stages
        # first, then reduced over data parallel (the distributed optimizer reduces them straight into its shards).
        pipe.sync_shared_grads()
        rt.finish_grad_sync(model)
        if rt.scaler is not None:
            rt.unscale_gradients()
        grad_norm = clip_grad_norm_pipeline(pipe, cfg.optim.clip_grad, self.optimizer, rt.grad_reducer)
        rt.agree_on_overflow(grad_norm)  # fp16: every stage skips an overflowing step, or none
        # Non-finite check and stop-signal agreement (train/guards.py). The loss lives on the last stage
        # only; the global gradient norm, which every stage shares, carries a non-finite loss.
        skip = self.guard.check(self.step + 1, torch.zeros((), device=rt.device), grad_norm)
        lr = lr_at(self.step + 1, cfg.train.steps, cfg.optim)
        if skip and rt.scaler is not None:
            rt.scaler.update()  # close the scaler's step, as train/guards.py skip_step does
        if not skip:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            rt.optimizer_step(self.optimizer)
        for moe_layer in model.moe_layers():
            moe_layer.update_expert_bias()
        self.step += 1
        metrics = {"lr": lr, "grad_norm": float(grad_norm), "tokens": int(global_tokens.item())}
        if skip:
            metrics["skipped"] = 1
        metrics.update(pipeline_metrics(pipe, record, rt, global_tokens, self.micro_batches_per_rank, with_moe_metrics))
        return metrics

    @torch.no_grad()
    def _pipeline_weights_ready(self) -> None:
        """Finish the distributed optimizer's all-gathers of the weights outside the decoder layers. Without
        pipeline parallel the model's forward pre-hook does it; the pipeline's stage modules call the embedding,
        the final norm and the head directly, past that hook (each decoder layer still waits for its own)."""
        wait = getattr(self.optimizer, "wait_for_params_outside_layers", None)
        if wait is not None:
            wait()

    def evaluate(self) -> float:
        rt = self.rt
        self.model.eval()
        if self.pipeline is not None:
            self._pipeline_weights_ready()
        total = torch.zeros((), dtype=torch.float64, device=rt.device)
        tokens = torch.zeros((), dtype=torch.float64, device=rt.device)
        for b in self.data.valid_batches():
            b = split_batch_for_cp(_to(b, rt.device), rt.dims)
            with autocast_context(rt):
                if self.pipeline is not None:  # sums land on the loss stage; summed over the pipeline below
                    lm_sum, n = self.pipeline.evaluate_batch(
                        b["input_ids"], b["labels"], b["loss_mask"], b.get("position_ids")
                    )
                    total, tokens = total + lm_sum, tokens + n
                    continue
                out = self.model(
                    b["input_ids"], labels=b["labels"], loss_mask=b["loss_mask"], position_ids=b.get("position_ids")
                )
            total += out.lm_loss_sum.double()
            tokens += out.num_tokens.double()
        self.model.train()
        if self.pipeline is not None:
            total, tokens = self.pipeline.sum_over_stages(total), self.pipeline.sum_over_stages(tokens)
        return (rt.sum_over_dp(total) / rt.sum_over_dp(tokens).clamp(min=1)).item()

    def save(self) -> Path:
        path = self.run_dir / "checkpoints" / f"step-{self.step}"
        extra = {"step": self.step, "data": self.data.train.state_dict()}
        with self.rt.master_weights_in_model():  # files hold the fp32 masters: precision-free checkpoints
            return self.saver.save(
                path, self.model, self.optimizer, extra, self.cfg.to_yaml(), keep_last=self.cfg.checkpoint.keep_last
            )

    # ------------------------------------------------------------------ the run
    def run(self) -> TrainResult:
        """Train to `train.steps` (or `train.exit_interval`, or a stop signal); checkpoints are durable on return."""
        try:
            with self.stop:
                result = self._run()
        except BaseException:
            with contextlib.suppress(Exception):  # the save in flight completes; the first error is the one shown
                self.saver.wait()
            raise
        self.saver.wait()
        return result

    def _run(self) -> TrainResult:
        from moecore.train.logger import RunLogger
        from moecore.train.logger import flops_per_token as flops_per_token_of
        from moecore.train.profiling import Profiler, enable_oom_snapshot

        cfg, rt = self.cfg, self.rt
        if rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        rt.barrier()
        if rt.is_main and self.console is not None:
            for line in run_summary(cfg, self.model, rt, self.run_dir, self.step):
                self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        resumed = self.resume_from is not None
        logger = RunLogger(self.run_dir, cfg.log, rt.is_main, cfg.to_dict(), resume_step=self.step if resumed else None)
        if cfg.log.oom_snapshot and rt.device.type == "cuda":
            enable_oom_snapshot(self.run_dir, rank=rt.dims.rank)
        result = TrainResult(run_dir=self.run_dir)
        stop = cfg.train.exit_interval or cfg.train.steps
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_length
        flops_per_token = flops_per_token_of(cfg)
        progress = rt.progress(self.console, total=stop, start=self.step, enabled=cfg.log.progress)
        start_time = time.perf_counter()
        window_t, window_steps = time.perf_counter(), 0
        profiler = None
        if cfg.train.profile_steps:
            profiler = Profiler(cfg.train.profile_steps, self.run_dir / "profile", rank=rt.dims.rank)
        with progress:
            while self.step < stop:
                if profiler is not None:
                    profiler.step_begin(self.step + 1)
                next_step = self.step + 1
                log_now = next_step % cfg.log.interval == 0 or next_step == stop or next_step == 1
                evaluate_now = bool(cfg.train.eval_interval) and (
                    next_step % cfg.train.eval_interval == 0 or next_step == stop
                )
                metrics = self.train_step(with_moe_metrics=log_now or evaluate_now)
                self.saver.note_step()
                if cfg.train.on_nonfinite == "skip":
                    metrics["skipped_steps"] = self.guard.skipped_total
                if profiler is not None:
                    profiler.step_end(self.step)
                window_steps += 1
                result.losses.append((self.step, metrics["loss"]))
                if result.first_loss is None:
                    result.first_loss = metrics["loss"]
                # per rank, by kind; measured before evaluation (FSDP2's forward drops the root module's gradients)
                memory = memory_metrics(self.model, self.optimizer, rt.mixed) if log_now or evaluate_now else None
                if evaluate_now:
                    val = self.evaluate()
                    metrics["val_loss"] = val
                    result.val_losses.append((self.step, val))
                    log_now = True
                if log_now:
                    rt.sync()
                    elapsed = time.perf_counter() - window_t
                    tps = tokens_per_step * window_steps / max(elapsed, 1e-9)
                    metrics["tokens_per_s"] = tps
                    metrics["step_time_s"] = elapsed / max(window_steps, 1)
                    metrics.update(rt.perf_metrics(tps, flops_per_token, cfg))
                    result.memory = memory
                    metrics.update(result.memory)
                    logger.log(self.step, metrics)
                    window_t, window_steps = time.perf_counter(), 0
                progress.update(self.step, metrics)
                interval = cfg.checkpoint.interval
                if (interval and self.step % interval == 0) or self.step == stop or self.guard.stop_now:
                    result.checkpoint = self.save()
                if self.guard.stop_now:  # a stop signal: every rank agreed on it during this step
                    result.stopped_by = self.stop.signal_name or "a stop signal (on another rank)"
                    break
        logger.close()
        if self.router_replay is not None and self.router_replay.mode == "record":
            from moecore.moe.router_replay import rank_path

            self.router_replay.save(rank_path(cfg.moe.router_replay_path, rt.dims.rank, rt.world_size))
        result.last_step = self.step
        result.final_loss = result.losses[-1][1] if result.losses else None
        result.seconds = time.perf_counter() - start_time
        if self.pipeline is not None:
            result.stages = self.pipeline.summary(self.run_dir if rt.is_main else None)
        return result


def train(cfg: Config, console=None) -> TrainResult:
    """Train as the config says; the Python entry point behind `moecore train`."""
    trainer = Trainer(cfg, console)
    try:
        return trainer.run()
    finally:
        if cfg.log.oom_snapshot and trainer.rt.device.type == "cuda":  # a later run in this process writes its own
            from moecore.train.profiling import disable_oom_snapshot

            disable_oom_snapshot()
        trainer.rt.shutdown()
