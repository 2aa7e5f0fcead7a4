"""``WriteBehind``: the background writer's thread and its ``flush`` barrier."""

import threading
import time

from kvstore.store.writer import WriteBehind


def test_a_ticket_flush_returns_once_the_owner_reports_it_reached_while_work_goes_on():
    """Work that always has more (puts that never pause) never gives an idle pass: a flush
    with a ticket returns once the owner reports the ticket reached, one without waits."""
    progress = [0]
    stop = threading.Event()

    def work() -> bool:
        progress[0] += 1
        if w.waiting() is not None and progress[0] >= 50:
            w.reached(progress[0])
        time.sleep(0.001)
        return not stop.is_set()

    w = WriteBehind(work, "test-writer")
    w.notify()
    try:
        assert w.flush(10, ticket=40)
        assert w.waiting() is None  # the ticket left with its flush
        assert not w.flush(0.2)  # no ticket: waits for an idle pass that never comes
    finally:
        stop.set()
        w.close()


def test_reached_is_a_high_water_mark():
    stop = threading.Event()

    def work() -> bool:  # never idle: only reached() can end a flush
        time.sleep(0.001)
        return not stop.is_set()

    w = WriteBehind(work, "test-writer")
    w.notify()
    try:
        w.reached(9)
        w.reached(3)  # never goes back
        assert w.flush(5, ticket=8)
        assert w.flush(5, ticket=9)
        assert not w.flush(0.3, ticket=10)
    finally:
        stop.set()
        w.close()
