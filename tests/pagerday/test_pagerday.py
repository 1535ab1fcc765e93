"""A pager day on one host (issue 31, item 5): two real demo servers with identical titles, one
host-wide ``servewatch run``, a scripted day of deploys, profiles, load, hangs, crashes, stops
and an orphaned engine; the test fails on any false or missed incident and prints the table.

The day, its expectations and how incidents are counted: :mod:`tests.pagerday.day`. The same day
with its table printed: ``python bench/bench_pagerday.py``. Run alone with::

    python -m pytest tests/pagerday -q -p no:cacheprovider

About 3.5 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from tests.pagerday.day import EVENTS, format_table, play_day, totals

pytestmark = pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE)


def test_every_event_lists_its_expected_incidents() -> None:
    names = [e.name for e in EVENTS]
    assert names == ["deploy", "restart", "profile", "load", "hangs", "crash", "crash_loop", "stop", "orphan", "hard"]
    assert sum(len(e.expected) for e in EVENTS) == 6
    hangs = next(e for e in EVENTS if e.name == "hangs")
    assert {(x.server, x.culprit) for x in hangs.expected} == {("A", "TP1"), ("B", "TP0")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pager_day_opens_every_expected_incident_and_nothing_else(tmp_path: Path) -> None:
    rows = play_day(tmp_path)
    table = format_table(rows)
    print(table)
    _, _, false, missed = totals(rows)
    assert (false, missed) == (0, 0), f"{false} false and {missed} missed incident(s):\n{table}"
