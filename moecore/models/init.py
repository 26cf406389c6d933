"""Seeded, layout-independent initialisation: the same `train.seed` gives the same weights on every layout.

Each element of a parameter gets its random value from a counter-based generator: a hash of
(seed, the parameter's name, the element's flat index in the *global* tensor). A rank computes the
values of its own shard only, from the shard's position in the global tensor (its `ShardSpec`,
moecore/parallel/sharding.py), so no rank ever materialises a tensor it does not own, and the
single process, tp, ep, etp, dp (and any future pp / cp / fsdp split that records where its shard
sits) start from bit-identical weights. The name is the parameter's fully qualified name in the
whole model (what checkpoints use), so a pipeline stage holding `layers.7` draws what the single
process draws for `layers.7`.

The generator: splitmix64 over `key + counter * golden_gamma` (the standard splitmix64 sequence,
written with int64 tensor ops: products wrap modulo 2^64 and logical right shifts are masked
arithmetic shifts), 53 bits -> a uniform double in [0, 1). Normal values use Box-Muller on the two
32-bit halves of the element's hash. PyTorch's own generators cannot be positioned at an arbitrary
element on CPU, which is why this small hash exists.

What each parameter draws comes from `rule_for` (a table by module type and parameter name):
normal(0, init_std) for linear, embedding, expert and router weights; PyTorch's default uniform
for convolutions; the gated DeltaNet's A_log and dt_bias as in its `reset_parameters`; `keep`
(the module's own deterministic init: ones, zeros) for norms and biases. A parameter without a rule
is an error, so a new module cannot silently fall back to a layout-dependent init.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moecore.parallel.sharding import get_shard

_MASK64 = (1 << 64) - 1
# Elements generated at a time: small on CPU, where temporaries that stay in cache make it ~7x faster
# (about 60 ns per normal value on one core); large on GPU, where kernel launches are the cost.
_CHUNK = {"cpu": 1 << 16, "cuda": 1 << 24}


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (a bijection of 64-bit words with good avalanche)."""
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return z ^ _srl(z, 31)


def param_key(seed: int, name: str) -> int:
    """The 64-bit stream key of parameter `name` under `seed`."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return _s64(int.from_bytes(digest, "little"))


def uniform_at(key: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniform doubles in [0, 1), one per int64 counter: a pure function of (key, counter)."""
    z = _mix(counter * _GAMMA + key)
    return _srl(z, 11).to(torch.float64) * (2.0**-53)


def normal_at(key: int, index: torch.Tensor) -> torch.Tensor:
    """Standard normal doubles, one per element index: Box-Muller on the two 32-bit halves of one hash.

    u1 = (high + 0.5) / 2^32 lies in (0, 1), so the log is finite; values reach about 6.7 sigma."""
    z = _mix(index * _GAMMA + key)
    u1 = (_srl(z, 32).to(torch.float64) + 0.5) * (2.0**-32)
    u2 = (z & 0xFFFFFFFF).to(torch.float64) * (2.0**-32)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


@dataclass(frozen=True)
class InitRule:
    """normal(a=mean, b=std) | uniform(a=low, b=high) | keep; `transform` maps the drawn doubles."""

    kind: str
    a: float = 0.0
    b: float = 1.0
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


KEEP = InitRule("keep")


def _dt_bias(u: torch.Tensor) -> torch.Tensor:
    """Mamba-2's time step: dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt)."""
    dt = (math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3))).exp().clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def rule_for(module: nn.Module, attr: str, param: torch.Tensor, init_std: float) -> InitRule | None:
    """How `module.<attr>` is initialised; None when no rule is known."""
    normal = InitRule("normal", 0.0, init_std)
    cls = type(module).__name__
    if cls in ("RMSNorm", "GatedRMSNorm"):
        return KEEP
    if cls == "GroupedExperts" and attr in ("w13", "w2"):
        return normal
    if cls == "TopKRouter" and attr == "weight":
        return normal
    # gpt-oss (models/biased_moe.py, models/attention.py): biased experts and router, attention sinks.
    if cls in ("BiasedGroupedExperts", "BiasedTopKRouter"):
        return normal if attr in ("w13", "w2", "weight") else KEEP  # b13, b2, bias: zeros
    if cls in ("Attention", "CompressedAttention") and attr == "sinks":
        return KEEP  # zeros
    # DeepSeek-V4 (models/compressed_attention.py, models/hyper_connections.py)
    if attr == "position_bias":  # the compressors' and the indexer's window-position gate bias: zeros
        return KEEP
    if cls == "HyperConnection":
        return normal if attr == "fn" else KEEP  # base zeros, scale ones
    if cls == "HyperHead":
        return normal if attr == "hc_fn" else KEEP
    if cls == "HashRouter" and attr == "weight":
        return normal
    if isinstance(module, nn.LayerNorm):  # the DSA indexer's k_norm (models/dsa.py): ones and zeros
        return KEEP
    if cls == "GatedDeltaNet" and attr == "A_log":
        return InitRule("uniform", 1.0, 16.0, torch.log)
    if cls == "GatedDeltaNet" and attr == "dt_bias":
        return InitRule("uniform", 0.0, 1.0, _dt_bias)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return normal if attr == "weight" else KEEP
    if isinstance(module, nn.Conv1d):  # PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), weight and bias
        fan_in = module.weight.shape[1] * math.prod(module.kernel_size)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        return InitRule("uniform", -bound, bound)
    return None


def _global_index(spec, start: int, end: int, device: torch.device) -> torch.Tensor:
    """Flat indices in the global tensor of the local elements start..end-1 (local row-major order)."""
    local = torch.arange(start, end, dtype=torch.int64, device=device)
    out = torch.zeros_like(local)
    stride = 1
    for d in reversed(range(len(spec.view_shape))):
        coord = local % spec.local_view[d]
        local = local // spec.local_view[d]
        out += (coord + spec.offsets[d]) * stride
        stride *= spec.view_shape[d]
    return out


@torch.no_grad()
def init_param_(param: torch.Tensor, name: str, seed: int, rule: InitRule) -> None:
    """Fill this rank's shard of parameter `name` with its seeded values (see the module docstring)."""
    if rule.kind == "keep" or param.is_meta or param.numel() == 0:
        return
    spec = get_shard(param)
    key = param_key(seed, name)
    flat = param.view(-1) if param.is_contiguous() else param.new_empty(param.numel())
    chunk = _CHUNK.get(param.device.type, 1 << 20)
    for start in range(0, param.numel(), chunk):
        end = min(start + chunk, param.numel())
        idx = _global_index(spec, start, end, param.device)
        if rule.kind == "normal":
            vals = rule.a + rule.b * normal_at(key, idx)
        elif rule.kind == "uniform":
            vals = rule.a + (rule.b - rule.a) * uniform_at(key, idx)
        else:
            raise ValueError(f"init rule kind={rule.kind!r} is invalid: allowed: normal | uniform | keep")
        if rule.transform is not None:
            vals = rule.transform(vals)
        flat[start:end].copy_(vals)
    if flat.data_ptr() != param.data_ptr():
        param.copy_(flat.view(param.shape))


@torch.no_grad()
def seeded_init_(model: nn.Module, seed: int, init_std: float, prefix: str = "") -> None:
    """Initialise every parameter of `model` from `seed`, identically on every layout.

    `prefix` is prepended to the parameter names (a part of a larger model, e.g. a pipeline stage
    built as its own module, passes its path in the full model).
    """
    done: set[int] = set()
    for mod_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in done:  # tied weights: the first name draws
                continue
            done.add(id(param))
            name = f"{prefix}{mod_name}.{attr}" if mod_name else f"{prefix}{attr}"
            rule = rule_for(module, attr, param, init_std)
            if rule is None:
                raise ValueError(
                    f"no seeded initialisation rule for parameter {name} ({type(module).__name__}.{attr}); "
                    "add one to moecore/models/init.py:rule_for"
                )
            init_param_(param, name, seed, rule)
