"""`trainrec.adapter_kit.settle`, without a framework: a difference is refused naming it and
the `allow_changes` that allows it; an allowed one is returned; one with a `refusal` (its
live value would be kept yet not take effect) is refused even when allowed, with its
reason, and never suggested."""

from __future__ import annotations

import pytest

from trainrec import RecordMismatchError
from trainrec.adapter_kit import Change, field_changes, settle

FIELDS = {"scheduler.T_max", "scheduler.base_lrs"}


def test_a_difference_is_refused_naming_it_and_the_entry_that_allows_it():
    changes = field_changes({"scheduler.T_max": 6}, {"scheduler.T_max": 60})
    with pytest.raises(RecordMismatchError, match=r"scheduler\.T_max: 6 in the record, 60 live\. Build it\. "
                                                  r"To resume .* allow_changes=\{'scheduler\.T_max'\}"):
        settle(changes, FIELDS, frozenset(), "the schedule", "Build it.")
    assert settle(changes, FIELDS, frozenset({"scheduler.T_max"}), "the schedule") == {"scheduler.T_max"}


def test_a_change_with_a_refusal_is_refused_even_when_allowed_and_never_suggested():
    refused = Change("scheduler.base_lrs", [0.01], [0.1], refusal="it would not take effect; do X")
    for allow in (frozenset(), frozenset({"scheduler.base_lrs"})):
        with pytest.raises(RecordMismatchError) as e:
            settle([refused], FIELDS, allow, "the schedule")
        said = str(e.value)
        assert "scheduler.base_lrs cannot be allowed: it would not take effect; do X." in said
        assert "allow_changes=" not in said and e.value.key == "scheduler.base_lrs"
    other = field_changes({"scheduler.T_max": 6}, {"scheduler.T_max": 60})
    with pytest.raises(RecordMismatchError) as both:
        settle([refused, *other], FIELDS, frozenset(), "the schedule")
    assert "allow_changes={'scheduler.T_max'} " in str(both.value)  # the one that can be allowed, alone
