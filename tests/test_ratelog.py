"""``Every``: at most one ``due`` per interval and key."""

import kvstore.ratelog as ratelog
from kvstore.ratelog import Every


def test_due_once_per_interval_per_key(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    e = Every(10.0)
    assert e.due() and not e.due()
    assert e.due("a") and not e.due("a")  # keys count apart
    now[0] = 109.9
    assert not e.due() and not e.due("a")
    now[0] = 110.0
    assert e.due() and e.due("a") and not e.due()


def test_tally_reports_how_many_since_the_last_line(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    e = Every(10.0)
    assert e.tally() == 1  # the first is let through, alone
    assert e.tally() == 0 and e.tally(5) == 0 and e.tally(key="b") == 1
    now[0] = 110.0
    assert e.tally(2) == 1 + 5 + 2  # what was held back, and these
    assert e.tally() == 0
    now[0] = 120.0
    assert e.tally(key="b") == 1
