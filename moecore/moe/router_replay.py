"""Router replay: record every MoE router's expert choice, then force the same choice in a later forward.

Reinforcement-learning fine-tuning computes the policy's log-probabilities twice: once in the rollout
(inference) and once in training. With an MoE policy the two forwards may pick different experts for
the same token (other kernels, other batch shapes, a router that moved), which biases the importance
ratios. Recording the rollout's routing and replaying it in training removes that difference.

`RouterReplay` is the store, held by whoever runs the model (the Trainer, or an RL loop); there is no
module-level state. `attach_router_replay(model, store)` points every `TopKRouter` in `model` at the
store under its module name (e.g. `layers.1.mlp.router`). Then, per router and in call order:
- mode `record`: each forward appends its top-k indices [T, K] (int32 on the CPU) to the store;
- mode `replay`: each forward takes the next recorded [T, K] instead of its own top-k; the routing
  weights are still computed from the current scores at those indices (softmax / renormalisation /
  scaling as configured), so gradients reach the router as usual.

Activation recomputation runs a layer's forward again inside backward; that call is not recorded
(record) and reuses the indices of the forward it recomputes (replay), in the order the forwards
with gradients ran. The file written by `save` is a `torch.save` of
`{"version": 1, "topk": K, "layers": {name: [tensor [T, K] per forward]}}`.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from torch import nn

from moecore.config import MoEConfig
from moecore.moe.router import TopKRouter

MODES = ("record", "replay")
FILE_VERSION = 1


def _in_backward() -> bool:
    """True while autograd runs a backward pass (recomputation of a checkpointed layer)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def rank_path(path: str | Path, rank: int = 0, world_size: int = 1) -> Path:
    """The file of one rank: `path` on one process, `path.rank-R` with several (each routes its own tokens)."""
    return Path(path) if world_size <= 1 else Path(f"{path}.rank-{rank}")


class RouterReplay:
    """Per-router lists of top-k indices, one entry per forward, in call order."""

    def __init__(self, mode: str, records: dict[str, list[torch.Tensor]] | None = None, topk: int | None = None):
        if mode not in MODES:
            raise ValueError(f"moe.router_replay_mode={mode!r} is invalid: allowed: record | replay")
        self.mode = mode
        self.topk = topk
        self.records: dict[str, list[torch.Tensor]] = {} if records is None else records
        self._cursor: dict[str, int] = {}  # replay: forwards served so far, per router
        self._grad_positions: dict[str, deque] = {}  # replay: entries used by forwards with grad, for recompute

    # ------------------------------------------------------------------ files
    @classmethod
    def load(cls, path: str | Path) -> RouterReplay:
        """A store in replay mode from a file written by `save`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"moe.router_replay_path={str(path)!r} is invalid: no such file to replay")
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("version") != FILE_VERSION or "layers" not in data:
            raise ValueError(f"moe.router_replay_path={str(path)!r} is invalid: not a moecore router replay file")
        return cls("replay", {k: list(v) for k, v in data["layers"].items()}, data.get("topk"))

    def save(self, path: str | Path) -> Path:
        """Write the recorded indices (see the module docstring for the format)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"version": FILE_VERSION, "topk": self.topk, "layers": self.records}, path)
        return path

    def num_forwards(self, key: str) -> int:
        return len(self.records.get(key, []))

    def rewind(self) -> None:
        """Replay from the first recorded forward again."""
        self._cursor.clear()
        self._grad_positions.clear()

    # ------------------------------------------------------------------ called by TopKRouter.forward
    def replayed(self, key: str, num_tokens: int, memo: dict | None = None) -> torch.Tensor | None:
        """Replay mode: the recorded [T, K] indices for this forward of router `key`; None in record mode.

        `memo`: the router's dict for the checkpointed call it runs in (moecore/models/recompute.py
        `checkpoint_module`): the forward notes its position there and each recomputation reads it back. Without
        one, recomputations take the positions of the forwards with gradients first in, first out."""
        if self.mode != "replay":
            return None
        entries = self.records.get(key)
        if entries is None:
            raise ValueError(f"router replay: the recording has no router {key!r} (recorded: {sorted(self.records)})")
        if _in_backward():
            if memo is not None and "replay_position" in memo:
                pos = memo["replay_position"]
            else:
                pending = self._grad_positions.get(key)
                if not pending:
                    raise ValueError(f"router replay: router {key!r} recomputed in backward without a matching forward")
                pos = pending.popleft()
        else:
            pos = self._cursor.get(key, 0)
            self._cursor[key] = pos + 1
            if memo is not None:
                memo["replay_position"] = pos
            elif torch.is_grad_enabled():
                self._grad_positions.setdefault(key, deque()).append(pos)
        if pos >= len(entries):
            raise ValueError(
                f"router replay: router {key!r} is called for forward {pos + 1} but the recording holds "
                f"{len(entries)} forwards"
            )
        idx_TK = entries[pos]
        if idx_TK.shape[0] != num_tokens:
            raise ValueError(
                f"router replay: router {key!r} forward {pos + 1} routes {num_tokens} tokens but "
                f"{idx_TK.shape[0]} were recorded (same batch shapes and order as the recording are needed)"
            )
        return idx_TK

    def recorded(self, key: str, idx_TK: torch.Tensor) -> None:
        """Record mode: keep this forward's top-k indices (not the recomputation inside backward)."""
        if self.mode != "record" or _in_backward():
            return
        self.topk = idx_TK.shape[1]
        self.records.setdefault(key, []).append(idx_TK.detach().to("cpu", torch.int32))


def attach_router_replay(
    model: nn.Module, store: RouterReplay | None, require_router: bool = True
) -> RouterReplay | None:
    """Point every TopKRouter of `model` at `store` (None detaches); checks a replay store fits the model.

    `require_router=False`: `model` may hold no router (a pipeline stage of dense layers only); its store then
    records nothing, and replays a recording of nothing."""
    routers = [(name, m) for name, m in model.named_modules() if isinstance(m, TopKRouter)]
    if store is not None and not routers and require_router:
        raise ValueError("moe.router_replay_mode is invalid for this model: it has no MoE router")
    if store is not None and store.mode == "replay":
        names = {name for name, _ in routers}
        if set(store.records) != names:
            missing = sorted(names - set(store.records)) or sorted(set(store.records) - names)
            raise ValueError(
                f"router replay: recorded routers do not match the model's (first differing: {missing[0]})"
            )
        for _, m in routers:
            if store.topk is not None and store.topk != m.topk:
                raise ValueError(f"router replay: recorded top-k {store.topk} != moe.router_topk={m.topk}")
    for name, m in routers:
        m.replay = store
        m.replay_key = name
    return store


def setup_router_replay(
    model: nn.Module, cfg: MoEConfig, rank: int = 0, world_size: int = 1, require_router: bool = True
) -> RouterReplay | None:
    """The store `moe.router_replay_mode` asks for, attached to `model`; None with mode none.

    Each rank keeps its own file (`rank_path`): its routers' choices for the tokens it routed. Under pipeline
    parallel a rank holds its stages' routers only (`require_router=False`: a stage may have none); router names
    keep the model's layer numbers, so a replay must run the layout it was recorded under."""
    if cfg.router_replay_mode == "none":
        return None
    if cfg.router_replay_mode == "replay":
        store = RouterReplay.load(rank_path(cfg.router_replay_path, rank, world_size))
    else:
        store = RouterReplay("record")
    return attach_router_replay(model, store, require_router)
