"""Preemption: stop signals (SIGTERM, SIGUSR1, ... from `train.stop_signals`) end the run cleanly.

A handler only records the request; the training loop agrees on it over every rank once per step
(inside the step guard's single all-reduce, moecore/train/guards.py), so all ranks finish the same
step, save the same checkpoint and exit together with `EXIT_PREEMPTED`, whichever ranks the
scheduler's signal reached first.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: a temporary failure, run the same command again to resume


class StopRequest:
    """Installs handlers for the named signals (main thread only) and remembers the first one received."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for name in self.names:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()
