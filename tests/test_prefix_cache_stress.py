"""Prefix caching under random schedules (tests/prefix_cache_sim.py): the scheduler's cuts, copies,
sharing and eviction keep every cache row what its readers expect, whatever arrives, ends or is
preempted when."""

from __future__ import annotations

import pytest

from tests.prefix_cache_sim import run


@pytest.mark.parametrize("seed", range(24))
def test_random_schedules_keep_the_caches_consistent(seed):
    sim, params = run(seed)  # raises on any broken invariant, or when requests stop making progress
    assert not sim.sched.has_unfinished()
