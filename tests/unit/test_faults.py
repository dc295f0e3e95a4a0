"""Fault plans: what tests and chaos runs inject, parsed and scheduled."""

import pytest

from p2pdiloco.faults import FaultPlan, FaultPlanError


def test_a_kill_planned_at_a_version_is_due_from_it_on_so_a_peer_that_starts_behind_still_dies():
    """A peer that starts behind the others may first contribute from an older version than planned, then skip
    the planned one: the kill must still come, at its first all-reduce from that version or later."""
    plan = FaultPlan.parse("die_in_allreduce@1")
    assert not plan.due("die_in_allreduce", 0)
    assert plan.due("die_in_allreduce", 1) and plan.due("die_in_allreduce", 3)
    assert not plan.due("die_while_sharing", 5) and not FaultPlan().due("die_in_allreduce", 9)


def test_a_bad_fault_is_refused_with_what_is_expected():
    for bad in ("explode@1", "die_in_allreduce@x", "die_in_allreduce"):
        with pytest.raises(FaultPlanError, match="ACTION@VERSION"):
            FaultPlan.parse(bad)


def test_a_faulty_averager_speaks_the_production_averagers_protocol():
    """hivemind names RPCs after the servicer's class: a faulty subclass under its own name reached no peer (every
    fault test then ran without its fault)."""
    from p2pdiloco.faults.averager import FaultyAverager
    from p2pdiloco.swarm.averager import ExactAverager

    for rpc in ("rpc_codes_push", "rpc_codes_fetch", "rpc_state_part", "rpc_join_group"):
        assert FaultyAverager._get_handle_name("run", rpc) == ExactAverager._get_handle_name("run", rpc)
