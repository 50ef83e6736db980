"""Which training losses are healthy, and which checkpoints come from before a blow-up.

A loss is *healthy* when it is finite and not a spike. A spike is a loss above
``factor`` times the median of the last ``window`` healthy losses and at least one nat
above that median (the floor keeps small losses, e.g. 0.05 -> 0.2 on a hard batch, from
counting). The loop saves a checkpoint only while the loss is healthy, and when the loss
turns non-finite it uses :meth:`LossWatch.blowup_start` to name a checkpoint from before
the blow-up.

The loss logged at step ``k`` is that of the parameters after ``k - 1`` updates, so the
checkpoint of step ``S`` is measured by the loss of step ``S + 1``: a checkpoint is from
before a blow-up that starts at step ``B`` when ``S + 1 < B`` (:func:`last_good_step`).

A run of spikes longer than ``window`` steps is taken as the loss's new level (a change of
data or objective, not a blow-up): the median restarts from those losses, with a warning.
"""
from __future__ import annotations

import collections
import statistics
from typing import Callable, Iterable, Optional

SPIKE_FLOOR = 1.0   # nats: a spike is also at least this far above the median


class LossWatch:
    """Feeds on every step's loss in order (:meth:`add`); says whether the latest is healthy.

    Args:
      factor: a loss above ``factor`` x the recent median (and ``SPIKE_FLOOR`` above it)
        is a spike; None turns spike detection off (only non-finite losses count).
      window: how many recent healthy losses the median covers.
      warn: where the "new level" warning goes.
    """

    def __init__(self, factor: Optional[float], window: int,
                 warn: Callable[[str], None] = print):
        self.factor, self.window, self.warn = factor, window, warn
        self.history: collections.deque = collections.deque(maxlen=window)
        self.streak: list[tuple[int, float]] = []   # the current run of spikes: (step, loss)
        self.first_spike: Optional[tuple[int, float, float]] = None   # (step, loss, median)

    def threshold(self) -> Optional[float]:
        """The loss above which the next loss is a spike (None: no history or detection off)."""
        if self.factor is None or not self.history:
            return None
        median = statistics.median(self.history)
        return max(self.factor * median, median + SPIKE_FLOOR)

    def add(self, step: int, loss: float) -> None:
        """Record the finite loss of ``step`` (non-finite losses are the caller's to stop on)."""
        limit = self.threshold()
        if limit is not None and loss > limit:
            if not self.streak:
                self.first_spike = (step, loss, statistics.median(self.history))
            self.streak.append((step, loss))
            if len(self.streak) >= self.window:
                self.warn(f"the loss has stayed above {limit:.4g} for {len(self.streak)} steps "
                          f"(since step {self.streak[0][0]}); taking it as its new level")
                self.history.clear()
                self.history.extend(loss for _, loss in self.streak)
                self.streak = []
            return
        self.streak = []
        self.history.append(loss)

    def extend(self, steps: Iterable[int], losses: Iterable[float]) -> None:
        for step, loss in zip(steps, losses):
            self.add(step, loss)

    @property
    def healthy(self) -> bool:
        """Whether the latest loss was healthy (no spike in progress)."""
        return not self.streak

    def blowup_start(self) -> Optional[int]:
        """The first step of the spikes in progress, or None."""
        return self.streak[0][0] if self.streak else None

    def describe_spike(self) -> str:
        """The spike in progress, e.g. ``loss 41.3 at step 52 is above 3 x the median 2.1 ...``."""
        step, loss, median = self.first_spike if self.streak else (None, None, None)
        if step is None:
            return "no spike"
        return (f"the loss rose to {loss:.4g} at step {step}, above {self.factor:g} x the median "
                f"{median:.4g} of the last {len(self.history)} healthy steps (loss_spike_factor)")


def last_good_step(steps: Iterable[int], blowup: int) -> Optional[int]:
    """The newest checkpoint step from before a blow-up whose first bad loss is at step
    ``blowup``: the newest ``S`` with ``S + 1 < blowup`` (see the module docstring)."""
    good = [s for s in steps if s + 1 < blowup]
    return max(good) if good else None
