"""The console progress line: updated in place on a terminal, one plain line per loop in a log."""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    def __init__(self, total_steps: int, steps_per_epoch: int, start_step: int = 0, stream=None, enabled=True):
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.in_place = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._start_step = start_step
        self._start_time = time.perf_counter()
        self._open_line = False

    def line(self, step: int, metrics: dict, examples_per_sec: float) -> str:
        epoch = step / self.steps_per_epoch
        done = step - self._start_step
        elapsed = time.perf_counter() - self._start_time
        eta = elapsed / done * (self.total_steps - step) if done else 0.0
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        width = len(str(self.total_steps))
        return (
            f"epoch {epoch:5.2f}  step {step:>{width}}/{self.total_steps}  {shown}  "
            f"{examples_per_sec:,.0f} ex/s  ETA {format_duration(eta)}"
        )

    def update(self, step: int, metrics: dict, examples_per_sec: float) -> None:
        if not self.enabled:
            return
        text = self.line(step, metrics, examples_per_sec)
        if self.in_place:
            self.stream.write("\r\033[K" + text)
            self._open_line = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (eval results, checkpoints), without breaking the in-place line."""
        if not self.enabled:
            return
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()
