"""The `fp8` section: the FP8 GEMM recipe, format and modules used under `train.precision=fp8`.

The rules that tie it to other sections (GEMM dimensions, sync-free experts, CUDA graphs) are in
`moecore/config/root.py`, with the other cross-section checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moecore.config.errors import _check_choice, _fail

FP8_MODULES = ("experts", "shared_experts", "dense_mlp", "attention")


@dataclass
class FP8Config:
    """FP8 GEMMs under `train.precision=fp8` (moecore/kernels/fp8_gemm.py; docs/train.md "FP8").

    The router, embeddings, output head and norms stay bf16/fp32; every other tensor is bf16 as in
    `train.precision=bf16` (bf16 parameters, fp32 masters in the optimizer). Scales are computed from
    the tensor being quantised at every use (current scaling): scale = amax / fp8_max per group.
    """

    recipe: str = "rowwise"  # tensorwise | rowwise | blockwise (activations 1x128, weights 128x128, as DeepSeek-V3)
    format: str = "e4m3"  # e4m3 everywhere | hybrid: e4m3 forward, e5m2 gradients
    modules: list = field(default_factory=lambda: ["experts", "shared_experts", "dense_mlp", "attention"])
    primary_weights: bool = False  # keep the weights in FP8 between steps (masters in the optimizer)
    pow2_scales: bool = False  # round every scale up to a power of two (exact rescaling; off as in DeepSeek-V3)
    emulate: bool = False  # quantise-dequantise then ordinary matmuls: FP8 numerics without FP8 GEMMs (CPU, debugging)
    fprop_fast_accum: bool = True  # forward GEMMs use Hopper's fast FP8 accumulation (Transformer Engine's default)
    # fp8 | bf16 | auto: the weight-gradient GEMMs in FP8, in bf16 from the unquantised operands, or per GEMM
    # (auto: FP8 where a dimension of the weight is >= 4096 and the GEMM sums >= 2048 rows per weight or expert,
    # bf16 otherwise: Fp8Recipe.wgrad_in_fp8)
    wgrad: str = "auto"
    # the routed experts' GEMMs (rowwise only for the non-default choices; auto: the faster on an H200, AUTO below)
    padding: str = "auto"  # auto | all | wgrad: rows padded per expert for every GEMM, or in the wgrad operands only
    grouped_gemm: str = "auto"  # auto | torch | triton: forward and input-gradient grouped GEMMs' kernel

    RECIPES = ("tensorwise", "rowwise", "blockwise")
    # what `auto` means for the rowwise recipe (the others take the first choice, the only one they have)
    AUTO = {"padding": "wgrad", "grouped_gemm": "auto"}  # grouped_gemm auto: per GEMM (kernels/fp8_grouped.py)
    CHOICES = {"padding": ("all", "wgrad"), "grouped_gemm": ("torch", "triton")}

    def resolved(self, name: str) -> str:
        """`padding` or `grouped_gemm` with `auto` replaced by its choice for this recipe."""
        value = getattr(self, name)
        if value != "auto":
            return value
        return self.AUTO[name] if self.recipe == "rowwise" else self.CHOICES[name][0]

    @property
    def alignment(self) -> int:
        """Multiple the GEMM dimensions must be: 128 (the block) for blockwise, 16 (FP8 tensor cores) otherwise."""
        return 128 if self.recipe == "blockwise" else 16

    def validate(self) -> None:
        _check_choice("fp8.recipe", self.recipe, self.RECIPES)
        _check_choice("fp8.format", self.format, ("e4m3", "hybrid"))
        _check_choice("fp8.wgrad", self.wgrad, ("fp8", "bf16", "auto"))
        for name, choices in self.CHOICES.items():
            _check_choice(f"fp8.{name}", getattr(self, name), ("auto", *choices))
            if getattr(self, name) not in ("auto", choices[0]) and self.recipe != "rowwise":
                _fail(f"fp8.{name}", getattr(self, name), f"needs fp8.recipe=rowwise (fp8.recipe={self.recipe})")
        if not isinstance(self.modules, list) or not self.modules:
            _fail("fp8.modules", self.modules, "a non-empty list of " + " | ".join(FP8_MODULES))
        for m in self.modules:
            _check_choice("fp8.modules", m, FP8_MODULES)
