"""parallel.fsdp: parameters, gradients and optimizer state sharded over data parallel with torch's FSDP2.

`FullyShardedModel(model, dims, param_dtype)` applies `torch.distributed.fsdp.fully_shard` in place:

- every `GroupedExperts` module (the experts' `w13`, `w2`) on a mesh over the `edp` group, with the
  gradient divided by dp x cp instead of edp (an expert's gradient is a sum over the tokens its EP
  peers routed to it: summing over edp and dividing by the number of replicas gives the mean the
  dense parameters get — the same rule as `GradSync`);
- then every decoder layer, and the model itself (embeddings, final norm, head, what is left), on a
  mesh over `dp_cp`; FSDP2 all-gathers a layer's parameters before its forward (prefetching the
  next) and reduce-scatters its gradients during backward. Where some parameters are frozen (DSA's
  dense_warmup), the trainable modules inside a layer (the lightning indexers) are units of their own first
  (`trainable_islands`): the layer's output carries no gradient there, and FSDP2 gathers a unit again for
  backward from a hook on its output.

Parameters become DTensors sharded along dim 0 over their mesh; their `ShardSpec` (how the
EP-local tensor sits in the global one) is attached again to the new parameters. The optimizer is
torch's AdamW over those DTensors (or `FusedAdamW` on their local shards for bf16 states): the state
is sharded like them. Under `train.precision=bf16` with `optim.master_weights=fp32` the sharded
parameters stay fp32 (they are the master weights) and FSDP2's mixed-precision policy all-gathers
them in bf16 and reduces gradients in fp32; with `optim.master_weights=bf16` the sharded parameters
are bf16 themselves (no fp32 copy anywhere), all-gathered as they are, gradients reduced in fp32
(`reduce_dtype`) and the update applied in fp32 arithmetic by `FusedAdamW`. moecore's own
`MixedPrecision` is not used with FSDP.

This object takes the gradient reducer's role in the runtime: `no_sync()` (gradient accumulation),
`finish()` (FSDP2 finishes its reductions at the end of backward; `tp_partial` gradients — norms
under sequence parallel, the router — are then summed over tp), and `clip_grad_norm(max_norm)`
from the local gradient shards, each weighted by the number of ranks holding the same element
(tp peers for replicated parameters, one rank for TP and expert shards). Checkpoints: `moecore.parallel.sharding.wrap_for_checkpoint`
saves a DTensor of an EP-sharded parameter as its chunk of the global tensor, so the files are
layout-free as without FSDP.

Supported: tp, dp, cp (the dense mesh is dp x cp; each cp rank's gradient is its share of the whole
sequences'), ep / etp with edp > 1, and pp under every schedule (`roots`: each stage module is a root, which
torch's PipelineStage drives: gradient sync off in each micro-batch's backward passes, the input-gradient and
weight passes of the zero-bubble and V schedules included, and one reduce-scatter after the last). On one
process (`moecore train` without torchrun) the run initialises a one-rank process group
(`moecore.parallel.dims.init_distributed`) and FSDP2 runs over a one-rank mesh: nothing is split, but
parameters, gradients and optimizer state are the DTensors and the all-gather / reduce-scatter calls are
those of a multi-GPU run, so its cost and its checkpoints can be checked on one GPU.
Muon runs on the sharded parameters: each matrix's update is gathered over the FSDP mesh and
orthogonalised once (`moecore.parallel.distributed_muon`). With FP8 primary weights (`fp8_gather=True`, the
tensorwise and blockwise recipes) the FP8 GEMMs' weights are all-gathered as their FP8 copy
(`moecore.parallel.fsdp_fp8`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from moecore.config import ConfigError
from moecore.parallel.data_parallel import squared_norm
from moecore.parallel.dims import ParallelDims
from moecore.parallel.sharding import _ATTR, get_shard, replication_factor


def trainable_islands(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest submodules whose parameters all train inside modules that also hold frozen ones (none when
    nothing is frozen). DSA's dense_warmup trains only the lightning indexers: their layers' outputs carry no
    gradient, so FSDP2's pre-backward hook on a layer's output, which gathers its weights again for backward, never
    fires; an indexer sharded as its own unit is gathered by the hook on its own output, which does need gradients.
    The frozen rest of the layer needs no weights in backward."""
    from moecore.moe.experts import GroupedExperts

    islands: list[torch.nn.Module] = []
    # DeepSeek-V4's indexers (models/compressed_attention.py) are always frozen and only select: their layers'
    # outputs carry gradients, so they do not make a layer need islands.
    selectors = {id(p) for m in model.modules() if type(m).__name__ == "CompressedIndexer" for p in m.parameters()}

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            params = [p for p in child.parameters() if id(p) not in selectors]
            if not params or isinstance(child, GroupedExperts):  # experts are sharded on their own mesh already
                continue
            if all(p.requires_grad for p in params):
                islands.append(child)
            elif any(p.requires_grad for p in params):
                visit(child)

    if any(not p.requires_grad and id(p) not in selectors for p in model.parameters()):
        visit(model)
    return islands


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FullyShardedModel:
    """FSDP2 on the dense (dp_cp) and expert (edp) meshes; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        dims: ParallelDims,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        fp8_gather: bool = False,
        roots: list[torch.nn.Module] | None = None,
    ) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from moecore.moe.experts import GroupedExperts

        if (
            dims.world_size > 1
            and dims.edp_group.size == 1
            and any(isinstance(m, GroupedExperts) for m in model.modules())
        ):
            raise ConfigError(
                f"parallel.fsdp=true needs experts replicated over data parallel (edp > 1): parallel.ep={dims.ep} "
                f"over {dims.world_size} ranks leaves edp = 1; use a smaller parallel.ep"
            )
        self.model, self.dims = model, dims
        self.fp8_gathered: list[str] = []  # names of the weights all-gathered as FP8
        if fp8_gather:  # FP8 primary weights: one-byte FP8 GEMM weights all-gathered as FP8 (parallel/fsdp_fp8.py)
            from moecore.parallel.fsdp_fp8 import gather_as_fp8

            self.fp8_gathered = gather_as_fp8(model)
        specs = {name: get_shard(p) for name, p in model.named_parameters()}
        device_type = next(model.parameters()).device.type
        reduce_dtype = reduce_dtype or (torch.float32 if param_dtype else None)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # One rank: the shard is the whole parameter, so freeing the gathered copy after forward saves nothing
        # but costs a second gather in backward (measured on an H200: 248.6 -> 238.7 ms per step, same peak).
        # Under pipeline parallel (`roots`: the stage modules) torch's PipelineStage keeps a stage's weights gathered
        # and its gradients unsharded from the first backward to the reduce-scatter after the last micro-batch;
        # resharding after each forward would only gather them again for that micro-batch's backward.
        reshard = dims.world_size > 1 and roots is None
        if dims.world_size == 1:  # one process: FSDP2 over a one-rank mesh (nothing split, the same code path)
            dense_mesh = expert_mesh = DeviceMesh.from_group(dist.group.WORLD, device_type)
        else:
            dense_mesh = DeviceMesh.from_group(dims.dp_cp_group.pg, device_type)
            expert_mesh = DeviceMesh.from_group(dims.edp_group.pg, device_type) if dims.edp_group.size > 1 else None
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                fully_shard(module, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard)
                module.set_gradient_divide_factor(float(dims.dp * dims.cp))
                if dist.get_backend(expert_mesh.get_group()) == "gloo":  # gloo has no PREMUL_SUM: sum, divide apart
                    module.set_force_sum_reduction_for_comms(True)
        for island in trainable_islands(model):  # DSA's dense_warmup: the lightning indexers (module docstring)
            fully_shard(island, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard)
        for layer in getattr(model, "layers", []):
            if next(layer.parameters(), None) is not None:  # pipeline parallel: other stages' layers hold none
                fully_shard(layer, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard)
        # The roots: the model, or under pipeline parallel this rank's stage modules (torch's PipelineStage
        # drives an FSDP root per stage: no gradient sync until the last micro-batch's backward, then it
        # reduce-scatters). Each takes the weights its sub-units do not hold (embedding, final norm, head, MTP).
        self.roots = list(roots) if roots is not None else [model]
        for root in self.roots:
            fully_shard(root, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard)
        for name, p in model.named_parameters():  # fully_shard made new parameters: keep their ShardSpecs
            setattr(p, _ATTR, specs[name])
        self.tp_partial = [p for p in model.parameters() if get_shard(p).kind == "tp_partial"]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing them."""
        for root in self.roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True)

    @torch.no_grad()
    def finish(self) -> None:
        """FSDP2 has reduce-scattered every gradient by the end of backward; sum the `tp_partial` ones over tp.

        tp peers hold the same rows of a `tp_partial` parameter (same shape, same dp_cp index).
        """
        tp = self.dims.tp_group
        grads = [_local(p.grad) for p in self.tp_partial if p.grad is not None]
        if tp.size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp.pg)
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])

    finish_grad_sync = finish

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, uncounted: set[int] = frozenset()) -> torch.Tensor:
        """Global L2 norm from the local gradient shards (each element on one rank); scale them to max_norm.

        `uncounted`: ids of parameters whose gradients are scaled but not counted (pipeline parallel: the copies
        of a weight shared by several stages, counted on one of them). Collective over the world."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [_local(p.grad) for p in params]
        dev = grads[0].device if grads else next(self.model.parameters()).device
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for p, g in zip(params, grads):
            if id(p) in uncounted:
                continue
            # Ranks holding this element: the local tensor's copies, divided among the FSDP shards.
            spec = get_shard(p)
            mesh = self.dims.edp_group if spec.kind == "expert" else self.dims.dp_cp_group
            copies = replication_factor(spec, self.dims) // mesh.size
            total += squared_norm(g) / copies
        if self.dims.world_group.size > 1:
            dist.all_reduce(total, group=self.dims.world_group.pg)
        norm = total.sqrt().float()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(dev))
        return norm

    def remove(self) -> None:
        """Nothing to unregister (the model stays sharded)."""
