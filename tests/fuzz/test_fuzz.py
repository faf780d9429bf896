"""Structure-aware fuzzing of every decoder that reads what a peer sends: a short run.

``bench/fuzz.py`` runs the same targets for a million cases; what each one
feeds and checks is in ``targets.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st

from tests.fuzz.targets import TARGETS, KnownIssue, Meter, Target

# A few seconds for all targets together. No shrinking-time explanation phase:
# it traces every line, which is slow and allocates on the decoders' account.
SHORT = settings(max_examples=40, phases=[p for p in Phase if p is not Phase.explain])


@pytest.mark.parametrize("target", TARGETS, ids=lambda target: target.name)
@SHORT
@given(data=st.data())
def test_only_our_errors_come_out_and_memory_stays_bounded(
    target: Target, data: st.DataObject
) -> None:
    case = data.draw(target.strategy, label="case")
    try:
        target.run(case, Meter())
    except KnownIssue as issue:  # reported, with its own test in test_findings.py
        event(f"known issue {issue.key}")
