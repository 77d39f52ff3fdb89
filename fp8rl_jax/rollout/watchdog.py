"""A stall watchdog for host loops that drive device programs.

A device program that never finishes (e.g. a kernel that deadlocks) blocks the host thread inside
XLA, where no Python exception can reach it: the job hangs until an outer limit kills it, and says
nothing. A `StallWatchdog` runs beside the loop; the loop calls `beat` whenever it makes progress
(a prefill group, a decode chunk); when no beat has come for ``seconds`` it reports the last
progress and every thread's stack, then acts (by default: exit code 3, so a scheduler restarts the
job from its last checkpoint instead of holding the GPUs forever).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

STALL_EXIT_CODE = 3


def _exit_process(_: str) -> None:
    os._exit(STALL_EXIT_CODE)


class StallWatchdog:
    """Calls ``on_stall(message)`` once when ``beat`` has not been called for ``seconds``.

    ``name`` heads the message. The default ``on_stall`` exits the process with
    `STALL_EXIT_CODE` after the message and the thread stacks are written to stderr (the stalled
    thread cannot be interrupted). Use as a context manager, or call `stop` when the loop ends.
    """

    def __init__(self, seconds: float, name: str = "stall watchdog",
                 on_stall: Callable[[str], None] | None = None, hint: str = ""):
        if not seconds > 0:
            raise ValueError(f"StallWatchdog needs seconds > 0, got {seconds!r}")
        self.seconds, self.name, self.hint = float(seconds), name, hint
        self.on_stall = _exit_process if on_stall is None else on_stall
        self.last, self.info = time.perf_counter(), "started"
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{name} watchdog", daemon=True)
        self._thread.start()

    def beat(self, info: Any = None) -> None:
        """Progress was made; ``info`` (JSON-able) is what a stall report shows as the last one."""
        self.last = time.perf_counter()
        if info is not None:
            self.info = info

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> "StallWatchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            idle = time.perf_counter() - self.last
            if idle <= self.seconds:
                continue
            self.fired = True
            msg = (f"{self.name}: no progress for {idle:.0f} s (limit {self.seconds:.0f} s); last progress: "
                   f"{json.dumps(self.info, default=str)}" + (f". {self.hint}" if self.hint else ""))
            print(msg, file=sys.stderr, flush=True)
            _dump_stacks()
            self.on_stall(msg)
            return


def _dump_stacks() -> None:
    """Every thread's Python stack to stderr (faulthandler needs no GIL, which the stalled thread
    may hold); a stderr without a file descriptor (a test's capture) gets the traceback module's."""
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):
        for tid, frame in sys._current_frames().items():
            print(f"thread {tid}:\n" + "".join(traceback.format_stack(frame)), file=sys.stderr)
    sys.stderr.flush()
