"""The catalog: parent/children links, pin counts, disk state."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.catalog import Catalog

KEYS = [bytes([i]) * 32 for i in range(6)]

_OPS = st.lists(
    st.tuples(st.sampled_from(["pin", "unpin", "pin_many", "unpin_many"]),
              st.lists(st.sampled_from(KEYS), max_size=5)),
    max_size=40,
)


@given(_OPS)
@settings(max_examples=200)
def test_pin_counts_match_a_model(ops):
    """pin_many/unpin_many are pin/unpin per key; counts never go below zero."""
    cat, model = Catalog(), Counter()
    for op, keys in ops:
        if op == "pin_many":
            cat.pin_many(keys)
            model.update(keys)
        elif op == "unpin_many":
            cat.unpin_many(keys)
            for k in keys:
                if model[k] > 0:
                    model[k] -= 1
        else:
            for k in keys:
                if op == "pin":
                    cat.pin(k)
                    model[k] += 1
                else:
                    assert cat.unpin(k) is (model[k] > 0)
                    model[k] = max(0, model[k] - 1)
        for k in KEYS:
            assert cat.is_pinned(k) is (model[k] > 0)
        assert cat.pinned_count == sum(1 for k in KEYS if model[k] > 0)


def test_links_and_forget():
    cat = Catalog()
    a, b, c, d = KEYS[:4]
    cat.add(a, None)
    cat.add(b, a)
    cat.add(c, b)
    cat.add(d, a)
    cat.add(b, d)  # already known: the first parent stays
    assert cat.parent(b) == a and cat.children(a) == {b, d}
    assert cat.descendants_postorder(a)[-1] == a
    assert set(cat.descendants_postorder(a)) == {a, b, c, d}
    post = cat.descendants_postorder(a)
    assert post.index(c) < post.index(b)  # children before parents
    cat.pin(c)
    cat.mark_dirty(c)
    cat.forget(c)
    assert c not in cat and not cat.is_pinned(c) and not cat.is_dirty(c)
    assert not cat.has_children(b)
    cat.set_on_disk(b)
    cat.mark_dirty(b)  # on disk already: not dirty
    assert cat.on_disk(b) and not cat.is_dirty(b)
    cat.mark_dirty(d)
    assert cat.take_dirty(5) == [d] and cat.dirty_count == 0
    assert cat.use(a) == 1 and cat.use(a) == 2
