"""How each local parameter relates to its global (unsharded) tensor, and how its gradient is reduced.

Every parameter may carry a `ShardSpec` (attribute `_moecore_shard`); parameters without one are
plain replicas. The spec says

- where the local tensor sits inside the global one: `global_shape`, plus `view_shape`/`offsets`:
  the local tensor, viewed as `local_view`, is the block of `global.view(view_shape)` starting at
  `offsets`. A view is needed where one shard is not contiguous in the global tensor (an expert
  `w13 [E, 2F, H]` split along F holds gate rows and up rows: view `[E, 2, F, H]`);
- its gradient kind, which decides the data-parallel reduction and the grad-norm weight:

| kind | value across ranks | local gradient | reduction |
|---|---|---|---|
| `replicated` | same everywhere | complete for this replica | mean over dp_cp |
| `tp_partial` | same everywhere | partial sum over the TP ranks (sequence-parallel norms, router, qk-norms) | sum over tp, mean over dp_cp |
| `tensor_parallel` | sharded over tp | complete for this replica | mean over dp_cp |
| `expert` | sharded over ep (dim 0) and etp | sum over the tokens this rank received | sum over edp, divided by dp_cp size |

From these, `global_state_dict` / `load_global_state_dict` map between full tensors and local
shards, and `checkpoint_state_dict` wraps each sharded parameter so torch.distributed.checkpoint
saves it as a chunk of its global tensor (layout-free checkpoints).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moecore.parallel.dims import ParallelDims

KINDS = ("replicated", "tp_partial", "tensor_parallel", "expert")
_ATTR = "_moecore_shard"


@dataclass(frozen=True)
class ShardSpec:
    """Placement of a local shard inside its global tensor; see the module docstring."""

    kind: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    view_shape: tuple[int, ...]  # global_shape with some dims split into factors
    local_view: tuple[int, ...]  # local_shape split the same way
    offsets: tuple[int, ...]  # where the local block starts, in view_shape coordinates

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid: allowed: {' | '.join(KINDS)}")
        if len(self.view_shape) != len(self.local_view) or len(self.offsets) != len(self.view_shape):
            raise ValueError(
                f"view_shape {self.view_shape}, local_view {self.local_view} and offsets {self.offsets} differ in rank"
            )
        if any(o + n > v for o, n, v in zip(self.offsets, self.local_view, self.view_shape)):
            raise ValueError(f"block at {self.offsets} of size {self.local_view} exceeds the view {self.view_shape}")
        _ = self.groups  # validates that the view refines the global shape

    @property
    def groups(self) -> list[list[int]]:
        """For each global dim, the consecutive view dims whose product it is."""
        out, vi = [], 0
        for g in self.global_shape:
            grp, prod = [], 1
            while vi < len(self.view_shape) and (prod < g or not grp):
                prod *= self.view_shape[vi]
                grp.append(vi)
                vi += 1
            if prod != g:
                raise ValueError(f"view_shape {self.view_shape} does not refine global_shape {self.global_shape}")
            out.append(grp)
        if vi != len(self.view_shape):
            raise ValueError(f"view_shape {self.view_shape} does not refine global_shape {self.global_shape}")
        return out

    @property
    def is_sharded(self) -> bool:
        return tuple(self.local_view) != tuple(self.view_shape)

    def block_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_view))

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard cut out of the full tensor (a copy, shaped like the local parameter)."""
        return full.reshape(self.view_shape)[self.block_slices()].reshape(self.local_shape).clone()


def set_shard(
    param: torch.Tensor,
    kind: str,
    global_shape: tuple[int, ...] | None = None,
    offsets: tuple[int, ...] | None = None,
    view_shape: tuple[int, ...] | None = None,
    local_view: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Attach a ShardSpec to `param` (defaults: not sharded, no view). Returns the param."""
    gshape = tuple(global_shape) if global_shape is not None else tuple(param.shape)
    vshape = tuple(view_shape) if view_shape is not None else gshape
    lview = tuple(local_view) if local_view is not None else tuple(param.shape)
    offs = tuple(offsets) if offsets is not None else (0,) * len(vshape)
    setattr(param, _ATTR, ShardSpec(kind, gshape, tuple(param.shape), vshape, lview, offs))
    return param


def get_shard(param: torch.Tensor) -> ShardSpec:
    """The param's ShardSpec; a plain replica when none was attached."""
    spec = getattr(param, _ATTR, None)
    if spec is None:
        shape = tuple(param.shape)
        return ShardSpec("replicated", shape, shape, shape, shape, (0,) * len(shape))
    return spec


def mark_tp_partial(module_or_param: torch.nn.Module | torch.Tensor) -> None:
    """Mark replicated parameters whose gradients are partial sums over the TP ranks (e.g. norms under SP)."""
    params = [module_or_param] if isinstance(module_or_param, torch.Tensor) else module_or_param.parameters()
    for p in params:
        set_shard(p, "tp_partial")


def replication_factor(spec: ShardSpec, dims: ParallelDims) -> int:
    """How many ranks hold an identical copy of this local tensor (within one pipeline stage)."""
    stage = dims.tp * dims.cp * dims.dp
    if spec.kind in ("replicated", "tp_partial"):
        return stage
    if spec.kind == "tensor_parallel":
        return stage // dims.tp
    return dims.edp  # expert shards are distinct over ep x etp


# --------------------------------------------------------------------------------------------------
# Full <-> local state dicts
# --------------------------------------------------------------------------------------------------


def load_global_state_dict(module: torch.nn.Module, full: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy each parameter's shard out of full (unsharded) tensors, e.g. a single-process model's state dict."""
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    missing = [k for k in named if k not in full]
    if strict and missing:
        raise KeyError(f"full state dict lacks {missing[:5]}")
    with torch.no_grad():
        for name, t in named.items():
            if name not in full:
                continue
            spec = get_shard(t)
            src = full[name]
            if tuple(src.shape) != tuple(spec.global_shape):
                raise ValueError(
                    f"{name}: full tensor has shape {tuple(src.shape)}, the layout expects {spec.global_shape}"
                )
            t.copy_(spec.local_of(src).to(t.dtype))


def global_tensor(t: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Assemble the full tensor from every rank's shard (collective over the world; for tests and export)."""
    spec = get_shard(t)
    if not spec.is_sharded or dims.world_size == 1:
        return t.detach().clone()
    full = t.new_zeros(spec.view_shape)
    # Every rank's block with its offsets: gather offsets first (the shapes are equal for a given param).
    offs = torch.tensor(spec.offsets, dtype=torch.long, device=t.device)  # NCCL gathers device tensors only
    all_offs = [torch.empty_like(offs) for _ in range(dims.world_size)]
    dist.all_gather(all_offs, offs)
    blocks = [torch.empty_like(t.detach().contiguous()) for _ in range(dims.world_size)]
    dist.all_gather(blocks, t.detach().contiguous())
    for o, b in zip(all_offs, blocks):
        sl = tuple(slice(int(a), int(a) + n) for a, n in zip(o.tolist(), spec.local_view))
        full[sl] = b.reshape(spec.local_view)
    return full.reshape(spec.global_shape)


def global_state_dict(module: torch.nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (collective; every rank gets the whole dict)."""
    return {name: global_tensor(p, dims) for name, p in module.named_parameters()}


def global_grads(module: torch.nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Full gradients of every parameter, assembled like `global_state_dict` (zeros where a grad is None)."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        carrier = g.detach()
        setattr(carrier, _ATTR, get_shard(p))
        out[name] = global_tensor(carrier, dims)
    return out


# --------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint adapter
# --------------------------------------------------------------------------------------------------


def _chunks(spec: ShardSpec) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple]]:
    """Split the local block into pieces contiguous in global coordinates: (global offsets, sizes, view slices).

    Where a global dim is split into several view dims (w13's [2, F] halves), every view dim of that
    group but the last is enumerated element by element, giving one global block per combination.
    """
    groups = spec.groups
    enum_dims = [d for grp in groups for d in grp[:-1]]
    pieces = []
    for idx in itertools.product(*[range(spec.local_view[d]) for d in enum_dims]):
        fixed = dict(zip(enum_dims, idx))
        g_off, g_size = [], []
        for grp in groups:
            off, stride = 0, 1
            for d in reversed(grp):  # row-major position of the block's first element within this global dim
                off += (spec.offsets[d] + fixed.get(d, 0)) * stride
                stride *= spec.view_shape[d]
            g_off.append(off)
            g_size.append(spec.local_view[grp[-1]])
        v_sl = tuple(slice(fixed[d], fixed[d] + 1) if d in fixed else slice(None) for d in range(len(spec.view_shape)))
        pieces.append((tuple(g_off), tuple(g_size), v_sl))
    return pieces


class CheckpointShard(torch.Tensor):
    """A local shard that torch.distributed.checkpoint saves/loads as chunks of the global tensor.

    A tensor sharing the local parameter's storage (so a load writes straight into the model) that
    implements DCP's checkpointable protocol: `__create_write_items__`, `__create_chunk_list__`,
    `__get_tensor_shard__`, and `size()` answering the global shape (what DCP checks on load).
    Torch operations on it return plain tensors.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, spec: ShardSpec) -> CheckpointShard:
        obj = torch.Tensor._make_subclass(cls, tensor.detach(), False)
        obj._spec = spec
        obj._pieces = _chunks(spec)
        return obj

    def size(self, dim: int | None = None):  # the global size, as DCP compares it with the checkpoint's
        g = torch.Size(self._spec.global_shape)
        return g if dim is None else g[dim]

    def _views(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        v = torch.Tensor.view(self, self._spec.local_view)
        return [(o, s, v[sl].reshape(s)) for o, s, sl in self._pieces]

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        items = []
        for off, size, view in self._views():
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(off)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                        properties=TensorProperties.create_from_tensor(view),
                        size=torch.Size(self._spec.global_shape),
                    ),
                )
            )
        return items

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self._pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for off, _, view in self._views():
            if torch.Size(off) == index.offset:
                return view
        raise ValueError(f"no local chunk at offset {tuple(index.offset)} for {index.fqn}")


def checkpoint_state_dict(module: torch.nn.Module) -> dict[str, object]:
    """Parameters and buffers for torch.distributed.checkpoint: sharded ones wrapped as `CheckpointShard`.

    Replicated tensors stay plain (DCP deduplicates them); sharded ones are saved under their global
    shape, so a checkpoint written under one layout loads under another.
    """
    out: dict[str, object] = {}
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        spec = get_shard(t)
        out[name] = CheckpointShard(t, spec) if spec.is_sharded else t
    return out


def _fsdp_shard(t: torch.Tensor, spec: ShardSpec):
    """A DTensor (dim 0 sharded by FSDP2) of a local shard `spec`: its rows as a chunk of the global tensor.

    FSDP2 keeps rows [start, start + n) of dim 0 of the local tensor; where global dim 0 is not split
    in the view (EP shards along dim 0; ETP splits other dims) they are rows start.. of the local view.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(t.shape) != tuple(spec.local_shape) or spec.groups[0] != [0]:
        raise ValueError(f"cannot checkpoint an FSDP shard of {spec}: its dim 0 is split in the view")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    n, start = shape[0], offset[0]
    composed = ShardSpec(
        spec.kind,
        spec.global_shape,
        (n, *spec.local_shape[1:]),
        spec.view_shape,
        (n, *spec.local_view[1:]),
        (spec.offsets[0] + start, *spec.offsets[1:]),
    )
    local = t.to_local()
    # a shard FSDP2 all-gathers as FP8 (moecore/parallel/fsdp_fp8.py) is saved as the fp32 values it wraps
    return CheckpointShard(getattr(local, "hp_shard", local), composed)


def wrap_for_checkpoint(
    model: torch.nn.Module, model_sd: dict, optim_sd: dict | None = None
) -> tuple[dict, dict | None]:
    """Wrap the sharded tensors of `get_state_dict`-style dicts as `CheckpointShard`s (new dicts, same tensors).

    model_sd: {fqn: tensor}; optim_sd: {"state": {fqn: {name: tensor}}, "param_groups": ...} or its flattened
    form {"state.<fqn>.<name>": tensor, "param_groups.<fqn>.<key>": value}. Optimizer
    states shaped like their sharded parameter (AdamW moments, ...) share its spec; scalars stay plain.
    Saving and loading the wrapped dicts with torch.distributed.checkpoint makes the files layout-free.
    """
    specs = {name: get_shard(t) for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}

    def wrap(name: str, t):
        spec = specs.get(name)
        if spec is None or not spec.is_sharded or not isinstance(t, torch.Tensor):
            return t
        if hasattr(t, "to_local"):  # FSDP2: a DTensor over data parallel of the local (EP) shard
            return _fsdp_shard(t, spec)
        if tuple(t.shape) != tuple(spec.local_shape):
            return t
        return CheckpointShard(t, spec)

    new_model = {k: wrap(k, v) for k, v in model_sd.items()}
    if optim_sd is None:
        return new_model, None
    new_optim = dict(optim_sd)
    for key, v in optim_sd.items():  # flattened form: "state.<fqn>.<name>"
        if key.startswith("state.") and isinstance(v, torch.Tensor):
            new_optim[key] = wrap(key[len("state.") :].rsplit(".", 1)[0], v)
    if isinstance(optim_sd.get("state"), dict):
        new_optim["state"] = {
            fqn: ({k: wrap(fqn, v) for k, v in st.items()} if isinstance(st, dict) else st)
            for fqn, st in optim_sd["state"].items()
        }
    return new_model, new_optim
