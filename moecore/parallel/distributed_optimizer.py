"""Distributed optimizer (ZeRO-1): each data-parallel rank keeps AdamW state for 1/dp of the parameters.

`DistributedOptimizer(model, optimizer, dims)` takes the AdamW built for the whole model (its
parameter groups and hyper-parameters; it must hold no state yet) and re-creates it over shards:

- Parameters are split by reduction domain: dense ones are replicated over the `dp_cp` group,
  expert ones (ShardSpec kind `expert`) over the `edp` group. For every (parameter group, domain)
  the local parameters are laid end to end in a flat buffer of N elements, padded to a multiple of
  the domain group's size g; rank r owns elements [r * N/g, (r+1) * N/g) and keeps them as one fp32
  tensor (its master shard) with the AdamW moments of those elements only.
- `step()`: gradients are already all-reduced (mean over replicas) and clipped by the usual
  `GradReducer` / `clip_grad_norm_`, so every replica holds the same full gradient; each rank slices
  its shard's gradient, the inner AdamW steps the shard (AdamW is element-wise, so a shard's update
  equals the same elements of the whole-tensor update), and the shards are all-gathered over the
  domain group and written back into the parameters.
- A domain group of size 1 (e.g. experts when edp = 1) is not sharded: those parameters stay in the
  inner AdamW as they are (so a parameter without a gradient is skipped, as in one process).

The padding tail of the last shard has zero parameters and zero gradients; AdamW leaves it at zero.
`zero_grad` clears the model's gradients; `param_groups` are the inner groups (LR schedules reach
them). `state_dict` is this rank's inner state plus a layout signature; `load_state_dict` refuses
a state saved under another layout (ConfigError), because the shards' boundaries depend on it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moecore.config import ConfigError
from moecore.parallel.dims import Group, ParallelDims
from moecore.parallel.sharding import get_shard


@dataclass
class _FlatShard:
    params: list[torch.nn.Parameter]
    group: Group
    numel: int  # N, the unpadded length
    shard_size: int  # N padded to a multiple of group.size, / group.size
    shard: torch.Tensor  # this rank's fp32 elements [rank * shard_size, (rank + 1) * shard_size)

    @property
    def lo(self) -> int:
        return self.group.rank * self.shard_size


class DistributedOptimizer:
    """AdamW over data-parallel shards of the parameters; see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims) -> None:
        if not isinstance(optimizer, torch.optim.AdamW) or optimizer.state:
            raise ConfigError("parallel.distributed_optimizer=true needs a fresh optim.name='adamw' optimizer")
        self.dims = dims
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.flats: list[_FlatShard] = []
        inner_groups = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            domains: dict[str, list[torch.nn.Parameter]] = {"dense": [], "expert": []}
            for p in group["params"]:
                domains["expert" if get_shard(p).kind == "expert" else "dense"].append(p)
            for domain, params in domains.items():
                if not params:
                    continue
                pg = dims.edp_group if domain == "expert" else dims.dp_cp_group
                if pg.size == 1:
                    inner_groups.append({**hyper, "params": params})
                    continue
                flat = self._make_flat(params, pg)
                self.flats.append(flat)
                inner_groups.append({**hyper, "params": [flat.shard]})
        keep = inspect.signature(torch.optim.AdamW.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in keep}
        self.inner = torch.optim.AdamW(inner_groups, **defaults)

    @staticmethod
    def _make_flat(params: list[torch.nn.Parameter], group: Group) -> _FlatShard:
        n = sum(p.numel() for p in params)
        size = -(-n // group.size)
        shard = torch.zeros(size, dtype=torch.float32, device=params[0].device)
        flat = _FlatShard(params, group, n, size, shard)
        return flat

    # ------------------------------------------------------------------ helpers
    def _local_slice(self, flat: _FlatShard, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """This rank's elements of the concatenation of `tensors` (None counts as zeros), fp32, zero-padded."""
        out = torch.zeros(flat.shard_size, dtype=torch.float32, device=flat.shard.device)
        lo, hi = flat.lo, flat.lo + flat.shard_size
        off = 0
        for p, t in zip(flat.params, tensors):
            n = p.numel()
            a, b = max(lo, off), min(hi, off + n)  # overlap of this parameter with the shard
            if a < b and t is not None:
                out[a - lo : b - lo] = t.detach().reshape(-1)[a - off : b - off]
            off += n
        return out

    @torch.no_grad()
    def _write_back(self, flat: _FlatShard) -> None:
        """All-gather the updated shards over the domain group and copy them into the parameters."""
        parts = [torch.empty_like(flat.shard) for _ in range(flat.group.size)]
        dist.all_gather(parts, flat.shard, group=flat.group.pg)
        full = torch.cat(parts)
        off = 0
        for p in flat.params:
            n = p.numel()
            p.copy_(full[off : off + n].view_as(p))
            off += n

    # ------------------------------------------------------------------ optimizer interface
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for flat in self.flats:
            # Refresh the master shard from the parameters (they may have been loaded since the last step).
            flat.shard.copy_(self._local_slice(flat, list(flat.params)))
            flat.shard.grad = self._local_slice(flat, [p.grad for p in flat.params])
        self.inner.step()
        for flat in self.flats:
            flat.shard.grad = None
            self._write_back(flat)

    def layout_signature(self) -> dict:
        d = self.dims
        return {
            "world": d.world_size,
            "dp": d.dp,
            "tp": d.tp,
            "ep": d.ep,
            "etp": d.etp,
            "flats": [(f.numel, f.group.size) for f in self.flats],
        }

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "layout": self.layout_signature()}

    def load_state_dict(self, state: dict) -> None:
        saved, mine = state.get("layout"), self.layout_signature()
        if saved != mine:

            def show(sig: dict | None) -> str:
                return "?" if sig is None else " ".join(f"{k}={sig[k]}" for k in ("world", "dp", "tp", "ep", "etp"))

            raise ConfigError(
                f"checkpoint.resume is invalid: the distributed optimizer state was saved under {show(saved)}, "
                f"this run is {show(mine)}; resume under the layout it was saved with"
            )
        self.inner.load_state_dict(state["inner"])

    def shard_numel(self) -> int:
        """Elements of every moment tensor this rank keeps (exp_avg; exp_avg_sq is the same size)."""
        return sum(int(s["exp_avg"].numel()) for s in self.inner.state.values() if "exp_avg" in s)
