"""Flow control's counters on their own (routing/flow_counters.py): the labels of each count and
the bound on tenant labels."""

from __future__ import annotations

import pytest

from kvroute.routing.flow_counters import TENANT_LABELS, FlowCounters, class_name


@pytest.mark.parametrize("priority, expected", [(1, "high"), (0, "normal"), (-1, "low"), (7, "normal")])
def test_class_name(priority: int, expected: str) -> None:
    assert class_name(priority) == expected


def test_admissions_and_sheds_are_counted_by_their_labels() -> None:
    c = FlowCounters()
    c.count_admitted("m", 0, waited=False)
    c.count_admitted("m", 0, waited=False)
    c.count_admitted("m", 1, waited=True)
    c.count_shed("m", "ttl", -1)
    assert c.admitted == {("m", "at_once", "normal"): 2, ("m", "after_wait", "high"): 1}
    assert c.shed == {("m", "ttl", "low"): 1}


def test_tenant_labels_are_bounded_per_model_and_kept_by_the_first_seen() -> None:
    c = FlowCounters()
    for i in range(TENANT_LABELS + 5):
        c.count_served("m", f"t{i}", 10)
    c.count_served("m", "t0", 1)  # a labelled tenant keeps its label
    c.count_served("n", "late", 3)  # another model has labels of its own
    assert c.tenant_tokens[("m", "t0")] == 11
    assert c.tenant_tokens[("m", "other")] == 5 * 10
    assert len([k for k in c.tenant_tokens if k[0] == "m"]) == TENANT_LABELS + 1
    assert c.tenant_tokens[("n", "late")] == 3
    assert c.tenant_label("m", f"t{TENANT_LABELS + 1}") == "other"
