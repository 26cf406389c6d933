"""The counter-based generator behind the seeded initialisation (moecore/models/init.py) against a
plain-Python splitmix64, its normal draws' moments, and the refusal of parameters without a rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moecore.models.init import normal_at, param_key, seeded_init_, uniform_at

_M = (1 << 64) - 1


def _splitmix_uniform(key: int, counter: int) -> float:
    z = (counter * 0x9E3779B97F4A7C15 + key) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def test_uniform_is_splitmix64():
    key = param_key(7, "layers.0.attn.q_proj.weight")
    counters = [0, 1, 2, 99991, 2**40 + 17, 2**62 - 1]
    got = uniform_at(key, torch.tensor(counters)).tolist()
    assert got == [_splitmix_uniform(key & _M, c) for c in counters]


def test_normal_moments_and_streams_differ_by_name_and_seed():
    idx = torch.arange(400_000)
    z = normal_at(param_key(1, "a"), idx)
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1) < 5e-3
    assert 0.0015 < (z.abs() > 3).double().mean().item() < 0.0040  # two-sided tail of N(0,1): 0.0027
    assert not torch.equal(z[:100], normal_at(param_key(1, "b"), idx[:100]))
    assert not torch.equal(z[:100], normal_at(param_key(2, "a"), idx[:100]))


def test_unknown_parameter_is_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(3))

    with pytest.raises(ValueError, match="no seeded initialisation rule for parameter scale"):
        seeded_init_(Odd(), 0, 0.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draws_the_cpu_values():
    """The integer hash is exact on both devices; log / cos may differ in the last bit of a double."""
    from moecore.config import Config
    from moecore.models.transformer import MoETransformer

    cfg = Config()
    cfg.model.vocab_size = 256
    cpu = dict(MoETransformer(cfg).named_parameters())
    with torch.device("cuda"):
        gpu = dict(MoETransformer(cfg).named_parameters())
    for name, p in cpu.items():
        torch.testing.assert_close(gpu[name].cpu(), p, rtol=1e-6, atol=0, msg=name)
