"""Filter / sort grammar of ``kvstore ls`` and the human formatting helpers (pure, fast)."""

from __future__ import annotations

import pytest

from kvstore.admin import FilterError, format_age, parse_filter, parse_sort
from kvstore.admin.filters import BLOCK_FIELDS, NAMESPACE_FIELDS, apply, parse_duration
from kvstore.admin.inventory import BlockEntry, NamespaceEntry

NOW = 1_800_000_000.0


def ns(model="m/a", size=1000, hits=0, accessed=NOW - 60, blocks=1, revision="", tiers=("disk",),
       nid="ab" * 32) -> NamespaceEntry:
    return NamespaceEntry(
        namespace_id=nid, model_id=model, model_revision=revision, dtype="bfloat16",
        layout="bfloat16 L2 P2 T4 H2 D16", block_shape=(2, 2, 4, 2, 16), block_nbytes=1024,
        tp_rank=0, tp_size=1, format_version=1, extras=(), blocks=blocks, stored_bytes=size,
        raw_bytes=size, hits=hits, created=accessed, last_accessed=accessed, tiers=tiers,
    )


def block(key="cd" * 32, parent=None, size=1024) -> BlockEntry:
    return BlockEntry(key=key, namespace_id="ab" * 32, model_id="m/a", parent=parent,
                      stored_bytes=size, raw_bytes=size, codec="none", segment=3, offset=80,
                      checksum="0" * 16, created=NOW - 10, last_accessed=NOW - 10, hits=2,
                      tiers=("disk",))


@pytest.mark.parametrize("expr,entry,want", [
    ("size>1GB", ns(size=2 * 10**9), True),
    ("size>1GB", ns(size=10**9), False),
    ("size>=1GB", ns(size=10**9), True),
    ("size<1.5KiB", ns(size=1000), True),
    ("size = 1000", ns(size=1000), True),
    ("accessed>7d", ns(accessed=NOW - 8 * 86400), True),  # older than 7 days
    ("accessed>7d", ns(accessed=NOW - 6 * 86400), False),
    ("accessed<1h", ns(accessed=NOW - 120), True),
    ("accessed<1h", ns(accessed=NOW - 7200), False),
    ("accessed>1y", ns(accessed=None), True),  # never accessed counts as oldest
    ("model=m/a", ns(), True),
    ("model==m/a", ns(), True),
    ("model=m/A", ns(), False),  # exact
    ("model~M/", ns(), True),  # substring, case-insensitive
    ("model!~llama", ns(), True),
    ("model!=m/a", ns(), False),
    ("revision=", ns(revision=""), True),
    ("tier=disk", ns(), True),
    ("tier=warm", ns(), False),
    ("tier!=hot", ns(), True),
    ("hits>=3", ns(hits=3), True),
    ("hits>=3", ns(hits=2), False),
    ("blocks!=1", ns(blocks=1), False),
    ("id=ABAB", ns(), True),  # hex prefix, case-insensitive
    ("id=abac", ns(), False),
])
def test_namespace_filters(expr, entry, want):
    assert parse_filter(expr, "namespaces").matches(entry, NOW) is want


@pytest.mark.parametrize("expr,entry,want", [
    ("parent=none", block(parent=None), True),
    ("parent=none", block(parent="ee" * 32), False),
    ("parent!=none", block(parent="ee" * 32), True),
    ("parent=eeee", block(parent="ee" * 32), True),
    ("key=cdcd", block(), True),
    ("codec=none", block(), True),
    ("segment=3", block(), True),
    ("created<1m", block(), True),
    ("namespace=ab", block(), True),
])
def test_block_filters(expr, entry, want):
    assert parse_filter(expr, "blocks").matches(entry, NOW) is want


def test_filter_errors_name_keys_and_operators():
    with pytest.raises(FilterError) as e:
        parse_filter("sise>1GB")
    msg = str(e.value)
    assert "unknown key 'sise'" in msg
    for k in NAMESPACE_FIELDS:
        assert k in msg
    with pytest.raises(FilterError, match=r"operator '~' does not apply to 'size'.*= != > >= < <="):
        parse_filter("size~1GB")
    with pytest.raises(FilterError, match=r"'1XB' is not a size"):
        parse_filter("size>1XB")
    with pytest.raises(FilterError, match=r"not a duration.*7d"):
        parse_filter("accessed>7 fortnights")
    with pytest.raises(FilterError, match=r"write KEY OP VALUE.*operators: = != ~ !~ > >= < <="):
        parse_filter("size")
    with pytest.raises(FilterError, match=r"unknown tier 'gpu'.*hot, warm, disk"):
        parse_filter("tier=gpu")
    with pytest.raises(FilterError, match=r"not an integer"):
        parse_filter("hits>many")
    with pytest.raises(FilterError, match=r"not hex"):
        parse_filter("id=xyz")
    # a blocks-only key used for namespaces says how to get it
    with pytest.raises(FilterError, match=r"'codec' is a key of blocks: add --blocks"):
        parse_filter("codec=zstd", "namespaces")
    with pytest.raises(FilterError) as e:
        parse_filter("revision=x", "blocks")
    assert all(k in str(e.value) for k in BLOCK_FIELDS)
    assert "'revision' is a key of namespaces: drop --blocks" in str(e.value)


def test_durations():
    assert parse_duration("30s") == 30
    assert parse_duration("10m") == 600
    assert parse_duration("1.5h") == 5400
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("2w") == 14 * 86400
    assert parse_duration("1y") == 365 * 86400
    assert parse_duration("90") == 90


def test_sort_defaults_and_errors():
    a = ns(model="b", size=5, accessed=NOW - 10, nid="01" * 32)
    b = ns(model="a", size=7, accessed=NOW - 1000, nid="02" * 32)
    c = ns(model="c", size=6, accessed=None, nid="03" * 32)
    items = [a, b, c]
    assert parse_sort("size").sort(items) == [b, c, a]  # largest first
    assert parse_sort("size:asc").sort(items) == [a, c, b]
    assert parse_sort("model").sort(items) == [b, a, c]  # text: ascending
    assert parse_sort("model:desc").sort(items) == [c, a, b]
    assert parse_sort("accessed").sort(items) == [a, b, c]  # most recent first, never last
    assert parse_sort("accessed:asc").sort(items) == [c, b, a]  # least recently used first
    with pytest.raises(FilterError, match=r"unknown key 'colour'.*size"):
        parse_sort("colour")
    with pytest.raises(FilterError, match=r"'asc' or 'desc'"):
        parse_sort("size:up")


def test_apply_filters_all_must_match_and_limit():
    items = [ns(model=f"m/{i}", size=i, nid=f"{i:064x}") for i in range(10)]
    out, matched = apply(items, [parse_filter("size>=3"), parse_filter("size<8")],
                         parse_sort("size"), 2, now=NOW)
    assert matched == 5 and [e.stored_bytes for e in out] == [7, 6]
    out, matched = apply(items, [], None, None, now=NOW, default_key=lambda e: -e.stored_bytes)
    assert matched == 10 and out[0].stored_bytes == 9
    with pytest.raises(FilterError):
        apply(items, [], None, -1, now=NOW)


def test_format_age():
    assert format_age(None) == "never"
    assert format_age(NOW - 5, NOW) == "5 s ago"
    assert format_age(NOW - 180, NOW) == "3 min ago"
    assert format_age(NOW - 3 * 3600, NOW) == "3 h ago"
    assert format_age(NOW - 86400, NOW) == "1 day ago"
    assert format_age(NOW - 5 * 86400, NOW) == "5 days ago"
    assert format_age(NOW - 21 * 86400, NOW) == "3 weeks ago"
    assert format_age(NOW - 400 * 86400, NOW) == "13 months ago"
    assert format_age(NOW - 800 * 86400, NOW) == "2 years ago"
