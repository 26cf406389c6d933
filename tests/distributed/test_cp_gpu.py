"""Context-parallel attention on GPUs (NCCL): every path against one GPU at sequence 16384.

Runs tests/distributed/cp_gpu_worker.py under torchrun with cp = 2 (and cp = 4 where 4 GPUs exist);
see that file for the cases and the bar. Skipped without 2 CUDA GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import MULTI_GPU

pytestmark = MULTI_GPU

WORKER = Path(__file__).with_name("cp_gpu_worker.py")


@pytest.mark.parametrize("gpus", [2, 4])
def test_cp_attention_paths_match_one_gpu_at_seq_16384(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), str(WORKER), "16384"]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 10, proc.stdout
