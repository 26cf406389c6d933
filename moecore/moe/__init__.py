"""Mixture-of-Experts core: router, balancing losses, token permutation, dispatchers, grouped experts, MoELayer.

Entry point: `moecore.moe.layer.MoELayer`; the phases and formulas are described in docs/moe.md.
"""
