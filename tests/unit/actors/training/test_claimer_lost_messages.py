"""The claimer's defined outcomes for lost messages and restarts (issue 28, part 4): a gap in the builder's landing
numbers is counted as dropped and announced, a fixed step is announced again until StepApplied comes, and the
journal a restarted claimer continues from."""

from __future__ import annotations

import attrs

from gyre.actors.training.microstep_claimer import MicroStepLedger, check_exactly_once
from gyre.messages.samples import LandingsLost
from gyre.messages.training import StepApplied, StepReady

from tests.unit.actors.training.test_microstep_claimer import claim, config, group


def numbered(name: str, seq: int, sent_before: int, executions: int = 2, version: int = 0):
    landed = group(name, [[10]] * executions, version)
    return attrs.evolve(landed, landing_seq=seq, samples_sent=sent_before + len(landed.samples))


def test_a_gap_in_the_landing_numbers_is_counted_dropped_and_announced():
    ledger = MicroStepLedger(config(groups_per_step=1))
    assert ledger.land(numbered("a", 1, 0)) and ledger.counts["samples_dropped_in_transit"] == 0  # step 0 fixed
    published = ledger.land(numbered("c", 3, 4))  # landing 2 ("b", 2 samples) never came
    lost = [m for m in published if isinstance(m, LandingsLost)]
    assert lost == [LandingsLost(1, 2, "in transit", 0, 0)]
    stats = ledger.statistics()
    assert stats.samples_dropped_in_transit == 2 and stats.samples_landed == 6
    check_exactly_once(stats)
    # Landing 2 arriving after its gap was counted (overtaken): taken after all, the count undone and said.
    assert LandingsLost(-1, -2, "arrived late", 0, 0) in ledger.land(numbered("b", 2, 2))
    stats = ledger.statistics()
    assert stats.samples_landed == 6 and stats.samples_dropped_in_transit == 0 and stats.samples_in_flight == 6
    check_exactly_once(stats)


def test_a_repeat_is_refused_by_execution_and_a_builder_restart_numbers_afresh():
    ledger = MicroStepLedger(config(groups_per_step=4))
    ledger.land(numbered("a", 1, 0))
    ledger.land(numbered("b", 2, 2))
    ledger.land(numbered("b", 2, 2))  # a duplicate delivery
    assert ledger.counts["samples_duplicate"] == 2 and ledger.counts["samples_dropped_in_transit"] == 0
    ledger.land(numbered("x", 1, 0))  # the builder restarted: its numbering starts again
    ledger.land(numbered("y", 2, 2))
    stats = ledger.statistics()
    assert stats.samples_dropped_in_transit == 0 and stats.samples_landed == 10
    check_exactly_once(stats)


def test_a_fixed_step_is_announced_again_until_its_step_applied_comes():
    ledger = MicroStepLedger(config(groups_per_step=1, step_ready_resend_s=2.0, max_step_ready_resends=2))
    ready = [m for m in ledger.land(group("a", [[10], [10]])) if isinstance(m, StepReady)]
    assert len(ready) == 1
    ledger.ready_published(10.0)
    assert ledger.ready_due(11.0) == []
    assert ledger.ready_due(12.0) == ready
    ledger.ready_published(12.0)
    assert ledger.ready_due(14.5) == ready
    ledger.ready_published(14.5)
    assert ledger.ready_due(100.0) == []  # bounded
    assert ledger.statistics().step_ready_resends == 2
    claim(ledger)
    ledger.step_applied(StepApplied(0, 1, 0.1, 1.0, 20, 2, 0))
    assert ledger.ready_due(200.0) == [] and not ledger.step_fixed


def test_a_restarted_ledger_continues_from_the_journal_with_what_was_in_flight_counted():
    ledger = MicroStepLedger(config(groups_per_step=1))
    ledger.land(numbered("a", 1, 0))
    claim(ledger)
    ledger.step_applied(StepApplied(0, 1, 0.1, 1.0, 20, 2, 0))
    ledger.land(numbered("b", 2, 2, version=1))
    journal = ledger.journal_state()
    assert journal["granted"] is False and journal["groups"] == ["b"]  # step 1 was fixed by "b", not claimed
    assert journal["in_flight"] == 2
    fresh = MicroStepLedger(config(groups_per_step=1))
    lost = fresh.restore_journal(journal)
    assert lost == [LandingsLost(1, 2, "claimer restarted", 1, 1)]
    stats = fresh.statistics()
    assert (stats.step_id, stats.base_version, stats.samples_trained) == (1, 1, 2)
    assert stats.samples_dropped_restart == 2 and stats.samples_in_flight == 0
    check_exactly_once(stats)
    # The next landing continues the numbering: no gap is seen.
    fresh.land(numbered("c", 3, 4, version=1))
    assert fresh.statistics().samples_dropped_in_transit == 0
    # The boundary of step 0 still serves a checkpoint.
    state, groups = fresh.checkpoint_state(0)
    assert state["step_id"] == 1 and "b" in groups


def test_the_journal_says_when_a_step_was_handed_out():
    ledger = MicroStepLedger(config(groups_per_step=1))
    ledger.land(group("a", [[10], [10]]))
    assert ledger.journal_state()["granted"] is False
    claim(ledger)
    assert ledger.journal_state()["granted"] is True
