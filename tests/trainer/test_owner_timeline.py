"""An engine owner's record of what it did between two pushes (`rollout_worker.OwnerTimeline`): a
request a push lands in (partial rollouts) is split at the push, each part reported once."""

from __future__ import annotations

from megatron_dapo.trainer import rollout_worker
from megatron_dapo.trainer.rollout_worker import OwnerTimeline


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_a_push_lands_in_is_split_there(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(rollout_worker.time, "time", clock)
    timeline = OwnerTimeline()
    timeline.waited(0.5)
    timeline.started()  # t = 100
    clock.now = 103.0
    assert timeline.take() == (((100.0, 103.0),), 0.5)  # the push lands mid-request
    clock.now = 104.0
    timeline.ended()
    timeline.waited(0.25)
    timeline.started()
    clock.now = 106.0
    timeline.ended()
    assert timeline.take() == (((103.0, 104.0), (104.0, 106.0)), 0.25)
    assert timeline.take() == ((), 0.0)  # nothing since
