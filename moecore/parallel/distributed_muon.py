"""Distributed Newton-Schulz for Muon: each matrix orthogonalised once, on one owning rank, from its full update.

Muon's update of a weight matrix is a function of the whole matrix (Newton-Schulz orthogonalisation
of its momentum), so it cannot be computed piecewise on tensor-parallel or FSDP shards. `MatrixPlan`
distributes that work over the ranks of one pipeline stage (tp x cp x dp; the world when pp = 1):

- The matrices are the global ones: a dense weight is one matrix, a grouped expert weight
  [E, out, in] is E matrices (per expert, as on one process). Every rank describes the block of
  each matrix it holds (from the parameters' `ShardSpec`: TP/ETP shards, EP-local experts); ranks
  holding the same block are replicas (data parallel). The plan is built once from all ranks'
  descriptions (one `all_gather_object`).
- Each matrix gets one owner among the ranks that hold part of it. The unit of assignment is a run
  of consecutive matrices of one parameter: a dense weight is one run, the experts a set of ranks
  holds are split into one run per such rank; runs are taken largest first and each goes to the
  least-loaded candidate (load = Newton-Schulz FLOPs), which spreads equal matrices round-robin.
  The owner assembles its matrices from one copy of every block (one `all_to_all_single` over the
  stage: each block is sent by one of its holders, the owner's own block is not sent), runs
  Newton-Schulz on all of them (batched by shape), scales them, and sends every holder of every
  block its block of the result (a second `all_to_all_single`). Each block of a run is one slice of
  the local tensor along the expert dim, so the per-step work is a few tensor operations per
  (parameter, rank), whatever the number of experts.
- Under FSDP the parameters are further row-sharded over data parallel: the caller all-gathers the
  update of each FSDP shard over its mesh first, which turns the FSDP peers into replicas
  (`gather_fsdp_rows` / `fsdp_rows`). Under the distributed optimizer the caller does the same
  with its flat bucket shards.

Per step this moves, per matrix, the blocks the owner lacks to the owner and the result blocks
back to every holder: at most twice the matrices' size, instead of every rank orthogonalising every
matrix (which would also be exact, at dp x tp times the Newton-Schulz FLOPs). With one process the
plan is local and the orthogonalisation is the single-process Muon's (same batching of experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moecore.optim.muon import newton_schulz
from moecore.parallel.comm import _all_gather_single, all_to_all_single
from moecore.parallel.dims import Group
from moecore.parallel.sharding import get_shard


@dataclass
class _Unit:
    """Consecutive matrices of one parameter (experts start..start+count; one for a dense weight), one owner.

    `blocks`: offsets within the matrix view -> (block size, the ranks holding that block of these
    matrices); `sender`: for each block, the holder that sends it to the owner.
    """

    key: tuple  # (parameter name, first leading index)
    count: int  # matrices in the unit
    shape: tuple[int, int]  # rows, cols of one global matrix
    view: tuple[int, ...]  # one matrix's view shape (the ShardSpec's view dims after the leading one)
    blocks: dict[tuple, tuple[tuple[int, ...], list[int]]] = field(default_factory=dict)
    owner: int = -1
    sender: dict[tuple, int] = field(default_factory=dict)

    @property
    def cost(self) -> float:
        """Newton-Schulz FLOPs (up to a constant): count x rows x cols x min(rows, cols)."""
        return self.count * math.prod(self.shape) * min(self.shape)


def _describe(named: list[tuple[str, torch.Tensor]]) -> list[tuple]:
    """Per parameter: (name, global shape, view shape, local view, offsets, leading view dims: 0 or 1)."""
    out = []
    for name, p in named:
        spec = get_shard(p)
        lead = len(spec.global_shape) - 2
        if lead > 1 or (lead == 1 and len(spec.groups[0]) != 1):
            raise ValueError(
                f"{name}: distributed Muon takes matrices or one leading (expert) dim, unsplit in its view"
            )
        out.append((name, spec.global_shape, spec.view_shape, spec.local_view, spec.offsets, lead))
    return out


class MatrixPlan:
    """Who orthogonalises which matrices, and the two exchanges of a step; see the module docstring.

    The unit of work is a run of consecutive matrices of one parameter (experts of a grouped weight
    held by the same ranks are split into as many runs as there are such ranks), so the per-step
    bookkeeping grows with parameters x ranks, not with the number of experts.
    """

    def __init__(
        self, named: list[tuple[str, torch.Tensor]], group: Group, ns_steps: int = 5, everyone: list | None = None
    ) -> None:
        """`everyone`: every member's `_describe` output, in group order (gathered here when None)."""
        self.group, self.ns_steps = group, ns_steps
        self.me = group.ranks[group.rank]
        mine = _describe(named) if everyone is None else everyone[group.rank]
        self.local = {d[0]: d for d in mine}
        if everyone is None and group.size > 1:
            everyone = [None] * group.size
            dist.all_gather_object(everyone, mine, group=group.pg)
        elif everyone is None:
            everyone = [mine]
        # name -> leading range (first, length) -> [(rank, inner offsets, inner size)]
        held: dict[str, dict[tuple[int, int], list]] = {}
        meta: dict[str, tuple] = {}
        for rank, descs in zip(group.ranks, everyone):
            for name, gshape, vshape, lview, offs, kv in descs:
                lead = (offs[0], lview[0]) if kv else (0, 1)
                held.setdefault(name, {}).setdefault(lead, []).append((rank, tuple(offs[kv:]), tuple(lview[kv:])))
                meta[name] = ((gshape[-2], gshape[-1]), tuple(vshape[kv:]))
        self.units: dict[tuple, _Unit] = {}
        for name in sorted(held):
            shape, view = meta[name]
            for (first, n), entries in sorted(held[name].items()):
                k = min(n, len({r for r, _, _ in entries}))  # one run per holder (fewer if fewer matrices)
                for c in range(k):
                    start, end = first + n * c // k, first + n * (c + 1) // k
                    u = self.units[(name, start)] = _Unit((name, start), end - start, shape, view)
                    for rank, offs, size in entries:
                        u.blocks.setdefault(offs, (size, []))[1].append(rank)
        self.matrices = sum(u.count for u in self.units.values())
        self._assign()
        self._schedule()

    # ------------------------------------------------------------------ plan
    def _assign(self) -> None:
        """Owners: largest units first, each to its least-loaded holder; block senders spread likewise."""
        load = {r: 0.0 for r in self.group.ranks}
        sent = {r: 0 for r in self.group.ranks}
        for u in sorted(self.units.values(), key=lambda u: (-u.cost, u.key)):
            holders = sorted({r for _, ranks in u.blocks.values() for r in ranks})
            u.owner = min(holders, key=lambda r: (load[r], r))
            load[u.owner] += u.cost
            for offs, (size, ranks) in u.blocks.items():
                if u.owner in ranks:
                    u.sender[offs] = u.owner
                else:
                    u.sender[offs] = min(ranks, key=lambda r: (sent[r], r))
                    sent[u.sender[offs]] += u.count * math.prod(size)
        self.order = sorted(self.units)  # the exchange order every rank uses

    def _schedule(self) -> None:
        """This rank's work lists of both exchanges (in one order every rank agrees on), fixed for the run.

        Only the units this rank holds or owns are visited per step; a unit's block is one slice
        of the local tensor along its leading (expert) dim.
        """
        index = {r: i for i, r in enumerate(self.group.ranks)}
        n, me = self.group.size, self.me
        self.send_blocks: list[list[tuple]] = [[] for _ in range(n)]  # (name, lo, hi, numel) to each owner
        self.recv_blocks: list[list[tuple]] = [[] for _ in range(n)]  # (key, offs, size) from each sender
        self.own_blocks: list[tuple] = []  # (key, name, lo, hi, offs, size): my blocks of my units
        self.send_results: list[list[tuple]] = [[] for _ in range(n)]  # (key, offs, size) to each holder
        self.recv_results: list[list[tuple]] = [[] for _ in range(n)]  # (name, lo, hi, size) from each owner
        self.keep_results: list[tuple] = []  # (key, name, lo, hi, offs, size): results I own and hold
        self.by_shape: dict[tuple, list[tuple]] = {}
        for key in self.order:
            u = self.units[key]
            name, start = key
            if u.owner == me:
                self.by_shape.setdefault(u.shape, []).append(key)
            mine = self.local.get(name)
            lo = start - (mine[4][0] if mine is not None and mine[5] else 0)  # in my local leading dim
            hi = lo + u.count
            for offs, (size, ranks) in sorted(u.blocks.items()):
                sender = u.sender[offs]
                numel = u.count * math.prod(size)
                if sender == me and u.owner == me:
                    self.own_blocks.append((key, name, lo, hi, offs, size))
                elif sender == me:
                    self.send_blocks[index[u.owner]].append((name, lo, hi, numel))
                elif u.owner == me:
                    self.recv_blocks[index[sender]].append((key, offs, size))
                for r in ranks:
                    if r == u.owner == me:
                        self.keep_results.append((key, name, lo, hi, offs, size))
                    elif u.owner == me:
                        self.send_results[index[r]].append((key, offs, size))
                    elif r == me:
                        self.recv_results[index[u.owner]].append((name, lo, hi, size))

        def numel(items: list[list[tuple]], count_of) -> list[int]:
            return [sum(count_of(item) for item in peer) for peer in items]

        units = self.units
        self.gather_send = numel(self.send_blocks, lambda it: it[3])
        self.gather_recv = numel(self.recv_blocks, lambda it: units[it[0]].count * math.prod(it[2]))
        self.scatter_send = numel(self.send_results, lambda it: units[it[0]].count * math.prod(it[2]))
        self.scatter_recv = numel(self.recv_results, lambda it: (it[2] - it[1]) * math.prod(it[3]))

    def owned(self) -> list[tuple]:
        """Keys of the units this rank orthogonalises."""
        return [k for keys in self.by_shape.values() for k in keys]

    def owned_matrices(self) -> int:
        """How many matrices this rank orthogonalises."""
        return sum(self.units[k].count for k in self.owned())

    # ------------------------------------------------------------------ step
    def _views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each local tensor in its shard-view shape with a leading (matrix index) dim (1 for a dense weight)."""
        out = {}
        for name, t in tensors.items():
            lview, kv = self.local[name][3], self.local[name][5]
            out[name] = t.reshape(lview if kv else (1, *lview))
        return out

    @torch.no_grad()
    def orthogonalize(self, updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scaled Newton-Schulz of every matrix, from this rank's local (fp32) updates; same shapes back.

        `updates[name]` is the local tensor of parameter `name` (the whole TP/EP-local tensor).
        The result is the orthogonalised update scaled by 0.2 * sqrt(max(rows, cols)) of the global
        matrix, cut to this rank's blocks.
        """
        dtype = torch.float32
        dev = next(iter(updates.values())).device
        src = self._views({k: v.to(dtype) for k, v in updates.items()})
        units = self.units
        # 1. blocks to their owners
        full = {k: torch.empty((units[k].count, *units[k].view), dtype=dtype, device=dev) for k in self.owned()}
        for key, name, lo, hi, offs, size in self.own_blocks:
            full[key][(slice(None), *_slices(offs, size))] = src[name][lo:hi]
        parts = [[src[name][lo:hi].reshape(-1) for name, lo, hi, _ in peer] for peer in self.send_blocks]
        recv = self._exchange(parts, self.gather_send, self.gather_recv, dev)
        for peer, items in zip(recv, self.recv_blocks):
            off = 0
            for key, offs, size in items:
                c = units[key].count
                n = c * math.prod(size)
                full[key][(slice(None), *_slices(offs, size))] = peer[off : off + n].view(c, *size)
                off += n
        # 2. Newton-Schulz on the owned matrices, batched by shape
        result: dict[tuple, torch.Tensor] = {}
        for shape, keys in self.by_shape.items():
            stack = torch.cat([full[k].reshape(-1, *shape) for k in keys])
            o = newton_schulz(stack, self.ns_steps) * (0.2 * math.sqrt(max(shape)))
            for k, t in zip(keys, o.split([units[k].count for k in keys])):
                result[k] = t.reshape(units[k].count, *units[k].view)
        # 3. result blocks to every holder
        outputs = {name: torch.empty(updates[name].shape, dtype=dtype, device=dev) for name in updates}
        out = self._views(outputs)
        for key, name, lo, hi, offs, size in self.keep_results:
            out[name][lo:hi] = result[key][(slice(None), *_slices(offs, size))]
        parts = [
            [result[key][(slice(None), *_slices(offs, size))].reshape(-1) for key, offs, size in peer]
            for peer in self.send_results
        ]
        recv = self._exchange(parts, self.scatter_send, self.scatter_recv, dev)
        for peer, items in zip(recv, self.recv_results):
            off = 0
            for name, lo, hi, size in items:
                n = (hi - lo) * math.prod(size)
                out[name][lo:hi] = peer[off : off + n].view(hi - lo, *size)
                off += n
        return outputs

    def _exchange(
        self, parts: list[list[torch.Tensor]], send: list[int], recv: list[int], dev: torch.device
    ) -> list[torch.Tensor]:
        """One all_to_all_single of the flat parts; the received flat tensor split per peer."""
        if self.group.size == 1:
            return [torch.zeros(0, device=dev)]
        flat = [torch.cat(p) if p else torch.zeros(0, device=dev) for p in parts]
        # Every member joins every exchange (some send or receive nothing).
        got = all_to_all_single(torch.cat(flat), self.group, recv, send)
        return list(got.split(recv))


def _slices(offs: tuple[int, ...], size: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offs, size))


# --------------------------------------------------------------------------------------------------
# FSDP rows
# --------------------------------------------------------------------------------------------------


def _chunk_rows(n: int, size: int) -> int:
    """Rows per rank of FSDP2's dim-0 sharding (torch.chunk: ceil(n / size), the last ones shorter)."""
    return -(-n // size)


def gather_fsdp_rows(local: torch.Tensor, rows: int, group) -> torch.Tensor:
    """The whole tensor (`rows` rows) from each FSDP rank's dim-0 chunk (padded all-gather, like FSDP2's own)."""
    size = dist.get_world_size(group)
    c = _chunk_rows(rows, size)
    padded = local.new_zeros((c, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((c * size, *local.shape[1:]))
    _all_gather_single(out, padded.contiguous(), group=group)
    return out[:rows]


def fsdp_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's dim-0 chunk of `full` under FSDP2's sharding."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    c = _chunk_rows(full.shape[0], size)
    return full[rank * c : (rank + 1) * c]


# --------------------------------------------------------------------------------------------------
# The Muon hook
# --------------------------------------------------------------------------------------------------


class DistributedOrthogonalizer:
    """`Muon(orthogonalize=...)` for a parallel run: FSDP rows gathered, then `MatrixPlan` over the stage."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], dims, ns_steps: int = 5) -> None:
        self.names = {id(p): n for n, p in named}
        self.plan = MatrixPlan(named, dims.stage_group, ns_steps)

    def __call__(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        local: dict[str, torch.Tensor] = {}
        meshes: dict[str, object] = {}
        for p, u in zip(params, updates):
            name = self.names[id(p)]
            u = u.float()
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.size() > 1:  # an FSDP2 shard: the whole (TP/EP-local) update first
                group = mesh.get_group()
                u = gather_fsdp_rows(u, p.shape[0], group)
                meshes[name] = group
            local[name] = u
        if set(local) != set(self.plan.local):
            missing = sorted(set(self.plan.local) - set(local))[:3]
            raise RuntimeError(f"distributed Muon needs every matrix of this rank each step; missing {missing}")
        done = self.plan.orthogonalize(local)
        out = []
        for p in params:
            name = self.names[id(p)]
            o = done[name]
            out.append(fsdp_rows(o, meshes[name]) if name in meshes else o)
        return out


def distributed_muon(dims, ns_steps: int = 5):
    """`build_muon(orthogonalize_for=...)` for this layout: None on one process (every matrix is whole)."""
    if dims is None or dims.stage_group.size == 1:
        return None
    return lambda named: DistributedOrthogonalizer(named, dims, ns_steps)
