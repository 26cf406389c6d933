"""Load a moecore model from a Hugging Face folder and save one back, streaming one tensor at a time.

Import: config.json -> `Config` (by the family of its `model_type`); the model is built with its
parameters on the meta device (no memory, no random init), then each parameter is allocated and
filled from the checkpoint, one Hugging Face tensor at a time, read straight into the parameter's
memory (through one temporary tensor when the dtype changes). Peak memory is the model plus at most
one tensor. Before any data is read, every name and shape is checked: a missing, unexpected or
mis-shaped tensor stops the import with an error naming it.

Export: `Config` -> config.json, and each Hugging Face tensor is cut from our parameters (a view)
right when the writer needs it, so export adds about one tensor to the model's memory.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from moecore.config import Config
from moecore.hf.families import TensorMap, export_order, family_names, get_family
from moecore.hf.fp8 import SCALE_SUFFIX, dequantize_fp8, fp8_block_size
from moecore.hf.io import (
    DEFAULT_MAX_SHARD_BYTES,
    PlannedTensor,
    SafetensorsReader,
    copy_tokenizer_files,
    read_config_json,
    write_safetensors,
)

# Tensors some checkpoints carry that hold nothing to import (saved rotary buffers).
_ALWAYS_IGNORED = (r"\.rotary_emb\.inv_freq$",)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers is moved to the meta device (buffers stay real).

    Building a model inside costs no parameter memory and skips its random initialisation (init
    functions on meta tensors do nothing); buffers computed at construction (RoPE frequencies) stay
    correct. Parameters must then be given real values (`materialize_params` or a loader).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_model_on_meta(cfg: Config) -> nn.Module:
    """Our model for `cfg` with every parameter on the meta device."""
    from moecore.models.transformer import MoETransformer

    with params_on_meta():
        return MoETransformer(cfg)


def set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter `name` (dotted) by `value`, keeping its requires_grad."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[attr]
    module._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad)


def materialize_params(model: nn.Module, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
    """Give every meta parameter real (uninitialised) storage of `dtype` on `device`."""
    for name, p in list(model.named_parameters()):
        if p.device.type == "meta":
            set_param(model, name, torch.empty(p.shape, dtype=dtype, device=device))


def _part_shape(target_shape: tuple[int, ...], mp: TensorMap) -> tuple[int, ...]:
    """The shape every Hugging Face part of `mp` must have for our tensor of `target_shape`."""
    if mp.hf_shape is not None:  # one tensor whose transform changes its shape
        return tuple(mp.hf_shape)
    slice_shape = target_shape[1:] if mp.stacked else target_shape
    n_parts = len(mp.hf[0])
    if mp.stacked and target_shape[0] != len(mp.hf):
        raise ValueError(f"{mp.ours} has {target_shape[0]} slices but the map lists {len(mp.hf)}")
    if n_parts == 1:
        return tuple(slice_shape)
    if slice_shape[0] % n_parts:
        raise ValueError(f"{mp.ours} rows {slice_shape[0]} do not split into {n_parts} equal parts")
    return (slice_shape[0] // n_parts, *slice_shape[1:])


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of the model by name (what a map may fill)."""
    out = dict(model.named_parameters())
    for name, b in model.state_dict(keep_vars=True).items():
        out.setdefault(name, b)
    return out


def check_maps(maps: list[TensorMap], model: nn.Module, model_type: str) -> None:
    """Each parameter of ours has exactly one map, and each map names a tensor the model has."""
    targets = _targets(model)
    seen: set[str] = set()
    for mp in maps:
        if mp.ours not in targets:
            raise ValueError(f"the {model_type} map names our tensor {mp.ours!r}, which this model does not have")
        if mp.ours in seen:
            raise ValueError(f"the {model_type} map lists our tensor {mp.ours!r} twice")
        seen.add(mp.ours)
    for name, _ in model.named_parameters():
        if name not in seen:
            raise ValueError(f"the {model_type} map has no Hugging Face tensor for our parameter {name!r}")


def _ignored(family, cfg: Config) -> list[re.Pattern]:
    patterns = list(_ALWAYS_IGNORED) + list(getattr(family, "IGNORED_HF_TENSORS", ()))
    if cfg.model.tie_embeddings:
        patterns.append(r"^lm_head\.weight$")  # tied: transformers ignores a saved copy too
    return [re.compile(p) for p in patterns]


def load_weights(
    model: nn.Module,
    family,
    cfg: Config,
    reader: SafetensorsReader,
    dtype: torch.dtype,
    on_tensor: Callable[[str], None] | None = None,
) -> None:
    """Fill `model` (parameters on meta) from `reader`, after checking every name and shape."""
    available = set(reader.names())
    maps = family.tensor_maps(cfg, available)
    fp8_block = _fp8_block(read_config_json(reader.folder))  # block-wise FP8 weights: dequantized
    check_maps(maps, model, family.MODEL_TYPE)
    targets = _targets(model)
    needed: dict[str, str] = {}
    for mp in maps:
        want = None if mp.combine is not None else _part_shape(tuple(targets[mp.ours].shape), mp)
        for k, name in enumerate(mp.hf_names()):
            needed[name] = mp.ours
            if name not in available:
                raise ValueError(f"{reader.folder}: tensor {name!r} is missing (it makes our {mp.ours})")
            if mp.combine is not None:
                want = tuple(mp.hf_shapes[k])
            if fp8_block is not None and name + SCALE_SUFFIX in available:
                needed[name + SCALE_SUFFIX] = mp.ours
            got = reader.shape(name)
            if got != want:
                raise ValueError(
                    f"{reader.folder}: tensor {name!r} has shape {list(got)}, expected {list(want)} (for our {mp.ours})"
                )
    ignored = _ignored(family, cfg)
    extra = sorted(n for n in available if n not in needed and not any(p.search(n) for p in ignored))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(
            f"{reader.folder}: unexpected tensor {extra[0]!r}{more}; the {family.MODEL_TYPE} config has no place for it"
        )
    params = dict(model.named_parameters())
    for mp in maps:
        target = targets[mp.ours]
        is_param = mp.ours in params
        value = torch.empty(target.shape, dtype=dtype if is_param else target.dtype)
        if mp.combine is not None:  # e.g. quantized blocks + scales, dequantized (families/gpt_oss.py)
            parts = [
                dequantize_fp8(reader.get(name), reader.get(name + SCALE_SUFFIX), fp8_block)
                if fp8_block is not None and name + SCALE_SUFFIX in available
                else reader.get(name)
                for name in mp.hf_names()
            ]  # block-wise FP8 parts dequantized first, as for every other map
            value.copy_(mp.combine(parts))
            if on_tensor is not None:
                for name in mp.hf_names():
                    on_tensor(name)
        for s, parts in enumerate(() if mp.combine is not None else mp.hf):
            dst = value[s] if mp.stacked else value
            rows = dst.shape[0] // len(parts) if len(parts) > 1 else 0
            for k, name in enumerate(parts):
                piece = dst if len(parts) == 1 else dst[k * rows : (k + 1) * rows]
                if fp8_block is not None and name + SCALE_SUFFIX in available:
                    w = dequantize_fp8(reader.get(name), reader.get(name + SCALE_SUFFIX), fp8_block)
                    piece.copy_(w if mp.to_ours is None else mp.to_ours(w))
                elif mp.to_ours is None:
                    reader.read_into(name, piece)  # straight into the parameter's memory
                else:
                    piece.copy_(mp.to_ours(reader.get(name)))
                if on_tensor is not None:
                    on_tensor(name)
        if is_param:
            set_param(model, mp.ours, value)
        else:
            with torch.no_grad():
                target.copy_(value)


def _fp8_block(hf: dict) -> tuple[int, int] | None:
    """The FP8 block size of a block-wise fp8 checkpoint, else None (other quantization is the family's to refuse
    or handle, e.g. gpt-oss's MXFP4)."""
    q = hf.get("quantization_config")
    return fp8_block_size(hf) if isinstance(q, dict) and q.get("quant_method") == "fp8" else None


def checkpoint_dtype(hf: dict, reader: SafetensorsReader) -> torch.dtype:
    """The dtype a checkpoint declares (`dtype` / `torch_dtype`), else that of its first floating tensor."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    if isinstance(name, str) and name in DTYPES:
        return DTYPES[name]
    for n in reader.names():
        dt = reader.dtype(n)
        if dt.is_floating_point and dt.itemsize > 1:  # not the fp8 weights of a quantized checkpoint
            return dt
    return torch.float32


def config_for_checkpoint(family, hf: dict, names: list[str]) -> Config:
    """The family's Config for this checkpoint: `config_from_hf(hf, names)` where the family's reader takes the
    tensor names (DeepSeek-V3 drops MTP layers config.json announces but the weights lack), else `config_from_hf(hf)`."""
    if "available" in inspect.signature(family.config_from_hf).parameters:
        return family.config_from_hf(hf, set(names))
    return family.config_from_hf(hf)


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> nn.Module:
    """A moecore model (in eval mode) from a Hugging Face folder: config.json + safetensors (single or sharded).

    dtype: the parameters' dtype; None keeps the checkpoint's. `on_tensor(name)` is called after each
    Hugging Face tensor is read (for progress bars).
    """
    path = Path(path)
    hf = read_config_json(path)
    family = get_family(hf.get("model_type"))
    with SafetensorsReader(path) as reader:
        cfg = config_for_checkpoint(family, hf, reader.names())
        dtype = dtype or checkpoint_dtype(hf, reader)
        model = build_model_on_meta(cfg)
        load_weights(model, family, cfg, reader, dtype, on_tensor)
    return model.eval()


def pick_family(cfg: Config) -> str:
    """The Hugging Face model_type for our config: its `model.family` when that is one, else the one that fits."""
    if cfg.model.family in family_names():
        return cfg.model.family
    reasons = []
    for name in export_order():
        try:
            get_family(name).config_to_hf(cfg)
            return name
        except ValueError as e:
            reasons.append(str(e))
    raise ValueError("no Hugging Face family can express this model: " + "; ".join(reasons))


def hf_config_dict(cfg: Config, model_type: str, dtype: torch.dtype) -> dict:
    family = get_family(model_type)
    body = family.config_to_hf(cfg)
    return {"architectures": [family.ARCHITECTURE], "model_type": model_type, **body, "dtype": DTYPE_NAMES[dtype]}


def _planned(maps: list[TensorMap], state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[PlannedTensor]:
    plan = []
    for mp in maps:
        src = state[mp.ours]
        if mp.combine is not None:  # one of ours makes several Hugging Face tensors (TensorMap.combined)
            if mp.split is None:
                raise ValueError(f"our {mp.ours!r} has an import-only map: it cannot be written back")
            for k, name in enumerate(mp.hf_names()):

                def produce_part(src=src, k=k, mp=mp) -> torch.Tensor:
                    return mp.split(src)[k].detach().to(dtype)

                plan.append(PlannedTensor(name, tuple(mp.hf_shapes[k]), dtype, produce_part))
            continue
        out_dtype = dtype if src.is_floating_point() else src.dtype  # integer tables (DeepSeek-V4's tid2eid) stay
        for s, parts in enumerate(mp.hf):
            sl = src[s] if mp.stacked else src
            rows = sl.shape[0] // len(parts) if sl.dim() else 0
            for k, name in enumerate(parts):

                def produce(sl=sl, k=k, rows=rows, mp=mp, out_dtype=out_dtype) -> torch.Tensor:
                    t = sl if len(mp.hf[0]) == 1 else sl[k * rows : (k + 1) * rows]
                    if mp.to_hf is not None:
                        t = mp.to_hf(t)
                    return t.detach().to(out_dtype)

                shape = tuple(sl.shape) if len(parts) == 1 else (rows, *sl.shape[1:])
                if mp.hf_shape is not None:
                    shape = tuple(mp.hf_shape)
                plan.append(PlannedTensor(name, shape, out_dtype, produce))
    return plan


def _planned_copies(family, cfg: Config, state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[PlannedTensor]:
    """Checkpoint tensors that repeat one of ours, from the optional family hook `shared_copies(cfg)` ->
    [(Hugging Face name, our tensor)] (DeepSeek-V3's MTP layers store copies of the embedding and head).
    On import the family lists them in IGNORED_HF_TENSORS."""
    hook = getattr(family, "shared_copies", None)
    copies = hook(cfg) if hook is not None else []
    return [
        PlannedTensor(name, tuple(state[ours].shape), dtype, lambda t=state[ours]: t.detach().to(dtype))
        for name, ours in copies
    ]


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    model_type: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | Path | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> Path:
    """Write `model` as a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    model_type: the Hugging Face family (default: the model's `model.family`, or the one family that
    can express its config). dtype: the stored dtype (default: the parameters'). Tokenizer files found
    in `tokenizer_dir` are copied along. Returns the folder.
    """
    cfg: Config = model.cfg
    model_type = model_type or pick_family(cfg)
    family = get_family(model_type)
    state = model.state_dict()
    for name, t in state.items():
        if type(t).__name__ == "DTensor":
            raise ValueError(
                f"tensor {name!r} is sharded (DTensor); save a distributed checkpoint and run `moecore convert --to-hf`"
            )
    dtype = dtype or next(iter(model.parameters())).dtype
    config = hf_config_dict(cfg, model_type, dtype)
    maps = family.tensor_maps(cfg, None)
    check_maps(maps, model, model_type)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    plan = _planned(maps, state, dtype) + _planned_copies(family, cfg, state, dtype)
    write_safetensors(path, plan, max_shard_bytes, on_tensor=on_tensor)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, path)
    return path


def count_hf_tensors(cfg: Config, model_type: str) -> int:
    """How many Hugging Face tensors an export of `cfg` writes (for progress bars)."""
    family = get_family(model_type)
    copies = getattr(family, "shared_copies", None)
    return sum(len(mp.hf_names()) for mp in family.tensor_maps(cfg, None)) + (len(copies(cfg)) if copies else 0)
