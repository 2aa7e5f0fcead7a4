import threading
import time

import pytest

from kvstore import Transfer, TransferError


def test_completed():
    t = Transfer.completed(5, num_layers=2)
    assert t.done() and t.wait() == 5 and t.result() == 5
    t.wait_layer(1)


def test_layerwise_readiness_from_another_thread():
    t: Transfer[int] = Transfer(num_layers=3)
    seen = []

    def producer():
        for i in range(3):
            time.sleep(0.01)
            t.set_layers_ready(i + 1)
        t.set_result(7)

    th = threading.Thread(target=producer)
    th.start()
    t.wait_layer(0, timeout=5)
    seen.append(t.done())
    assert t.wait(timeout=5) == 7
    th.join()
    assert seen == [False]


def test_error_and_timeout():
    t: Transfer[int] = Transfer(num_layers=1)
    with pytest.raises(TimeoutError):
        t.wait(timeout=0.01)
    with pytest.raises(IndexError):
        t.wait_layer(3)
    t.set_error(OSError("disk gone"))
    assert t.done() and isinstance(t.exception(), OSError)
    with pytest.raises(TransferError, match="disk gone"):
        t.wait()
    with pytest.raises(TransferError):
        t.wait_layer(0)
    assert "failed" in repr(t)
