"""The shared key directory: the daemon writes, clients probe (native C and numpy paths)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import SizeError
from kvstore.tiers import key_directory as kd
from kvstore.tiers.key_directory import KeyDirectory, capacity_for


def _key(i: int, home: int) -> bytes:
    # first word chooses the home entry (collisions on purpose), the rest tells keys apart
    return (home | (i << 32)).to_bytes(8, "little") + i.to_bytes(24, "little")


UNIVERSE = [_key(i, home=i % 5) for i in range(24)]  # 24 keys over 5 home entries
OPS = st.lists(st.tuples(st.booleans(), st.integers(0, len(UNIVERSE) - 1)), max_size=120)
QUERIES = st.lists(st.integers(0, len(UNIVERSE) - 1), max_size=12)


def _run(model: dict, query: list[int]) -> int:
    n = 0
    for i in query:
        if UNIVERSE[i] not in model:
            break
        n += 1
    return n


@pytest.fixture(params=["native", "numpy"])
def probe(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(kd, "_native", None)
    elif kd._native is None:
        pytest.skip("native extension not built")
    return request.param


@given(ops=OPS, queries=st.lists(QUERIES, max_size=5))
@settings(max_examples=150, deadline=None)
def test_matches_a_dict_under_inserts_removals_and_rebuilds(tmp_path_factory, ops, queries):
    path = str(tmp_path_factory.mktemp("kd") / "slab.keys")
    w = KeyDirectory.create(path, 12)  # 32 entries: removals soon force rebuilds
    r = KeyDirectory.open_readonly(path)
    model: dict[bytes, int] = {}
    try:
        for slot, (add, i) in enumerate(ops):
            k = UNIVERSE[i]
            if add and k not in model and len(model) < 12:
                w.insert(k, slot)
                model[k] = slot
            elif not add:
                w.remove(k)
                model.pop(k, None)
        for q in queries:
            blob = b"".join(UNIVERSE[i] for i in q)
            want = _run(model, q)
            assert r.leading_run(blob) == want
            saved = kd._native
            kd._native = None
            try:
                assert r.leading_run(blob) == want
            finally:
                kd._native = saved
    finally:
        r.close()
        w.close()


def test_reader_sees_writes_at_once_and_cannot_write(tmp_path, probe):
    path = str(tmp_path / "slab.keys")
    w = KeyDirectory.create(path, 1000)
    r = KeyDirectory.open_readonly(path)
    keys = [os.urandom(32) for _ in range(1000)]
    for i, k in enumerate(keys):
        w.insert(k, i)
    blob = b"".join(keys)
    assert r.leading_run(blob) == 1000 and r.leading_run(b"") == 0
    w.remove(keys[400])
    assert r.leading_run(blob) == 400
    assert r.leading_run(os.urandom(32) + blob) == 0
    with pytest.raises(ValueError):
        r.table[0, 0] = 1
    assert capacity_for(1000) == 2048 and r.capacity == 2048
    r.close()  # a probe after (or racing) close sees an empty table, not an error
    assert r.leading_run(blob) == 0
    w.close()


def test_bad_files_are_refused(tmp_path):
    p = tmp_path / "bad.keys"
    p.write_bytes(b"x" * 200)
    with pytest.raises(SizeError, match="magic"):
        KeyDirectory.open_readonly(str(p))
    p.write_bytes(b"kvkeys01" + (1 << 20).to_bytes(8, "little") + bytes(48))
    with pytest.raises(SizeError, match="does not fit"):
        KeyDirectory.open_readonly(str(p))
    if kd._native is not None:
        with pytest.raises(ValueError, match="magic"):
            kd._native.directory_run(b"y" * 200, b"")
        with pytest.raises(ValueError, match="does not fit"):
            kd._native.directory_run(p.read_bytes(), b"")
        good = tmp_path / "good.keys"
        KeyDirectory.create(str(good), 4).close()
        with pytest.raises(ValueError, match="32-byte"):
            kd._native.directory_run(good.read_bytes(), b"k" * 31)
