"""Hugging Face model families: the registry keyed by `model_type`, and the tensor-map record they share.

A family is one small module that knows one Hugging Face `model_type`. It defines:

- `MODEL_TYPE` (e.g. "mixtral") and `ARCHITECTURE` (e.g. "MixtralForCausalLM", written to config.json);
- `config_from_hf(hf: dict) -> Config`: config.json -> our `model` and `moe` sections. Every field that
  changes the maths maps to one of ours or is refused with a ValueError naming the field (use
  `common.HFFields`, which also refuses fields nobody read);
- `config_to_hf(cfg: Config) -> dict`: the reverse; refuses (ValueError naming our field) any option of
  ours the family cannot express;
- `tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]`: for every parameter
  of our model, the Hugging Face tensors it is made of. On import `available` holds the names found in
  the checkpoint, so a family can accept several on-disk layouts (per-expert tensors, or transformers'
  fused 3-D expert tensors); on export it is None and the family returns the layout that checkpoints
  on the Hub use;
- optionally `IGNORED_HF_TENSORS`: regular expressions of checkpoint tensors that carry nothing (e.g.
  saved rotary `inv_freq` buffers);
- `config_from_hf` may take a second parameter `available: Collection[str] | None = None`: on import it
  gets the checkpoint's tensor names, for families where the tensors present decide part of the config
  (see `pretrained.config_for_checkpoint`).

Adding a family: write `families/<model_type>.py` and add one line to `_FAMILY_MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

_FAMILY_MODULES = {
    "mixtral": "moecore.hf.families.mixtral",
    "qwen2_moe": "moecore.hf.families.qwen2_moe",
    "qwen3_moe": "moecore.hf.families.qwen3_moe",
    "deepseek_v2": "moecore.hf.families.deepseek_v2",
    "deepseek_v3": "moecore.hf.families.deepseek_v3",
    "deepseek_v32": "moecore.hf.families.deepseek_v32",
    "qwen3_next": "moecore.hf.families.qwen3_next",
    "glm4_moe": "moecore.hf.families.glm4_moe",
    "gpt_oss": "moecore.hf.families.gpt_oss",
    "qwen3_5_moe_text": "moecore.hf.families.qwen3_5_moe",
    "glm4_moe_lite": "moecore.hf.families.glm4_moe_lite",
    "minimax_m2": "moecore.hf.families.minimax_m2",
    "glm_moe_dsa": "moecore.hf.families.glm_moe_dsa",
    "olmoe": "moecore.hf.families.olmoe",
    "dots1": "moecore.hf.families.dots1",
    "deepseek_v4": "moecore.hf.families.deepseek_v4",
}
# model_types we import through another family and never write: a multimodal Qwen3.5-MoE checkpoint's language model
_IMPORT_ONLY = {"qwen3_5_moe": "qwen3_5_moe_text"}


def family_names() -> list[str]:
    """The Hugging Face model_types we can import and export."""
    return sorted(_FAMILY_MODULES)


def export_order() -> list[str]:
    """The families in the order an export tries them for a config that names none: alphabetical, except that a
    config Qwen3-Next can express is written as Qwen3-Next rather than Qwen3.5-MoE (the same maths, an older layout
    more tools read)."""
    last = ("qwen3_5_moe_text",)
    return sorted(n for n in _FAMILY_MODULES if n not in last) + list(last)


def get_family(model_type: str | None) -> ModuleType:
    """The family module for a Hugging Face `model_type`, or a ValueError listing the supported ones."""
    model_type = _IMPORT_ONLY.get(model_type, model_type)
    if model_type not in _FAMILY_MODULES:
        known = " | ".join(sorted([*family_names(), *_IMPORT_ONLY]))
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {known}")
    return importlib.import_module(_FAMILY_MODULES[model_type])


@dataclass(frozen=True)
class TensorMap:
    """One tensor of our model and the Hugging Face tensors it is made of.

    `hf[s]` lists the Hugging Face tensors of slice s; they are concatenated along dim 0 in that order
    (e.g. an expert's gate rows then its up rows). With `stacked`, the slices are stacked along a new
    dim 0 (one slice per expert); otherwise there is exactly one slice. All parts of a slice have the
    same number of rows. `to_ours` / `to_hf` transform each part on its way in / out (default: none).
    """

    ours: str
    hf: tuple[tuple[str, ...], ...]
    stacked: bool = False
    to_ours: Callable[[torch.Tensor], torch.Tensor] | None = None
    to_hf: Callable[[torch.Tensor], torch.Tensor] | None = None
    hf_shape: tuple[int, ...] | None = None  # the one Hugging Face tensor's shape when to_ours/to_hf change it
    # Our tensor is combine([the Hugging Face tensors of hf[0], read whole]), each of the shape in hf_shapes (e.g.
    # quantized blocks and their scales, dequantized; projections interleaved). Import only, unless `split` (our
    # tensor -> those Hugging Face tensors, in hf[0]'s order) is given for the export.
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    hf_shapes: tuple[tuple[int, ...], ...] | None = None
    split: Callable[[torch.Tensor], list[torch.Tensor]] | None = None

    @staticmethod
    def transformed(
        ours: str,
        hf_name: str,
        to_ours: Callable[[torch.Tensor], torch.Tensor],
        to_hf: Callable[[torch.Tensor], torch.Tensor],
        hf_shape: tuple[int, ...],
    ) -> TensorMap:
        """Our tensor is `to_ours` of one Hugging Face tensor of shape `hf_shape` (e.g. transposed, reordered)."""
        return TensorMap(ours, ((hf_name,),), to_ours=to_ours, to_hf=to_hf, hf_shape=tuple(hf_shape))

    @staticmethod
    def copy(ours: str, hf_name: str) -> TensorMap:
        """Our tensor is the Hugging Face tensor as is."""
        return TensorMap(ours, ((hf_name,),))

    @staticmethod
    def concat(ours: str, hf_names: list[str]) -> TensorMap:
        """Our tensor is the Hugging Face tensors concatenated along dim 0."""
        return TensorMap(ours, (tuple(hf_names),))

    @staticmethod
    def stack(ours: str, per_slice: list[list[str]]) -> TensorMap:
        """Our tensor [N, ...] stacks N slices; slice i concatenates `per_slice[i]` along dim 0."""
        return TensorMap(ours, tuple(tuple(parts) for parts in per_slice), stacked=True)

    @staticmethod
    def combined(
        ours: str,
        hf_names: list[str],
        combine: Callable[[list[torch.Tensor]], torch.Tensor],
        hf_shapes: list[tuple[int, ...]],
        split: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> TensorMap:
        """Our tensor is `combine` of several Hugging Face tensors (shapes `hf_shapes`); exported through `split`
        (import only without it)."""
        shapes = tuple(tuple(x) for x in hf_shapes)
        return TensorMap(ours, (tuple(hf_names),), combine=combine, hf_shapes=shapes, split=split)

    def hf_names(self) -> list[str]:
        return [name for parts in self.hf for name in parts]
