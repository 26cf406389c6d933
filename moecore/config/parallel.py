"""The `parallel` section: TP / PP / CP / EP / ETP degrees, pipeline schedule and gradient reduction."""

from __future__ import annotations

from dataclasses import dataclass

from moecore.config.errors import _check_choice, _check_range, _fail


@dataclass
class ParallelConfig:
    """Parallel degrees. Data parallel is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = True  # with tp > 1, shard activations along the sequence outside TP regions
    distributed_optimizer: bool = False
    fsdp: bool = False
    grad_bucket_mb: float = 25.0
    overlap_grad_reduce: bool = True
    backend: str = "auto"  # auto | gloo | nccl
    vpp: int = 1  # virtual pipeline stages per rank (interleaved / V-shaped schedules)
    pp_schedule: str = "1f1b"  # 1f1b | interleaved_1f1b | zero_bubble | zbv | dualpipev
    pp_layout: str | None = None  # stages in Megatron-Core notation, e.g. "Et*3|(tt|)*29,m|L"; None: even split
    cp_comm: str = "ring"  # context parallel attention exchange: ring (K/V passed around) | allgather | a2a (heads)

    PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "vpp"):
            _check_range(f"parallel.{name}", getattr(self, name), 1)
        _check_choice("parallel.pp_schedule", self.pp_schedule, self.PP_SCHEDULES)
        if self.vpp > 1 and self.pp == 1:
            _fail("parallel.vpp", self.vpp, "needs parallel.pp > 1 (virtual stages are stages of a pipeline)")
        if self.pp_layout is not None and self.pp == 1:
            _fail("parallel.pp_layout", self.pp_layout, "needs parallel.pp > 1")
        _check_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _check_choice("parallel.cp_comm", self.cp_comm, ("ring", "allgather", "a2a"))
        _check_range("parallel.grad_bucket_mb", self.grad_bucket_mb, 0.0)
