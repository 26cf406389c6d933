"""Parallel degrees and every process group, in one object passed explicitly (no global state).

`ParallelDims` takes `ParallelConfig` and the world size, validates the degrees and builds the
groups. Two meshes tile the same ranks (parallel folding):

    attention / dense layers:  rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    MoE expert layers:         rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))

so TP (and ETP) are the innermost, adjacent ranks, and `dp = world / (tp * cp * pp)`,
`edp = world / (etp * ep * pp)`. Each group is a `Group`: its ranks, this rank's index in it, and
the torch process group (None when the group has one member, so layers skip communication and one
process needs no torch.distributed at all).

Groups: `tp`, `cp`, `dp`, `dp_cp`, `tp_cp`, `ep`, `etp`, `edp`, `ep_etp` (expert model parallel:
the ranks that together hold one copy of every expert), `pp` (the ranks of one pipeline: same
position in every other dimension, one per stage), `stage` (every rank of this pipeline stage:
tp x cp x dp, which is also etp x ep x edp since pp is the outermost axis of both meshes), `world`.
`pp_subgroup(pp_ranks)` adds the groups joining some stages of every pipeline (the copies of the
embedding and output head that first, MTP and last stages hold).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from moecore.config import ConfigError, ParallelConfig


@dataclass
class Group:
    """One process group as seen from this rank."""

    name: str
    ranks: list[int]  # global ranks, in group-rank order
    rank: int  # this rank's index within `ranks`
    pg: dist.ProcessGroup | None = field(default=None, repr=False)  # None when size == 1

    @property
    def size(self) -> int:
        return len(self.ranks)


def _mesh_groups(world_size: int, sizes: list[int], axis: int | tuple[int, ...]) -> list[list[int]]:
    """All groups varying along `axis` (one or several mesh axes) of a mesh with `sizes`, innermost first."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    strides = [1]
    for s in sizes[:-1]:
        strides.append(strides[-1] * s)
    groups: dict[tuple, list[int]] = {}
    for rank in range(world_size):
        coords = [(rank // strides[i]) % sizes[i] for i in range(len(sizes))]
        key = tuple(c for i, c in enumerate(coords) if i not in axes)
        groups.setdefault(key, []).append(rank)  # ranks ascend, so members come in coordinate order
    return list(groups.values())


class ParallelDims:
    """Degrees of every parallel dimension and the process groups for this rank.

    `ParallelDims(cfg, world_size, rank, device)` with world_size 1 builds no torch process group.
    With world_size > 1 torch.distributed must be initialised (see `init_distributed`); every rank
    must construct ParallelDims in the same order, since group creation is a collective.
    `num_experts`, `num_attention_heads`, `num_kv_heads` and `vocab_size`, when given, are checked
    against the degrees.
    """

    def __init__(
        self,
        cfg: ParallelConfig,
        world_size: int = 1,
        rank: int = 0,
        device: torch.device | str = "cpu",
        *,
        num_experts: int = 0,
        num_attention_heads: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.device = torch.device(device)
        self.tp, self.pp, self.cp, self.ep, self.etp = cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.etp
        self.vpp = cfg.vpp
        self.sequence_parallel = bool(cfg.sequence_parallel and cfg.tp > 1)
        self._validate(num_experts, num_attention_heads, vocab_size)
        self.dp = self.world_size // (self.tp * self.cp * self.pp)
        self.edp = self.world_size // (self.etp * self.ep * self.pp)
        self._build_groups()

    # ------------------------------------------------------------------ validation
    def _validate(self, num_experts: int, num_attention_heads: int | None, vocab_size: int | None) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size {self.world_size} is invalid: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is invalid: must be in [0, {self.world_size})")
        dense = self.tp * self.cp * self.pp
        if self.world_size % dense:
            if self.pp > 1 and self.world_size % (self.tp * self.cp) == 0:
                name = "pp"
            else:
                name = "cp" if self.cp > 1 and self.world_size % self.tp == 0 else "tp"
            raise ConfigError(
                f"parallel.{name}={getattr(self, name)}: tp*cp*pp={dense} does not divide the world size {self.world_size}"
            )
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise ConfigError(
                f"parallel.ep={self.ep}: etp*ep*pp={expert} (parallel.etp={self.etp}) does not divide the world size {self.world_size}"
            )
        if num_experts and num_experts % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide moe.num_experts={num_experts}")
        if not num_experts and self.ep > 1:
            raise ConfigError(f"parallel.ep={self.ep} needs MoE layers (moe.num_experts > 0); use 1 for a dense model")
        if num_attention_heads is not None and num_attention_heads % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} does not divide model.num_attention_heads={num_attention_heads}")
        if vocab_size and vocab_size % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} does not divide model.vocab_size={vocab_size}")

    # ------------------------------------------------------------------ groups
    def _build_groups(self) -> None:
        ws = self.world_size
        dense_sizes = [self.tp, self.cp, self.dp, self.pp]  # innermost first
        expert_sizes = [self.etp, self.ep, self.edp, self.pp]
        specs: list[tuple[str, list[int], int | tuple[int, ...]]] = [
            ("tp", dense_sizes, 0),
            ("cp", dense_sizes, 1),
            ("dp", dense_sizes, 2),
            ("dp_cp", dense_sizes, (1, 2)),
            ("tp_cp", dense_sizes, (0, 1)),
            ("etp", expert_sizes, 0),
            ("ep", expert_sizes, 1),
            ("edp", expert_sizes, 2),
            ("ep_etp", expert_sizes, (0, 1)),
            ("pp", dense_sizes, 3),
            ("stage", dense_sizes, (0, 1, 2)),
            ("world", [ws], 0),
        ]
        use_dist = ws > 1
        if use_dist and not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims with world size > 1 needs torch.distributed initialised (init_distributed)"
            )
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.groups: dict[str, Group] = {}
        for name, sizes, axis in specs:
            for ranks in _mesh_groups(ws, sizes, axis):
                key = tuple(ranks)
                if key not in made:
                    # new_group is collective over the whole world: every rank creates every group, same order.
                    if len(ranks) == 1:
                        made[key] = None
                    elif len(ranks) == ws:
                        made[key] = dist.group.WORLD
                    else:
                        made[key] = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[name] = Group(name, list(ranks), ranks.index(self.rank), made[key])
        g = self.groups
        self.tp_group, self.cp_group, self.dp_group = g["tp"], g["cp"], g["dp"]
        self.dp_cp_group, self.tp_cp_group = g["dp_cp"], g["tp_cp"]
        self.ep_group, self.etp_group, self.edp_group, self.ep_etp_group = g["ep"], g["etp"], g["edp"], g["ep_etp"]
        self.pp_group, self.stage_group = g["pp"], g["stage"]
        self.world_group = g["world"]
        self._made = made

    def pp_subgroup(self, pp_ranks: tuple[int, ...]) -> Group:
        """The group of this rank's pipeline restricted to the given pipeline ranks (collective on first use).

        Every rank must call it with the same `pp_ranks` in the same order (it creates the group of
        every pipeline). This rank need not be in it: then a size-1 group of itself comes back.
        """
        pp_ranks = tuple(sorted(set(pp_ranks)))
        name = "pp_sub" + "".join(f"_{r}" for r in pp_ranks)
        if name not in self.groups:
            mine = Group(name, [self.rank], 0, None)
            for line in _mesh_groups(self.world_size, [self.tp, self.cp, self.dp, self.pp], 3):
                ranks = [line[r] for r in pp_ranks]
                key = tuple(ranks)
                if key not in self._made:
                    self._made[key] = None if len(ranks) == 1 else dist.new_group(ranks)
                if self.rank in ranks:
                    mine = Group(name, ranks, ranks.index(self.rank), self._made[key])
            self.groups[name] = mine
        return self.groups[name]

    # ------------------------------------------------------------------ reductions the model needs
    def all_reduce_moe_counts(self, t: torch.Tensor) -> torch.Tensor:
        """Sum per-rank token counts over every rank that routes distinct tokens (tp x cp x dp); a new tensor.

        Each such rank routes its own tokens (TP ranks hold sequence chunks inside MoE layers), so
        the sum is the count of the whole global batch. Those ranks are this pipeline stage's (the
        world when pp = 1).
        """
        t = t.detach().clone()
        if self.stage_group.pg is not None:
            with torch.no_grad():
                dist.all_reduce(t, group=self.stage_group.pg)
        return t

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a per-replica quantity (the same on every TP rank) over the data-parallel replicas; a new tensor."""
        t = t.detach().clone()
        if self.dp_cp_group.pg is not None:
            with torch.no_grad():
                dist.all_reduce(t, group=self.dp_cp_group.pg)
        return t

    # ------------------------------------------------------------------ conveniences
    def group(self, name: str) -> Group:
        return self.groups[name]

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes metrics."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return (
            f"world={self.world_size} tp={self.tp} cp={self.cp} pp={self.pp} vpp={self.vpp} dp={self.dp} | "
            f"ep={self.ep} etp={self.etp} edp={self.edp} | sequence_parallel={self.sequence_parallel}"
        )

    def __repr__(self) -> str:
        return f"ParallelDims(rank={self.rank}, {self.describe()})"


def single_process_dims(device: torch.device | str = "cpu") -> ParallelDims:
    """Every degree 1, no torch.distributed: what a plain one-process run uses."""
    return ParallelDims(ParallelConfig(), 1, 0, device)


def init_distributed(
    cfg: ParallelConfig,
    *,
    seed: int | None = None,
    device: str = "auto",
    num_experts: int = 0,
    num_attention_heads: int | None = None,
    vocab_size: int | None = None,
    timeout_s: float = 600.0,
) -> ParallelDims:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and build ParallelDims.

    Without those variables (or WORLD_SIZE=1) nothing is initialised and a one-process ParallelDims
    comes back, except with `parallel.fsdp=true`: FSDP2 runs over a one-rank process group then. The backend is `parallel.backend`, or with `auto` NCCL when CUDA is available and gloo
    otherwise. `seed` seeds python, torch and CUDA identically on every rank (so every rank builds the
    same initial weights before sharding).
    """
    cfg.validate()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ConfigError("parallel.backend='nccl' needs CUDA devices; allowed here: auto | gloo")
    dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1)) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if backend == "nccl":
        # NVLink multicast (NVLS) is left off unless the user turned it on: on shared hosts it can take
        # the GPUs out of service, and MoE training gains little from it.
        for var, value in (
            ("NCCL_NVLS_ENABLE", "0"),
            ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
            ("NVSHMEM_DISABLE_NVLS", "1"),
        ):
            os.environ.setdefault(var, value)
    if world_size > 1 and not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    elif cfg.fsdp and not dist.is_initialized():  # FSDP2 needs a process group, even a one-rank one
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        store = dist.HashStore()  # in-process: no address, no port
        dist.init_process_group(
            backend=backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=timeout_s), **kwargs
        )
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)
    return ParallelDims(
        cfg,
        world_size,
        rank,
        dev,
        num_experts=num_experts,
        num_attention_heads=num_attention_heads,
        vocab_size=vocab_size,
    )


def destroy_distributed() -> None:
    """Tear down torch.distributed if it was initialised (end of a run)."""
    if dist.is_initialized():
        # Every rank arrives before any tears its connections down: a gloo peer whose connection closes
        # while it still finishes its last operations aborts the process.
        try:
            dist.barrier()
        except RuntimeError:  # a peer already gone (a failed run): tear down what is left
            pass
        dist.destroy_process_group()
