"""`moecore plan`: what fits, on how many GPUs, in which layout.

- `layout.py`: the `Layout` searched over and what the trainer supports of it;
- `params.py`: exact parameter / gradient / optimizer bytes per rank and stage;
- `activations.py`: what each module keeps for backward per micro-batch, per recomputation option;
- `memory.py`: the per-GPU peak of a training step;
- `schedule_memory.py`: the micro-batches each pipeline rank holds and the bubble, from torch's order of the schedule;
- `throughput.py`: the step-time estimate (FLOPs, communication, pipeline bubble);
- `search.py`: every valid layout for a GPU count, ranked;
- `report.py`: the table, the sentence explaining the top choice, JSON, and the CLI entry point;
- `preflight.py`: the memory check `moecore train` runs before building the model.
"""

from moecore.plan.layout import Layout, layout_of
from moecore.plan.memory import MemoryEstimate, PlanOptions, estimate_memory

__all__ = ["Layout", "MemoryEstimate", "PlanOptions", "estimate_memory", "layout_of"]
