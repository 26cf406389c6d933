"""Data-parallel gradient reduction in buckets, launched from backward hooks, and the global grad norm.

The training loop's contract:

    sync = wrap_model_for_data_parallel(model, dims, bucket_mb, overlap)
    for each micro-batch i:
        with sync.no_sync() if i < last else nullcontext():
            (loss / num_micro_batches).backward()
    sync.finish_grad_sync()            # every grad now equals the single-process run's
    norm = clip_grad_norm_(model.parameters(), max_norm, dims)
    optimizer.step()

How each gradient is reduced follows its ShardSpec kind (see `moecore.parallel.sharding`):

| kind | reduction |
|---|---|
| replicated, tensor_parallel | mean over the dp_cp group |
| tp_partial | mean over dp_cp, then sum over tp |
| expert | sum over the edp group, divided by dp * cp |

Why experts divide by dp*cp: every rank routes distinct tokens (TP ranks hold sequence chunks),
and an expert's local gradient already sums the contributions of every token it received, from all
EP (and ETP) peers. Summing over the ranks that hold the same expert shard (edp) covers every token
of the global batch once; dividing by the number of data-parallel replicas makes it the mean over
replicas that the dense parameters get.

Buckets: parameters are grouped in reverse registration order (roughly the order backward produces
their gradients), by reduction group, up to `bucket_mb` MiB each. A post-accumulate-grad hook marks
a parameter ready; when a bucket is complete, it and every complete bucket before it are flattened
and all-reduced asynchronously (so communication overlaps the rest of backward). Buckets are always
launched in index order, so every rank issues the same collectives in the same order even when a
parameter gets no gradient on some rank (it counts as zero at `finish_grad_sync`).

Sharded mode (`shard_for_optimizer`, called by the distributed optimizer): buckets are rebuilt per
(reduction group, optimizer parameter group), every parameter included, each
bucket's flat gradient zero-padded to a multiple of the group size g and *reduce-scattered*: rank i
of the group receives the summed elements [i * n/g, (i + 1) * n/g) of the bucket (`_Bucket.shard_grad`)
and nothing else, and the per-parameter gradients are freed as soon as the bucket is launched. The
`tp_partial` elements of a shard are then summed over tp (tp peers hold the same shard layout).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moecore.optim.mixed_precision import grad_of, set_grad
from moecore.parallel import comm
from moecore.parallel.dims import Group, ParallelDims
from moecore.parallel.sharding import get_shard, replication_factor


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group: Group
    scale: float
    ready: set = field(default_factory=set)
    work: object | None = None
    flat: torch.Tensor | None = None
    # sharded mode (see the module docstring)
    sharded: bool = False
    opt_group: int = 0  # the optimizer parameter group of every parameter in the bucket
    numel: int = 0  # unpadded length of the flat bucket
    shard_size: int = 0  # padded length / group size
    shard_grad: torch.Tensor | None = None  # this rank's reduced elements (after finish_grad_sync)

    @property
    def lo(self) -> int:
        """First element of the flat bucket this rank owns."""
        return self.group.rank * self.shard_size

    def overlaps(self) -> Iterator[tuple[torch.nn.Parameter, int, int, int]]:
        """(param, its flat offset, a, b): the elements [a, b) of the flat bucket that are this rank's and p's."""
        lo, hi, off = self.lo, self.lo + self.shard_size, 0
        for p in self.params:
            n = p.numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                yield p, off, a, b
            off += n


class GradSync:
    """Bucketed, hook-driven gradient reduction for one model; see the module docstring.

    bucket_mb / overlap default to `parallel.grad_bucket_mb` / `parallel.overlap_grad_reduce`.
    """

    def __init__(
        self, model: torch.nn.Module, dims: ParallelDims, bucket_mb: float | None = None, overlap: bool | None = None
    ) -> None:
        bucket_mb = dims.cfg.grad_bucket_mb if bucket_mb is None else bucket_mb
        overlap = dims.cfg.overlap_grad_reduce if overlap is None else overlap
        self.dims = dims
        self.overlap = overlap
        self.sync_enabled = True
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.bucket_mb = bucket_mb
        self.tp_partial = [p for p in params if get_shard(p).kind == "tp_partial"]
        self.buckets = self._make_buckets(params, bucket_mb)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._next_launch = 0
        self._hooks = []
        if overlap:
            for p in params:  # the hook ignores parameters outside every bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def shard_for_optimizer(
        self, opt_group_of: dict[torch.nn.Parameter, int], apart: set[torch.nn.Parameter] | None = None
    ) -> list[_Bucket]:
        """Switch to sharded mode (reduce-scatter) with buckets that never mix optimizer groups; returns them.

        `opt_group_of`: each parameter's optimizer parameter-group index. Every parameter is in a bucket,
        also where its group has one member (then the bucket's shard is the whole bucket). `apart`: parameters
        that share buckets only with each other (FP8 primary weights gathered as FP8 bytes: fp8_gather.py).
        """
        apart = apart or set()
        d = self.dims
        cap = max(1, int(self.bucket_mb * 2**20))
        open_: dict[tuple, _Bucket] = {}
        sizes: dict[tuple, int] = {}
        buckets: list[_Bucket] = []
        for p in reversed(self.params):
            kind = get_shard(p).kind
            group = d.edp_group if kind == "expert" else d.dp_cp_group
            scale = 1.0 / (d.dp * d.cp) if kind == "expert" else 1.0 / group.size
            key = (kind == "expert", opt_group_of[p], p in apart)
            if key not in open_:
                open_[key] = _Bucket([], group, scale, sharded=True, opt_group=key[1])
                sizes[key] = 0
                buckets.append(open_[key])
            open_[key].params.append(p)
            sizes[key] += p.numel() * p.element_size()
            if sizes[key] >= cap:
                del open_[key]
        for b in buckets:
            b.numel = sum(p.numel() for p in b.params)
            b.shard_size = -(-b.numel // b.group.size)
        self.buckets = buckets
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self.tp_partial = []  # summed over tp inside their buckets
        return buckets

    def _make_buckets(self, params: list[torch.nn.Parameter], bucket_mb: float) -> list[_Bucket]:
        d = self.dims
        replicas = d.dp * d.cp
        cap = max(1, int(bucket_mb * 2**20))
        open_: dict[str, _Bucket] = {}
        sizes: dict[str, int] = {}
        buckets: list[_Bucket] = []
        for p in reversed(params):
            if get_shard(p).kind == "expert":
                key, group, scale = "expert", d.edp_group, 1.0 / replicas
            else:
                key, group, scale = "dense", d.dp_cp_group, 1.0 / d.dp_cp_group.size
            if group.size == 1:
                if scale != 1.0:  # nothing to sum, but the mean over replicas still applies
                    key = key + "-scale"
                else:
                    continue
            if key not in open_:
                open_[key] = _Bucket([], group, scale)
                sizes[key] = 0
                buckets.append(open_[key])
            open_[key].params.append(p)
            sizes[key] += p.numel() * p.element_size()
            if sizes[key] >= cap:
                del open_[key]
        return buckets

    # ------------------------------------------------------------------ hooks
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.sync_enabled or id(p) not in self._bucket_of:
            return
        b = self.buckets[self._bucket_of[id(p)]]
        b.ready.add(id(p))
        # Launch in index order only: bucket i waits for buckets < i, so all ranks issue the same sequence.
        while self._next_launch < len(self.buckets):
            nb = self.buckets[self._next_launch]
            if len(nb.ready) < len(nb.params):
                break
            self._launch(nb)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        grads = [_grad_or_zeros(p) for p in b.params]
        if b.sharded:
            g = b.group.size
            flat = torch.zeros(b.shard_size * g, dtype=torch.float32, device=grads[0].device)
            off = 0
            for t in grads:
                flat[off : off + t.numel()].copy_(t.reshape(-1))
                off += t.numel()
            flat.mul_(b.scale)
            for p in b.params:  # the bucket holds them now: free the full gradients
                _free_grad(p)
            if g == 1:
                b.shard_grad = flat
            else:
                b.flat = flat
                b.shard_grad = flat.new_empty(b.shard_size)
                b.work = comm._reduce_scatter_single(b.shard_grad, flat, group=b.group.pg, async_op=True)
            return
        b.flat = torch.cat([g.reshape(-1) for g in grads]).mul_(b.scale)
        if b.group.size > 1:
            b.work = dist.all_reduce(b.flat, group=b.group.pg, async_op=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without reducing them."""
        prev = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = prev

    # ------------------------------------------------------------------ finish
    def finish_grad_sync(self) -> None:
        """Launch what is left (in order), wait for every bucket, write the results back into .grad."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            if b.sharded:
                self._sum_tp_partial_shard(b)
                b.ready.clear()
                b.work, b.flat = None, None
                continue
            off = 0
            for p in b.params:
                n = p.numel()
                _store(p, b.flat[off : off + n].view_as(p))
                off += n
            b.ready.clear()
            b.work, b.flat = None, None
        self._next_launch = 0
        self._reduce_tp_partial()

    def _sum_tp_partial_shard(self, b: _Bucket) -> None:
        """Sum the `tp_partial` elements of a reduced shard over tp (tp peers hold the same bucket layout)."""
        if self.dims.tp_group.size == 1:
            return
        spans = [(a - b.lo, e - b.lo) for p, _, a, e in b.overlaps() if get_shard(p).kind == "tp_partial"]
        if not spans:
            return
        flat = torch.cat([b.shard_grad[x:y] for x, y in spans])
        comm.all_reduce_(flat, self.dims.tp_group, "sum")
        off = 0
        for x, y in spans:
            b.shard_grad[x:y] = flat[off : off + y - x]
            off += y - x

    def _reduce_tp_partial(self) -> None:
        tp = self.dims.tp_group
        if tp.size == 1 or not self.tp_partial:
            return
        grads = [_grad_or_zeros(p) for p in self.tp_partial]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_(flat, tp, "sum")
        off = 0
        for p in self.tp_partial:
            n = p.numel()
            _store(p, flat[off : off + n].view_as(p))
            off += n

    finish = finish_grad_sync  # the name the training runtime calls

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient to reduce (`grad_of`: the fp32 main gradient under bf16 training); zeros where none came."""
    g = grad_of(p)
    if g is not None:
        return g
    return torch.zeros(p.shape, dtype=torch.float32 if hasattr(p, "main_grad") else p.dtype, device=p.device)


def _free_grad(p: torch.nn.Parameter) -> None:
    """Drop the full gradient of `p` (sharded mode: the reduced shard is all the optimizer needs)."""
    p.grad = None
    if hasattr(p, "main_grad"):
        p.main_grad = None


def _store(p: torch.nn.Parameter, reduced: torch.Tensor) -> None:
    """Write a reduced gradient back where `grad_of(p)` finds it."""
    g = grad_of(p)
    if g is None:
        set_grad(p, reduced.clone())
    else:
        g.copy_(reduced)


GradReducer = GradSync  # alias used by moecore.train.runtime


def wrap_model_for_data_parallel(
    model: torch.nn.Module, dims: ParallelDims, bucket_mb: float | None = None, overlap: bool | None = None
) -> GradSync:
    """Register the bucketed gradient reduction on `model` (which stays the same object) and return it."""
    sync = GradSync(model, dims, bucket_mb, overlap)
    model._moecore_grad_sync = sync
    return sync


def finish_grad_sync(model: torch.nn.Module) -> None:
    """Complete the gradient reduction registered by `wrap_model_for_data_parallel` (no-op without it)."""
    sync = getattr(model, "_moecore_grad_sync", None)
    if sync is not None:
        sync.finish_grad_sync()


def _params(params: Iterable[torch.nn.Parameter] | torch.nn.Module) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    return [p for p in params if grad_of(p) is not None]


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """Sum of squares of one gradient tensor: its norm, squared in float64 (every layout's grad norm sums these,
    so a one-process run and a sharded run of the same gradients report the same norm).

    On CUDA the norm accumulates in float32 (the tree reduction's relative error is ~1e-7). On CPU it accumulates
    in float64: torch's float32 norm there sums with a relative error of ~2e-5 at 5e5 elements and ~2e-4 at 4e6,
    which differs between a whole tensor and its shards (CPU runs are small; the cost is a float64 pass).
    """
    acc = torch.float64 if grad.device.type == "cpu" else torch.float32
    return torch.linalg.vector_norm(grad, dtype=acc).double().square()


def global_grad_norm(params: Iterable[torch.nn.Parameter] | torch.nn.Module, dims: ParallelDims | None) -> torch.Tensor:
    """L2 norm of the full gradient: every parameter counted once (replicas once, shards from every shard)."""
    params = _params(params)
    if not params:
        return torch.zeros((), dtype=torch.float32)
    device = grad_of(params[0]).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        # Each copy contributes 1/copies of its square, so the sum over all ranks counts it once.
        sq = squared_norm(grad_of(p).detach())
        copies = 1 if dims is None else replication_factor(get_shard(p), dims)
        total += sq / copies
    if dims is not None:
        comm.all_reduce_(total, dims.world_group, "sum")
    return total.sqrt().float()


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter] | torch.nn.Module, max_norm: float, dims: ParallelDims | None
) -> torch.Tensor:
    """Scale grads so the global norm is at most max_norm (as torch.nn.utils.clip_grad_norm_); returns the norm.

    `params` may be a module (all its parameters with a gradient).
    """
    params = _params(params)
    norm = global_grad_norm(params, dims)
    if max_norm > 0 and math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            g = grad_of(p)
            g.detach().mul_(coef.to(g.device, g.dtype))
    return norm


def apply_clip(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float, optimizer: object = None) -> None:
    """Clip to `max_norm` given the global `norm`: the coefficient min(1, max_norm / (norm + 1e-6)) goes to the
    optimizer's fused update where it takes one (`grad_scale`), else the gradients are scaled in place."""
    if max_norm <= 0 or not grads:
        return
    coef = float((max_norm / (norm.float() + 1e-6)).clamp(max=1.0))
    if hasattr(optimizer, "grad_scale"):
        optimizer.grad_scale = coef
    elif coef < 1.0:
        torch._foreach_mul_(grads, coef)


def average_over_data_parallel(t: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Mean of a per-replica metric (e.g. the LM loss) over the data-parallel replicas; a detached copy."""
    t = t.detach().clone()
    if dims is not None:
        comm.all_reduce_(t, dims.dp_cp_group, "avg")
    return t


def sum_over_token_ranks(t: torch.Tensor, dims: ParallelDims | None) -> torch.Tensor:
    """Sum of a per-rank token statistic over every rank that routes distinct tokens (tp x cp x dp); in place."""
    if dims is not None:
        comm.all_reduce_(t, dims.world_group, "sum")  # with pp = 1 those ranks are the whole world
    return t
