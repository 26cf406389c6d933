"""The hybrid DeltaNet model (tiny-qwen3-next) under context parallel trains like the one-process run.

tiny-qwen3-next cut to 2 layers (a gated DeltaNet layer, then Qwen3-Next's gated full attention) and a
64-token vocabulary, with the DeltaNet kernel's chunk at 16 and sequence 40: the sequence is not a
multiple of the kernel's chunk, and neither are the CP chunks (10 tokens at cp2, 5 at cp4). 3 AdamW
steps with clipping (gloo on CPU, fp32, some padding): losses, grad norms and every parameter's
first-step gradient against the one-process run, relative 1e-5 (the issue's bar). Layouts: cp2 and cp4
with the ring and the all-gather exchange for the attention layer, cp2 x ep2, cp2 x dp2, and cp2 x tp2
(DeltaNet heads split over TP, each TP rank passing its heads' state maps over CP) with and without
sequence parallel, and cp2 x dp2 with FSDP2.
"""

from __future__ import annotations

import pytest
from dist_parity import compare, make_data, reference, run_layout

from moecore.config import load_config
from moecore.parallel.launch import run_local

pytestmark = pytest.mark.distributed

SEQ = 40


def _config(**parallel):
    cfg = load_config("tiny-qwen3-next")
    m = cfg.model
    m.vocab_size, m.num_layers, m.layer_types = 64, 2, ["linear_attention", "full_attention"]
    m.linear_chunk_size = 16
    cfg.moe.token_dispatcher_type = "alltoall"
    cfg.train.seq_length, cfg.train.global_batch_size, cfg.train.micro_batch_size = SEQ, 8, 2
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg.validate()


LAYOUTS = {  # world -> parallel overrides
    2: [{"cp": 2}, {"cp": 2, "cp_comm": "allgather"}],
    4: [
        {"cp": 4},
        {"cp": 4, "cp_comm": "allgather"},
        {"cp": 2, "ep": 2},
        {"cp": 2},  # cp 2 x dp 2
        {"cp": 2, "tp": 2},
        {"cp": 2, "tp": 2, "sequence_parallel": True},
        {"cp": 2, "fsdp": True},  # FSDP2 over cp 2 x dp 2 (experts over edp 4)
    ],
}


def _run_all(rank: int, world: int, ref: dict, data) -> list[dict]:
    return [run_layout(rank, world, _config(**p), ref[0], data) for p in LAYOUTS[world]]


@pytest.fixture(scope="module")
def ref_and_data():
    data = make_data(seq=SEQ)
    return reference(_config(), data), data


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_deltanet_context_parallel_matches_single_process(world: int, ref_and_data) -> None:
    ref, data = ref_and_data
    results = run_local(_run_all, world, ref, data, timeout_s=600)
    for parallel, got in zip(LAYOUTS[world], results[0]):
        r = compare(ref[1], got)
        print(parallel, {k: v for k, v in r.items()})
        assert max(r["loss"], r["norm"], r["grad"]) <= 1e-5, (parallel, r)
