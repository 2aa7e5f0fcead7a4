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
