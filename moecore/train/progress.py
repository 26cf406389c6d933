"""The console progress bar of a training run: step, loss, tokens/s and time left."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """A rich progress bar that shows the latest loss and throughput; silent when disabled."""

    def __init__(self, console: Console | None, total: int, start: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.loss = float("nan")
        self.tps = 0.0
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, loss=self.loss, tps=self.tps)

    def __enter__(self) -> TrainProgress:
        if self.enabled:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.__exit__(*exc)

    def update(self, step: int, metrics: dict) -> None:
        self.loss = metrics.get("loss", self.loss)
        self.tps = metrics.get("tokens_per_s", self.tps)
        if self.enabled:
            self.progress.update(self.task, completed=step, loss=self.loss, tps=self.tps)
