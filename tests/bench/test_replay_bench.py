"""The replay benchmark section's rows (quick sizes; figures are not asserted: no timed
tests)."""

from kvstore.bench import BenchRow
from kvstore.bench import replay as section
from kvstore.replay.workloads import ChatWorkload, chat_trace


def test_trace_rows_compare_with_lru_through_the_store():
    rows = section.trace_rows(chat_trace(ChatWorkload(requests=300)), "chat", store=True,
                              goal=True)
    assert [r.goal for r in rows] == [section.GOAL, section.GOAL, None]
    for r in rows:
        assert isinstance(r, BenchRow) and r.ref_name == "LRU" and "through the store" in r.note
        assert 0 <= r.value <= 1 and "Belady bound" in r.note


def test_bookkeeping_rows():
    rows = section.policy_rows(quick=True) + section.bookkeeping_rows(quick=True)
    assert [r.unit for r in rows] == ["us"] * 5
    # the budget row for a big tier and for a small one (its shadows sample more keys)
    assert [r.ref_name for r in rows[1:3]] == ["budget", "budget"]
    assert "5,000-slot" in rows[1].name and "1,000-slot" in rows[2].name


def test_find_trace_honours_the_environment(tmp_path, monkeypatch):
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    monkeypatch.setenv("KVSTORE_TRACE", str(t))
    assert section.find_trace() == t
    monkeypatch.setenv("KVSTORE_TRACE", str(tmp_path / "missing.jsonl"))
    assert section.find_trace() is None
