"""The loss-health rule (train/health.py): which losses are spikes, when a run of spikes
becomes the new level, and which checkpoint comes from before a blow-up."""
import pytest

from transformer_jax.train.health import SPIKE_FLOOR, LossWatch, last_good_step


def watch_of(losses, factor=3.0, window=100, start=1):
    warnings = []
    watch = LossWatch(factor, window, warn=warnings.append)
    watch.extend(range(start, start + len(losses)), losses)
    return watch, warnings


def test_threshold_is_factor_times_median_with_a_one_nat_floor():
    watch, _ = watch_of([2.0, 2.2, 1.8, 2.1, 1.9])            # median 2.0
    assert watch.threshold() == pytest.approx(6.0)             # 3 x 2.0 > 2.0 + 1
    small, _ = watch_of([0.05, 0.04, 0.06])                    # median 0.05
    assert small.threshold() == pytest.approx(0.05 + SPIKE_FLOOR)   # the floor wins
    assert LossWatch(None, 10).threshold() is None
    assert LossWatch(3.0, 10).threshold() is None              # no history yet


def test_a_blowup_is_a_streak_that_starts_at_the_first_spike():
    # steps 1..5 healthy (median 2.0), 6: 6.5 > 6.0 is the first spike, 7: 1e6
    watch, warnings = watch_of([2.0, 2.2, 1.8, 2.1, 1.9, 6.5, 1e6])
    assert not watch.healthy and watch.blowup_start() == 6
    assert watch.describe_spike() == ("the loss rose to 6.5 at step 6, above 3 x the median 2 "
                                      "of the last 5 healthy steps (loss_spike_factor)")
    assert warnings == []
    # a loss just under the threshold is healthy and ends the streak
    watch.add(8, 5.99)
    assert watch.healthy and watch.blowup_start() is None
    # spikes never enter the median: it is still over the six healthy losses
    assert watch.threshold() == pytest.approx(3 * 2.05)


def test_small_losses_do_not_spike_within_the_floor():
    watch, _ = watch_of([0.05, 0.04, 0.06, 0.9])   # 18x the median, but under 1 nat above it
    assert watch.healthy


def test_a_streak_as_long_as_the_window_becomes_the_new_level():
    watch, warnings = watch_of([2.0] * 4 + [9.0] * 3, window=4)
    assert not watch.healthy and watch.blowup_start() == 5
    watch.add(8, 9.0)                                       # the 4th spike in a row
    assert watch.healthy and watch.threshold() == pytest.approx(27.0)
    assert warnings == ["the loss has stayed above 6 for 4 steps (since step 5); taking it "
                        "as its new level"]


def test_detection_off_only_non_finite_counts():
    watch, _ = watch_of([2.0, 2.0, 1e9], factor=None)
    assert watch.healthy and watch.threshold() is None


@pytest.mark.parametrize("steps, blowup, good", [
    ([5, 10, 15], 16, 10),    # the loss of step 16 measures checkpoint 15: 15 is poisoned
    ([5, 10, 15], 17, 15),
    ([5, 10, 15], 11, 5),
    ([5, 10], 6, None),
    ([], 40, None),
])
def test_last_good_step_is_measured_by_the_next_loss(steps, blowup, good):
    assert last_good_step(steps, blowup) == good
