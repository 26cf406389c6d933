"""Distributed optimizer (ZeRO-1/2): gradients reduce-scattered in buckets, each rank updating only its shard.

`DistributedOptimizer(model, optimizer, dims, grad_sync, mixed)` takes the AdamW built for the whole
model (its parameter groups and hyper-parameters; it must hold no state yet) and re-creates it over
shards of the gradient buckets of `GradSync` (moecore.parallel.data_parallel), switched to sharded mode:

- Buckets never mix reduction domains (dense parameters over `dp_cp`, expert parameters over `edp`)
  nor optimizer parameter groups. A bucket's flat gradient (N elements, padded to a multiple of the
  group size g) is reduce-scattered from the backward hooks (overlapped with the rest of backward
  when `parallel.overlap_grad_reduce`); rank i of the group gets elements [i * N/g, (i + 1) * N/g).
- For each bucket the rank keeps one fp32 tensor of its N/g elements: the master shard. The inner
  `torch.optim.AdamW` steps the master shards (AdamW is element-wise, so a shard's update equals the
  same elements of the whole-tensor update; the zero padding stays zero), and the updated shards are
  all-gathered over the group and written into the parameters. Under `train.precision=bf16` (and fp8) a
  bucket's shards are rounded to bf16 before the gather, as the parameters would round them after it:
  2 bytes per element on the wire instead of 4 (a bucket mixing dtypes, e.g. with an fp32 router, gathers
  fp32). The all-gathers are launched at the end of `step()` and finished by
  forward pre-hooks (each decoder layer waits for its own buckets), so they overlap the next
  forward; `wait_for_params()` finishes them all for anything that reads the weights otherwise
  (the checkpoint path calls it). With bf16 the full fp32 masters of `MixedPrecision` are dropped once the
  shards are cut from them: the master shard is the only fp32 copy of a weight. FP8 primary weights
  (`fp8.primary_weights`) hold no bf16 values: the gathered weights (bf16-rounded, as their rebuild rounds
  them first) are quantised into their FP8 copies instead of written into them; those with one FP8 copy
  (tensorwise, blockwise) sit in buckets of their own and are gathered as FP8 bytes (1 byte per element;
  `fp8_gather.py`).
- Per rank this keeps 12 / g bytes of optimizer state per parameter (fp32 master + two fp32 moments)
  instead of 8 (fp32 training: moments only) or 12 (bf16: master + moments); with
  `optim.state_dtype=bf16` the moments are bf16 (8 / g bytes) and the update is `FusedAdamW`'s
  (fp32 arithmetic on the fp32 master shard, moments rounded to bf16).
- The gradient norm is computed from the shards (each element weighted by how many ranks hold the
  same shard) and clipping scales the shards.

Checkpoints are layout-free: `state_dict()` all-gathers each bucket's moments over its group and
returns them per parameter, shaped like the local parameter and keyed by its name, in the format of
`torch.distributed.checkpoint.state_dict.get_state_dict` for `torch.optim.AdamW`. The checkpoint code
saves that like any optimizer's state (sharded TP/EP parameters as chunks of their global tensors),
so a checkpoint written with the distributed optimizer resumes under any other layout, with or
without it, and the reverse. The gather materialises the moments of this rank's local parameters
(8 bytes per parameter) for the duration of a save or a load.

A parameter that receives no gradient in a step is stepped with a zero gradient (its moments decay;
weight decay applies), where torch's AdamW would skip it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Collection, Iterator

import torch
import torch.distributed as dist

from moecore.config import ConfigError
from moecore.parallel.comm import _all_gather_single
from moecore.parallel.data_parallel import GradSync, _Bucket, squared_norm, wrap_model_for_data_parallel
from moecore.parallel.dims import ParallelDims
from moecore.parallel.fp8_gather import fp8_bucket_params, quantize_shard, set_gathered
from moecore.parallel.sharding import get_shard, replication_factor

_MOMENTS = ("exp_avg", "exp_avg_sq")
_MUON = "momentum_buffer"


class DistributedOptimizer:
    """AdamW over data-parallel shards of the gradient buckets; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dims: ParallelDims,
        grad_sync: GradSync | None = None,
        mixed=None,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        from moecore.optim.muon import Muon

        muon = None
        if hasattr(optimizer, "optimizers"):  # optim.name=muon: build_muon's [Muon, AdamW]
            muon, optimizer = optimizer.optimizers
            if not isinstance(muon, Muon) or muon.state:
                raise ConfigError("parallel.distributed_optimizer=true needs a fresh Muon + AdamW optimizer")
        if not isinstance(optimizer, torch.optim.AdamW) or optimizer.state:
            raise ConfigError("parallel.distributed_optimizer=true needs a fresh optim.name='adamw' optimizer")
        muon_groups = muon.param_groups if muon is not None else []
        self.orthogonalize = muon.orthogonalize if muon is not None else None
        self.n_muon = len(muon_groups)  # groups [0, n_muon) are Muon's, the rest AdamW's
        all_groups = list(muon_groups) + list(optimizer.param_groups)
        self.dims = dims
        self.mixed = mixed  # moecore.optim.mixed_precision.MixedPrecision under bf16
        self.grad_scale = 1.0  # the clipping coefficient for the next step (set by clip_grad_norm)
        names = {p: n for n, p in model.named_parameters()}
        self.params = [p for g in all_groups for p in g["params"]]
        group_of = {p: i for i, g in enumerate(all_groups) for p in g["params"]}
        self.group_names = [[names[p] for p in g["params"]] for g in all_groups]
        self.names = names
        if grad_sync is None:
            grad_sync = getattr(model, "_moecore_grad_sync", None) or wrap_model_for_data_parallel(model, dims)
        self.sync = grad_sync
        fp8_params = fp8_bucket_params(self.params)  # weights of one-byte FP8 recipes: buckets of their own
        self.buckets: list[_Bucket] = grad_sync.shard_for_optimizer(group_of, apart=fp8_params)
        # those holding FP8 primary weights are gathered as FP8 bytes (fp8_gather.py)
        self.fp8_buckets = {
            i for i, b in enumerate(self.buckets) if b.params[0] in fp8_params and hasattr(b.params[0], "fp8_primary")
        }
        masters = mixed.masters if mixed is not None else {}
        self.master: dict[int, torch.Tensor] = {}  # bucket index -> this rank's fp32 master shard
        for i, b in enumerate(self.buckets):
            self.master[i] = torch.zeros(b.shard_size, dtype=torch.float32, device=b.params[0].device)
            self._refresh_master(i, [masters.get(p, p) for p in b.params])
        # One inner group per optimizer group, holding the master shards of that group's buckets.
        inner_groups = []
        for gi, group in enumerate(all_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            shards = [self.master[i] for i, b in enumerate(self.buckets) if b.opt_group == gi]
            inner_groups.append({**hyper, "params": shards})
        # Muon's groups are stepped here (`_muon_step`), AdamW's by the inner torch optimizer.
        self.muon_groups = {gi: inner_groups[gi] for gi in range(self.n_muon)}
        self.momentum = {
            i: torch.zeros_like(self.master[i]) for i, b in enumerate(self.buckets) if b.opt_group < self.n_muon
        }
        inner_groups = [g if gi >= self.n_muon else {**g, "params": []} for gi, g in enumerate(inner_groups)]
        groups = [g for g in inner_groups if g["params"]]
        self.state_dtype = state_dtype
        if state_dtype == torch.float32:
            keep = inspect.signature(torch.optim.AdamW.__init__).parameters
            self.inner = torch.optim.AdamW(groups, **{k: v for k, v in optimizer.defaults.items() if k in keep})
        else:  # moments in bf16: the fused update (fp32 arithmetic, moments rounded) on the fp32 master shards
            from moecore.optim.fused_adamw import FusedAdamW

            keep = ("lr", "betas", "eps", "weight_decay")
            defaults = {k: v for k, v in optimizer.defaults.items() if k in keep}
            self.inner = FusedAdamW(groups, None, state_dtype=state_dtype, **defaults)
        self._inner_index = [gi for gi, g in enumerate(inner_groups) if g["params"]]
        if mixed is not None:
            mixed.masters.clear()  # the master shards are now the only fp32 copy of the weights
        # bucket -> (all-gather or None, result[, the gathered shard[, FP8 scales per weight: an FP8 gather]])
        self._pending: dict[int, tuple] = {}
        self._hook_forward(model)

    # ------------------------------------------------------------------ helpers
    @torch.no_grad()
    def _refresh_master(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Copy this rank's elements of the concatenation of `tensors` (bucket i's params) into its master shard."""
        b, m = self.buckets[i], self.master[i]
        by_id = {id(p): t for p, t in zip(b.params, tensors)}
        for p, off, a, e in b.overlaps():
            t = by_id[id(p)]
            m[a - b.lo : e - b.lo].copy_(t.detach().reshape(-1)[a - off : e - off])

    def _gather(self, b: _Bucket, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat bucket (padded) from every rank's shard."""
        if b.group.size == 1:
            return shard
        full = shard.new_empty(b.shard_size * b.group.size)
        _all_gather_single(full, shard.contiguous(), group=b.group.pg)
        return full

    def _per_param(self, b: _Bucket, full: torch.Tensor) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        off = 0
        for p in b.params:
            n = p.numel()
            yield p, full[off : off + n].view(p.shape)
            off += n

    def _hook_forward(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks that finish the parameter all-gathers a module needs, just before it runs.

        Each decoder layer (`model.layers`) waits for the buckets holding its parameters; the model's
        own hook waits for those of every other parameter (embeddings, final norm, head). So the
        all-gathers launched at the end of a step overlap the next forward's first layers.
        """
        bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}

        def needs(params) -> list[int]:
            return sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of})

        layers = list(getattr(model, "layers", []))
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        rest = needs(p for p in model.parameters() if id(p) not in in_layers)
        self._outside_layers = rest
        self._hooks = [model.register_forward_pre_hook(lambda m, a, n=rest: self._wait(n))]
        for layer in layers:
            n = needs(layer.parameters())
            self._hooks.append(layer.register_forward_pre_hook(lambda m, a, n=n: self._wait(n)))

    @torch.no_grad()
    def _wait(self, indices: list[int]) -> None:
        """Finish the pending all-gathers of these buckets and write them into the parameters."""
        for i in indices:
            pending = self._pending.pop(i, None)
            if pending is None:
                continue
            work, full = pending[:2]
            if work is not None:
                work.wait()
            pairs = list(self._per_param(self.buckets[i], full))
            if len(pending) == 4:  # FP8 bytes of one-byte FP8 primary weights
                for p, t in pairs:
                    set_gathered(p, t, pending[3][p])
                continue
            recast = self._recast()
            for p, t in pairs:  # FP8 primary weights: quantised from the gathered fp32 master, no bf16 copy kept
                if p in recast:
                    recast[p](t)
            pairs = [(p, t) for p, t in pairs if p not in recast]
            if pairs:
                torch._foreach_copy_([p.data for p, _ in pairs], [t for _, t in pairs])

    def _recast(self) -> dict:
        """MixedPrecision.recast: the FP8 primary weights' rebuild functions (moecore/models/fp8.py), or {}."""
        return self.mixed.recast if self.mixed is not None else {}

    def wait_for_params(self) -> None:
        """Make every parameter hold its updated value (before reading the weights outside a forward)."""
        self._wait(sorted(self._pending))

    def wait_for_params_outside_layers(self) -> None:
        """What the model's own forward pre-hook waits for (embeddings, final norm, head, MTP), for callers that
        run those modules without the model's forward (pipeline stages); the decoder layers keep their hooks."""
        self._wait(self._outside_layers)

    @torch.no_grad()
    def _write_back(self) -> None:
        """Launch the all-gathers of the updated master shards (forward order); the forward hooks finish them.

        A bucket whose parameters share a dtype narrower than fp32 (bf16 training; FP8 primary weights, whose
        placeholders are bf16 and whose rebuild rounds to bf16 first) gathers its shards rounded to that dtype:
        half the bytes of an fp32 gather and the same values, since the parameters would round them anyway.
        The 16-bit values travel as bytes (every backend gathers those)."""
        for i in reversed(range(len(self.buckets))):
            b = self.buckets[i]
            if b.group.size == 1:
                self._pending[i] = (None, self.master[i])
                continue
            if i in self.fp8_buckets:  # FP8 bytes and their scales (one small all-reduce first)
                q, scales = quantize_shard(b.params, b.lo, self.master[i], b.group)
                full = q.new_empty(b.shard_size * b.group.size)
                work = _all_gather_single(full, q, group=b.group.pg, async_op=True)
                self._pending[i] = (work, full, q, scales)
                continue
            dtype = self._gather_dtype(b)
            shard = self.master[i] if dtype == torch.float32 else self.master[i].to(dtype)
            full = shard.new_empty(b.shard_size * b.group.size)
            raw = torch.uint8 if dtype != torch.float32 else dtype  # bytes: gloo gathers no 16-bit integers
            work = _all_gather_single(full.view(raw), shard.view(raw), group=b.group.pg, async_op=True)
            self._pending[i] = (work, full, shard)  # the shard stays alive until the gather is finished

    @staticmethod
    def _gather_dtype(b: _Bucket) -> torch.dtype:
        """The dtype bucket b's updated weights travel in: its parameters' own where they agree, else fp32."""
        dtypes = {p.dtype for p in b.params}
        return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)).is_floating_point else torch.float32

    # ------------------------------------------------------------------ optimizer interface
    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon_groups.values(), *self.inner.param_groups]

    def _hyper(self, gi: int) -> dict:
        """The hyper-parameters of original optimizer group `gi` (as the LR schedule last set them)."""
        if gi in self.muon_groups:
            group = self.muon_groups[gi]
        elif gi in self._inner_index:
            group = self.inner.param_groups[self._inner_index.index(gi)]
        else:
            return {}
        return {k: v for k, v in group.items() if k != "params"}

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.mixed is not None:
            self.mixed.zero_grad()
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.shard_grad = None
        self.inner.zero_grad(set_to_none=True)

    def expose_shard_grads(self) -> None:
        """Give each master shard its bucket's reduced gradient as `.grad` (the same tensor), so that code working on
        an optimizer's parameters sees the gradients this rank steps: fp16's `GradScaler.unscale_` unscales them in
        place, and `clip_grad_norm` / `step` then read the unscaled shards."""
        for i, b in enumerate(self._ready_buckets()):
            self.master[i].grad = b.shard_grad

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, uncounted: Collection[int] = ()) -> torch.Tensor:
        """Global L2 norm of the (reduced, sharded) gradient, every element counted once; scale to max_norm.

        `uncounted`: ids of parameters left out (under pipeline parallel, the copies of a weight shared by several
        stages that another stage counts)."""
        dev = self.master[0].device if self.master else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for b in self._ready_buckets():
            g = b.group.size
            for p, _, a, e in b.overlaps():
                if id(p) in uncounted:
                    continue
                # Ranks holding this same shard element: the parameter's copies, divided among g shards.
                copies = replication_factor(get_shard(p), self.dims) // g
                total += squared_norm(b.shard_grad[a - b.lo : e - b.lo]) / copies
        if self.dims.world_group.size > 1:
            dist.all_reduce(total, group=self.dims.world_group.pg)
        norm = total.sqrt().float()
        if max_norm > 0:
            self.grad_scale = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _ready_buckets(self) -> list[_Bucket]:
        missing = [b for b in self.buckets if b.shard_grad is None]
        if missing:
            raise RuntimeError("the distributed optimizer needs GradSync.finish_grad_sync() before it steps")
        return self.buckets

    @torch.no_grad()
    def step(self, closure=None) -> None:
        scale, self.grad_scale = self.grad_scale, 1.0
        self.wait_for_params()
        for i, b in enumerate(self._ready_buckets()):
            self.master[i].grad = b.shard_grad if scale == 1.0 else b.shard_grad.mul_(scale)
        self.inner.step()
        if self.n_muon:
            self._muon_step()
        for i in self.master:
            self.master[i].grad = None
        self._write_back()

    @torch.no_grad()
    def _muon_step(self) -> None:
        """Muon on the master shards: momentum per shard, whole updates gathered, orthogonalised, own shard kept.

        Momentum and the Nesterov update are element-wise, so they run on this rank's shard (1/g of the
        state). The update of each bucket is all-gathered over its group (every rank then has its local
        parameters' whole updates), `orthogonalize` (moecore.parallel.distributed_muon) orthogonalises
        every matrix once over the stage, and each rank applies its own elements to its master shard.
        """
        from moecore.optim.muon import newton_schulz

        mine = [i for i, b in enumerate(self.buckets) if b.opt_group < self.n_muon]
        params, updates = [], []
        for i in mine:
            b, hyper = self.buckets[i], self.muon_groups[self.buckets[i].opt_group]
            g, buf = self.master[i].grad, self.momentum[i]
            buf.mul_(hyper["momentum"]).add_(g)
            u = g.add(buf, alpha=hyper["momentum"])  # Nesterov
            for p, t in self._per_param(b, self._gather(b, u)):
                params.append(p)
                updates.append(t)
        if self.orthogonalize is not None:
            done = self.orthogonalize(params, updates)
        else:  # every matrix is whole here (a one-rank stage)
            ns = self.muon_groups[0]["ns_steps"]
            done = [
                newton_schulz(u, ns) * (0.2 * math.sqrt(max(p.shape[-2], p.shape[-1]))) for p, u in zip(params, updates)
            ]
        result = dict(zip(map(id, params), done))
        for i in mine:
            b, hyper = self.buckets[i], self.muon_groups[self.buckets[i].opt_group]
            flat = torch.zeros(b.shard_size * b.group.size, dtype=torch.float32, device=self.master[i].device)
            off = 0
            for p in b.params:
                flat[off : off + p.numel()] = result[id(p)].reshape(-1)
                off += p.numel()
            m = self.master[i]
            m.mul_(1 - hyper["lr"] * hyper["weight_decay"])
            m.add_(flat[b.lo : b.lo + b.shard_size], alpha=-hyper["lr"])

    # ------------------------------------------------------------------ weights for checkpoints
    @contextlib.contextmanager
    def master_weights_in_model(self) -> Iterator[None]:
        """Parameters hold fp32 weights inside the block (gathered from the master shards under bf16).

        On exit the master shards are re-cut from the parameters (which a checkpoint load may have
        replaced) and, under bf16, the parameters get their bf16 tensors back, rounded from them.
        """
        lent: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.wait_for_params()
        try:
            if self.mixed is not None:
                for i, b in enumerate(self.buckets):
                    for p, t in self._per_param(b, self._gather(b, self.master[i])):
                        if p.dtype != torch.float32:
                            lent[p] = p.data
                            p.data = t.clone()
            yield
        finally:
            with torch.no_grad():
                self._refresh_all()
                recast = self._recast()
                for p, data in lent.items():
                    full, p.data = p.data, data  # the parameter's own tensor back first: rebuilds round to its dtype
                    if p in recast:  # an FP8 primary weight: re-quantised from the fp32 values
                        recast[p](full)
                    else:
                        data.copy_(full)

    def _refresh_all(self) -> None:
        for i, b in enumerate(self.buckets):
            self._refresh_master(i, list(b.params))

    # ------------------------------------------------------------------ layout-free state
    def state_dict(self, flat: bool = False) -> dict:
        """The AdamW state per parameter (local shapes, keyed by name): `get_state_dict`'s format; collective.

        `flat`: its flattened form ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"), what
        `StateDictOptions(flatten_optimizer_state_dict=True)` gives for torch's AdamW.
        """
        self.wait_for_params()  # the model's state dict is read next
        state: dict[str, dict] = {}
        for i, b in enumerate(self.buckets):
            if i in self.momentum:  # Muon: the momentum buffer, as torch's state dict of Muon names it
                for p, t in self._per_param(b, self._gather(b, self.momentum[i])):
                    state[self.names[p]] = {_MUON: t.clone()}
                continue
            st = self.inner.state.get(self.master[i], {})
            step = st.get("step", torch.zeros((), dtype=torch.float32))
            moments = {}
            for key in _MOMENTS:
                shard = st[key] if key in st else torch.zeros_like(self.master[i], dtype=self.state_dtype)
                moments[key] = dict(self._per_param(b, self._gather(b, shard)))
            for p in b.params:
                state[self.names[p]] = {"step": step.clone(), **{k: moments[k][p].clone() for k in _MOMENTS}}
        groups = []
        for gi, fqns in enumerate(self.group_names):
            groups.append({**self._hyper(gi), "params": list(fqns)})
        if not flat:
            return {"state": state, "param_groups": groups}
        out = {f"state.{fqn}.{k}": v for fqn, st in state.items() for k, v in st.items()}
        for g in groups:
            out.update({f"param_groups.{fqn}.{k}": v for fqn in g["params"] for k, v in g.items() if k != "params"})
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Cut this rank's shards out of a per-parameter AdamW state (`state_dict()`'s format, any layout saved it)."""
        if "state" not in state_dict:  # the flattened form
            state_dict = self._unflatten(state_dict)
        state = state_dict["state"]
        self._pending.clear()  # the weights were just loaded: nothing older may overwrite them
        self.inner.state.clear()
        for i, b in enumerate(self.buckets):
            m = self.master[i]
            if i in self.momentum:
                for p, off, a, e in b.overlaps():
                    self.momentum[i][a - b.lo : e - b.lo] = state[self.names[p]][_MUON].reshape(-1)[a - off : e - off]
                continue
            st = {"step": torch.as_tensor(state[self.names[b.params[0]]]["step"], dtype=torch.float32).clone()}
            for key in _MOMENTS:
                shard = torch.zeros_like(m, dtype=self.state_dtype)
                for p, off, a, e in b.overlaps():
                    shard[a - b.lo : e - b.lo] = state[self.names[p]][key].reshape(-1)[a - off : e - off]
                st[key] = shard
            self.inner.state[m] = st
        for gi, saved in enumerate(state_dict.get("param_groups", [])):
            if gi in self.muon_groups:
                self.muon_groups[gi].update({k: v for k, v in saved.items() if k != "params"})
            elif gi in self._inner_index:
                group = self.inner.param_groups[self._inner_index.index(gi)]
                group.update({k: v for k, v in saved.items() if k != "params"})
        self._refresh_all()  # the weights were loaded just before (fp32 in master_weights_in_model)

    def _unflatten(self, flat: dict) -> dict:
        state = {
            fqn: {k: flat[f"state.{fqn}.{k}"] for k in ((_MUON,) if gi < self.n_muon else ("step", *_MOMENTS))}
            for gi, fqns in enumerate(self.group_names)
            for fqn in fqns
        }
        groups = []
        for fqns in self.group_names:
            prefix = f"param_groups.{fqns[0]}." if fqns else None
            hyper = {k[len(prefix) :]: v for k, v in flat.items() if prefix and k.startswith(prefix)}
            groups.append({**hyper, "params": list(fqns)})
        return {"state": state, "param_groups": groups}

    # ------------------------------------------------------------------ memory
    def shard_numel(self) -> int:
        """Elements of every moment tensor this rank keeps (exp_avg; exp_avg_sq is the same size)."""
        return sum(int(m.numel()) for m in self.master.values())

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this optimizer holds, by kind: reduced gradient shards; master shards and moments."""
        optim = list(self.master.values()) + [t for s in self.inner.state.values() for t in s.values()]
        optim += list(self.momentum.values())
        grads = [b.shard_grad for b in self.buckets if b.shard_grad is not None]
        return {"grads": grads, "optim": optim}
