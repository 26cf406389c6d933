"""Distributed Newton-Schulz for Muon: each matrix orthogonalised once, on one owning rank, from its full update.

Muon's update of a weight matrix is a function of the whole matrix (Newton-Schulz orthogonalisation
of its momentum), so it cannot be computed piecewise on tensor-parallel or FSDP shards. `MatrixPlan`
distributes that work over the ranks of one pipeline stage (tp x cp x dp; the world when pp = 1):

- The matrices are the global ones: a dense weight is one matrix, a grouped expert weight
  [E, out, in] is E matrices (per expert, as on one process). Every rank describes the block of
  each matrix it holds (from the parameters' `ShardSpec`: TP/ETP shards, EP-local experts); ranks
  holding the same block are replicas (data parallel). The plan is built once from all ranks'
  descriptions (one `all_gather_object`).
- Each matrix gets one owner among the ranks that hold part of it: matrices are taken largest
  first and each goes to the least-loaded candidate (load = Newton-Schulz FLOPs), which for
  matrices of one size is round-robin. The owner assembles the full matrix from one copy of every
  block (one `all_to_all_single` over the stage: each block is sent by one of its holders, the
  owner's own block is not sent), runs Newton-Schulz on all its matrices (batched by shape), scales
  them, and sends every holder of every block its block of the result (a second `all_to_all_single`).
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
class _Matrix:
    """One global matrix: its blocks (offsets within the matrix view -> holder ranks) and its owner."""

    key: tuple  # (parameter name, leading index)
    shape: tuple[int, int]  # rows, cols of the global matrix
    view: tuple[int, ...]  # the matrix's view shape (the ShardSpec's view dims after the leading ones)
    blocks: dict[tuple, tuple[tuple[int, ...], list[int]]] = field(default_factory=dict)  # offs -> (size, ranks)
    owner: int = -1
    sender: dict[tuple, int] = field(default_factory=dict)  # offs -> the holder that sends it to the owner


def _describe(named: list[tuple[str, torch.Tensor]]) -> list[tuple]:
    """Per parameter: (name, global shape, view shape, local view, offsets, leading view dims)."""
    out = []
    for name, p in named:
        spec = get_shard(p)
        lead = len(spec.global_shape) - 2
        groups = spec.groups
        if any(len(g) != 1 for g in groups[:lead]):
            raise ValueError(f"{name}: a leading (batch) dim of a Muon matrix is split in its shard view")
        kv = lead  # the leading global dims are single view dims
        out.append((name, spec.global_shape, spec.view_shape, spec.local_view, spec.offsets, kv))
    return out


class MatrixPlan:
    """Who orthogonalises which matrix, and the two exchanges of a step; see the module docstring."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], group: Group, ns_steps: int = 5) -> None:
        self.group, self.ns_steps = group, ns_steps
        self.me = group.ranks[group.rank]
        mine = _describe(named)
        self.local = {d[0]: d for d in mine}
        if group.size > 1:
            everyone: list = [None] * group.size
            dist.all_gather_object(everyone, mine, group=group.pg)
        else:
            everyone = [mine]
        self.matrices: dict[tuple, _Matrix] = {}
        for rank, descs in zip(group.ranks, everyone):
            for name, gshape, vshape, lview, offs, kv in descs:
                leading = [range(o, o + n) for o, n in zip(offs[:kv], lview[:kv])]
                for idx in _product(leading):
                    key = (name, idx)
                    m = self.matrices.get(key)
                    if m is None:
                        m = self.matrices[key] = _Matrix(key, (gshape[-2], gshape[-1]), tuple(vshape[kv:]))
                    size, ranks = m.blocks.setdefault(tuple(offs[kv:]), (tuple(lview[kv:]), []))
                    ranks.append(rank)
        self._assign()
        self._schedule()

    # ------------------------------------------------------------------ plan
    def _assign(self) -> None:
        """Owners: largest matrices first, each to its least-loaded holder; block senders spread likewise."""
        load = {r: 0.0 for r in self.group.ranks}
        sent = {r: 0 for r in self.group.ranks}
        order = sorted(self.matrices.values(), key=lambda m: (-math.prod(m.shape) * min(m.shape), m.key))
        for m in order:
            holders = sorted({r for _, ranks in m.blocks.values() for r in ranks})
            m.owner = min(holders, key=lambda r: (load[r], r))
            load[m.owner] += math.prod(m.shape) * min(m.shape)
            for offs, (size, ranks) in m.blocks.items():
                if m.owner in ranks:
                    m.sender[offs] = m.owner
                else:
                    m.sender[offs] = min(ranks, key=lambda r: (sent[r], r))
                    sent[m.sender[offs]] += math.prod(size)
        self.order = sorted(self.matrices)  # the exchange order every rank uses

    def _schedule(self) -> None:
        """Split sizes of both exchanges (elements per peer, in group order), fixed for the run."""
        index = {r: i for i, r in enumerate(self.group.ranks)}
        n = self.group.size
        self.gather_send, self.gather_recv = [0] * n, [0] * n
        self.scatter_send, self.scatter_recv = [0] * n, [0] * n
        for key in self.order:
            m = self.matrices[key]
            for offs, (size, ranks) in sorted(m.blocks.items()):
                numel = math.prod(size)
                s = m.sender[offs]
                if s != m.owner:
                    if s == self.me:
                        self.gather_send[index[m.owner]] += numel
                    if m.owner == self.me:
                        self.gather_recv[index[s]] += numel
                for r in ranks:
                    if r == m.owner:
                        continue
                    if m.owner == self.me:
                        self.scatter_send[index[r]] += numel
                    if r == self.me:
                        self.scatter_recv[index[m.owner]] += numel

    def owned(self) -> list[tuple]:
        """Keys of the matrices this rank orthogonalises."""
        return [k for k in self.order if self.matrices[k].owner == self.me]

    # ------------------------------------------------------------------ step
    def _block(self, name: str, idx: tuple, t: torch.Tensor) -> torch.Tensor:
        """This rank's block of matrix (name, idx), viewed in the matrix's view coordinates."""
        _, _, _, lview, offs, kv = self.local[name]
        v = t.reshape(lview)
        return v[tuple(i - o for i, o in zip(idx, offs[:kv]))]

    @torch.no_grad()
    def orthogonalize(self, updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scaled Newton-Schulz of every matrix, from this rank's local (fp32) updates; same shapes back.

        `updates[name]` is the local tensor of parameter `name` (the whole TP/EP-local tensor).
        The result is the orthogonalised update scaled by 0.2 * sqrt(max(rows, cols)) of the global
        matrix, cut to this rank's blocks.
        """
        index = {r: i for i, r in enumerate(self.group.ranks)}
        any_t = next(iter(updates.values()))
        dev, dtype = any_t.device, torch.float32
        peers = range(self.group.size)
        # 1. blocks to their owners
        out_parts: list[list[torch.Tensor]] = [[] for _ in peers]
        full: dict[tuple, torch.Tensor] = {}
        for key in self.order:
            m = self.matrices[key]
            name, idx = key
            if m.owner == self.me:
                full[key] = torch.zeros(m.view, dtype=dtype, device=dev)
            for offs, (size, _ranks) in sorted(m.blocks.items()):
                if m.sender[offs] != self.me:
                    continue
                block = self._block(name, idx, updates[name]).to(dtype)
                if m.owner == self.me:
                    full[key][_slices(offs, size)] = block
                else:
                    out_parts[index[m.owner]].append(block.reshape(-1))
        recv = self._exchange(out_parts, self.gather_send, self.gather_recv, dev)
        cursor = [0] * self.group.size
        for key in self.order:
            m = self.matrices[key]
            if m.owner != self.me:
                continue
            for offs, (size, _ranks) in sorted(m.blocks.items()):
                s = m.sender[offs]
                if s == self.me:
                    continue
                i, n = index[s], math.prod(size)
                full[key][_slices(offs, size)] = recv[i][cursor[i] : cursor[i] + n].view(size)
                cursor[i] += n
        # 2. Newton-Schulz on the owned matrices, batched by shape
        result: dict[tuple, torch.Tensor] = {}
        by_shape: dict[tuple, list[tuple]] = {}
        for key in full:
            by_shape.setdefault(self.matrices[key].shape, []).append(key)
        for shape, keys in by_shape.items():
            stack = torch.stack([full[k].reshape(shape) for k in keys])
            o = newton_schulz(stack, self.ns_steps) * (0.2 * math.sqrt(max(shape)))
            for k, t in zip(keys, o.unbind(0)):
                result[k] = t.reshape(self.matrices[k].view)
        # 3. result blocks to every holder
        out_parts = [[] for _ in peers]
        outputs = {name: torch.empty(updates[name].shape, dtype=dtype, device=dev) for name in updates}
        for key in self.order:
            m = self.matrices[key]
            if m.owner != self.me:
                continue
            name, idx = key
            for offs, (size, ranks) in sorted(m.blocks.items()):
                block = result[key][_slices(offs, size)]
                for r in ranks:
                    if r == self.me:
                        self._block(name, idx, outputs[name]).copy_(block)
                    else:
                        out_parts[index[r]].append(block.reshape(-1))
        recv = self._exchange(out_parts, self.scatter_send, self.scatter_recv, dev)
        cursor = [0] * self.group.size
        for key in self.order:
            m = self.matrices[key]
            name, idx = key
            if m.owner == self.me or name not in updates:
                continue
            for _offs, (size, ranks) in sorted(m.blocks.items()):
                if self.me not in ranks:
                    continue
                i, n = index[m.owner], math.prod(size)
                self._block(name, idx, outputs[name]).copy_(recv[i][cursor[i] : cursor[i] + n].view(size))
                cursor[i] += n
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


def _product(ranges: list[range]) -> list[tuple]:
    out: list[tuple] = [()]
    for r in ranges:
        out = [t + (i,) for t in out for i in r]
    return out


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
