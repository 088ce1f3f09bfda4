"""When things happen, as pure functions of the global step (testable with explicit numbers)."""

from __future__ import annotations

import dataclasses

from engine.errors import UserError


@dataclasses.dataclass(frozen=True)
class Schedule:
    total_steps: int
    steps_per_epoch: int
    steps_per_loop: int
    eval_every: int = 0  # 0: at each epoch end; -1: never (a sidecar evaluator or --mode=eval does it)
    checkpoint_every: int = 0  # 0: at each epoch end
    histogram_every: int = 0  # 0: no histograms
    marks: tuple = ()  # further steps a loop must end on (e.g. the profiled range)

    def __post_init__(self):
        for name in ("total_steps", "steps_per_epoch", "steps_per_loop"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def eval_interval(self) -> int:
        """Steps between evaluations; 0: none in training."""
        return 0 if self.eval_every < 0 else self.eval_every or self.steps_per_epoch

    @property
    def checkpoint_interval(self) -> int:
        return self.checkpoint_every or self.steps_per_epoch

    def next_loop_steps(self, step: int) -> int:
        """Steps of the next compiled loop: steps_per_loop, cut short at an eval, checkpoint or
        histogram point, a mark, or the end, so those happen at exactly the requested steps."""
        limit = min(self.steps_per_loop, self.total_steps - step)
        for interval in (self.eval_interval, self.checkpoint_interval, self.histogram_every):
            if interval:
                limit = min(limit, interval - step % interval)
        for mark in self.marks:
            if mark > step:
                limit = min(limit, mark - step)
        return limit

    def eval_due(self, step: int) -> bool:
        if not self.eval_interval:
            return False
        return step % self.eval_interval == 0 or step == self.total_steps

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_interval == 0 or step == self.total_steps

    def histogram_due(self, step: int) -> bool:
        return bool(self.histogram_every) and step % self.histogram_every == 0

    def epoch(self, step: int) -> int:
        """Epochs completed at `step`."""
        return step // self.steps_per_epoch
