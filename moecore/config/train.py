"""The sections of the training run itself: `optim`, `data`, `train`, `checkpoint` and `log`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moecore.config.errors import _check_choice, _check_range, _fail


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"  # adamw | muon
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0: no clipping
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | wsd | constant | linear
    wsd_decay_fraction: float = 0.2  # WSD: fraction of steps spent decaying at the end
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    # MuonClip's QK-Clip (Kimi K2): after each step, rescale the q/k weights of every attention head whose
    # largest pre-softmax logit in the step exceeded this threshold tau (Kimi K2: 100). 0: off.
    muon_qk_clip: float = 0.0
    # With train.precision=bf16 the model's parameters are bf16 (the compute weights); these two
    # choose what the optimizer keeps (bytes per parameter in docs/train.md "Precision").
    master_weights: str = "fp32"  # fp32: an fp32 master copy is updated and cast to bf16 | bf16: update bf16 in place
    state_dtype: str = "fp32"  # fp32 | bf16: dtype of the AdamW moments (exp_avg, exp_avg_sq)

    def validate(self) -> None:
        _check_choice("optim.name", self.name, ("adamw", "muon"))
        _check_choice("optim.master_weights", self.master_weights, ("fp32", "bf16"))
        _check_choice("optim.state_dtype", self.state_dtype, ("fp32", "bf16"))
        _check_choice("optim.schedule", self.schedule, ("cosine", "wsd", "constant", "linear"))
        _check_range("optim.lr", self.lr, 0.0)
        _check_range("optim.min_lr", self.min_lr, 0.0)
        _check_range("optim.weight_decay", self.weight_decay, 0.0)
        _check_range("optim.beta1", self.beta1, 0.0, 1.0)
        _check_range("optim.beta2", self.beta2, 0.0, 1.0)
        _check_range("optim.eps", self.eps, 0.0)
        _check_range("optim.clip_grad", self.clip_grad, 0.0)
        _check_range("optim.warmup_steps", self.warmup_steps, 0)
        _check_range("optim.wsd_decay_fraction", self.wsd_decay_fraction, 0.0, 1.0)
        _check_range("optim.muon_qk_clip", self.muon_qk_clip, 0.0)


@dataclass
class DataConfig:
    """Where tokens come from. Empty `paths`: the embedded default corpus."""

    paths: list = field(default_factory=list)  # indexed dataset prefixes (.bin/.idx)
    weights: list | None = None  # blend weights, one per path
    split: str = "98,2,0"  # train,valid,test proportions
    tokenizer: str | None = None  # folder with tokenizer.json; None: the embedded tokenizer
    cache_dir: str | None = None  # index caches; None: next to the data

    def validate(self) -> None:
        if not isinstance(self.paths, list):
            _fail("data.paths", self.paths, "a list of dataset prefixes, e.g. data.paths=[a,b]")
        if self.weights is not None:
            if not isinstance(self.weights, list) or len(self.weights) != len(self.paths):
                _fail("data.weights", self.weights, f"one weight per entry of data.paths ({len(self.paths)})")
            for w in self.weights:
                if not isinstance(w, (int, float)) or w < 0:
                    _fail("data.weights", self.weights, "non-negative numbers")
            if sum(self.weights) <= 0:
                _fail("data.weights", self.weights, "at least one weight must be > 0")
        parts = str(self.split).split(",")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) != 3 or any(n < 0 for n in nums) or sum(nums) <= 0:
            _fail("data.split", self.split, "three non-negative numbers 'train,valid,test', e.g. 98,2,0")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 200
    seed: int = 1234
    global_batch_size: int = 16
    micro_batch_size: int = 8
    seq_length: int = 128
    run_dir: str | None = None  # None: runs/<recipe>-<timestamp>
    exit_interval: int | None = None  # stop after this step with a checkpoint; the schedule stays the full run's
    eval_interval: int = 50
    eval_iters: int = 4
    profile_steps: list | None = None  # [a, b]: torch.profiler trace for steps a..b
    # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 (bf16 parameters and activations, fp32 master weights
    # per optim.master_weights) | fp16 (autocast over fp32 parameters, dynamic loss scaling)
    # | fp8 (bf16 as above, with the GEMMs of the modules in fp8.modules in FP8: the `fp8` section)
    precision: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    deterministic: bool = False
    cpu_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default (one per core)
    on_nonfinite: str = "error"  # error (stop with one line, exit code 3) | skip (drop the step's update)
    max_skipped_steps: int = 5  # on_nonfinite=skip: stop after this many non-finite steps in a row
    stop_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # save, then exit 75
    preflight_memory: str | bool = "warn"  # error | warn | off: when `moecore plan`'s estimate exceeds the GPU's memory
    cuda_graphs: str = "none"  # none | attention | moe_static | full: what each decoder layer captures (docs/train.md)

    STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
    CUDA_GRAPHS = ("none", "attention", "moe_static", "full")

    def validate(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "seq_length", "eval_iters"):
            _check_range(f"train.{name}", getattr(self, name), 1)
        _check_range("train.eval_interval", self.eval_interval, 0)
        if self.global_batch_size % self.micro_batch_size:
            _fail(
                "train.global_batch_size",
                self.global_batch_size,
                f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
            )
        if self.exit_interval is not None:
            _check_range("train.exit_interval", self.exit_interval, 1)
        if self.profile_steps is not None:
            if (
                not isinstance(self.profile_steps, list)
                or len(self.profile_steps) != 2
                or not all(isinstance(s, int) for s in self.profile_steps)
                or self.profile_steps[0] > self.profile_steps[1]
            ):
                _fail("train.profile_steps", self.profile_steps, "two step numbers [a,b] with a <= b")
        _check_choice("train.precision", self.precision, ("auto", "fp32", "bf16", "fp16", "fp8"))
        _check_choice("train.device", self.device, ("auto", "cpu", "cuda"))
        if self.cpu_threads is not None:
            _check_range("train.cpu_threads", self.cpu_threads, 1)
        _check_choice("train.on_nonfinite", self.on_nonfinite, ("error", "skip"))
        _check_range("train.max_skipped_steps", self.max_skipped_steps, 1)
        if not isinstance(self.stop_signals, list):
            _fail("train.stop_signals", self.stop_signals, "a list, e.g. [SIGTERM,SIGUSR1] ([] for none)")
        for s in self.stop_signals:
            _check_choice("train.stop_signals", s, self.STOP_SIGNALS)
        if self.preflight_memory is False:  # YAML reads a bare `off` as false
            self.preflight_memory = "off"
        _check_choice("train.preflight_memory", self.preflight_memory, ("error", "warn", "off"))
        _check_choice("train.cuda_graphs", self.cuda_graphs, self.CUDA_GRAPHS)


@dataclass
class CheckpointConfig:
    """Saving and loading."""

    interval: int = 0  # 0: only at the end (and at train.exit_interval)
    resume: bool = False  # continue the run in train.run_dir from its latest checkpoint
    load: str | None = None  # start from this checkpoint (weights only unless resume)
    keep_last: int | None = None
    upcycle_from: str | None = None  # a dense moecore checkpoint folder (moe.num_experts=0): experts start from it
    async_save: bool | None = None  # write checkpoints in the background; None: true on GPU, false on CPU

    def validate(self) -> None:
        _check_range("checkpoint.interval", self.interval, 0)
        if self.keep_last is not None:
            _check_range("checkpoint.keep_last", self.keep_last, 1)
        if self.load is not None and not Path(self.load).exists():
            _fail("checkpoint.load", self.load, "no such checkpoint folder")
        if self.upcycle_from is not None:
            if not Path(self.upcycle_from).is_dir():
                _fail("checkpoint.upcycle_from", self.upcycle_from, "no such checkpoint folder")
            if self.load is not None:
                _fail("checkpoint.upcycle_from", self.upcycle_from, "set checkpoint.upcycle_from or checkpoint.load")


@dataclass
class LogConfig:
    """Console, metrics.jsonl, TensorBoard and Weights & Biases."""

    interval: int = 10
    tensorboard: bool = True
    wandb_project: str | None = None
    peak_tflops: float | None = None  # for MFU; None: measured or a table value on GPU
    progress: bool = True
    oom_snapshot: bool = True  # on GPU: record allocations and write a memory snapshot on out-of-memory

    def validate(self) -> None:
        _check_range("log.interval", self.interval, 1)
        if self.peak_tflops is not None:
            _check_range("log.peak_tflops", self.peak_tflops, 0.0)
