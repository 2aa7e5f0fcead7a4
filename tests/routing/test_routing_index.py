"""PrefixIndex against a reference model: per engine a plain dict of block -> media, with the
same rules (a block needs its parent held; a block leaving its last medium takes its
descendants), matched by a linear scan."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.routing.index import PrefixIndex

N = 24
PARENT = {i: (None if i % 6 == 0 else i - 1) for i in range(N)}  # chains 0-5, 6-11, ...
PARENT.update({20: 3, 21: 20, 22: 9})  # branches


def chain(i):
    out = []
    while i is not None:
        out.append(i)
        i = PARENT[i]
    return out[::-1]


class Reference:
    def __init__(self):
        self.held = {}  # engine -> {block: set(media)}

    def stored(self, e, blocks, medium):
        h = self.held.setdefault(e, {})
        prev = PARENT[blocks[0]] if blocks else None
        if prev is not None and prev not in h:
            return
        for b in blocks:
            h.setdefault(b, set()).add(medium)

    def removed(self, e, blocks, medium):
        h = self.held.setdefault(e, {})
        for b in blocks:
            if b not in h:
                continue
            h[b].discard(medium) if medium is not None else h[b].clear()
            if not h[b]:
                doomed = [x for x in h if b in chain(x)]
                for x in doomed:
                    del h[x]

    def match(self, e, prompt):
        h = self.held.get(e, {})
        n = 0
        while n < len(prompt) and prompt[n] in h:
            n += 1
        return n


def run_of(start, length):
    """``length`` blocks along PARENT's chains from ``start`` (each the parent of the next)."""
    out = [start]
    while len(out) < length:
        kids = [c for c, p in PARENT.items() if p == out[-1]]
        if not kids:
            break
        out.append(min(kids))
    return out


op = st.one_of(
    st.tuples(st.just("stored"), st.integers(0, 2), st.integers(0, N - 1), st.integers(1, 6),
              st.sampled_from(["GPU", "CPU", "STORAGE"])),
    st.tuples(st.just("removed"), st.integers(0, 2), st.lists(st.integers(0, N - 1), max_size=4),
              st.sampled_from(["GPU", "CPU", "STORAGE", None])),
    st.tuples(st.just("cleared"), st.integers(0, 2)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_index_matches_the_reference(script):
    idx, ref = PrefixIndex(), Reference()
    names = ["a", "b", "c"]
    for n in names:
        idx.add_engine(n)
    for o in script:
        e = names[o[1]]
        if o[0] == "stored":
            blocks = run_of(o[2], o[3])
            idx.apply(e, [BlockStored(tuple(blocks), PARENT[blocks[0]], (), 16, o[4])])
            ref.stored(e, blocks, o[4])
        elif o[0] == "removed":
            idx.apply(e, [BlockRemoved(tuple(o[2]), o[3])])
            ref.removed(e, o[2], o[3])
        else:
            idx.apply(e, [AllBlocksCleared()])
            ref.held[e] = {}
    for leaf in range(N):
        prompt = chain(leaf) + [99]  # a block nobody has at the end
        got = idx.match(prompt)
        assert got.blocks == tuple(ref.match(n, prompt) for n in names), prompt
    st_ = idx.stats()
    assert st_.blocks == tuple(len(ref.held.get(n, {})) for n in names)
    assert st_.unique_blocks == len(set().union(*(ref.held.get(n, {}) for n in names)))


def test_match_of_a_long_prompt_probes_few_blocks():
    class Counting(dict):
        probes = 0

        def get(self, k, d=None):
            Counting.probes += 1
            return super().get(k, d)

    idx = PrefixIndex()
    keys = [i.to_bytes(32, "big") for i in range(8192)]
    for e, n in (("a", 100), ("b", 5000), ("c", 8192), ("d", 0)):
        idx.add_engine(e)
        if n:
            idx.apply(e, [BlockStored(tuple(keys[:n]), None, (), 16, "CPU")])
    idx._held = Counting(idx._held)
    m = idx.match(keys)
    assert m.blocks == (100, 5000, 8192, 0) and m.longest == 8192 and m.of("b") == 5000
    assert Counting.probes < 4 * 14  # engines x log2(blocks), not 8192


def test_engines_come_and_go():
    idx = PrefixIndex()
    for e in "abc":
        idx.add_engine(e)
    idx.apply("b", [BlockStored((1, 2, 3), None, (), 16, "GPU")])
    idx.apply("c", [BlockStored((1,), None, (), 16, "GPU")])
    idx.remove_engine("b")
    assert idx.engines == ("a", "c")
    assert idx.match([1, 2, 3]).blocks == (0, 1)
    idx.add_engine("d")  # reuses b's bit: must not inherit b's blocks
    assert idx.match([1, 2, 3], ["d", "c", "zz"]).blocks == (0, 1, 0)
    assert idx.stats().unique_blocks == 1
    with pytest.raises(KeyError, match="add_engine"):
        idx.apply("b", [])


def test_orphans_are_dropped_and_counted():
    idx = PrefixIndex()
    idx.add_engine("a")
    r = idx.apply("a", [BlockStored((2, 3), 1, (), 16, "CPU")])
    assert (r.stored, r.dropped) == (0, 2) and idx.stats().dropped == 2
    r = idx.apply("a", [BlockStored((1,), None, (), 16, "CPU"),
                        BlockStored((2, 3), 1, (), 16, "STORAGE"),
                        BlockRemoved((1,), "CPU"), AllBlocksCleared()])
    assert (r.stored, r.removed, r.cleared) == (3, 3, True)
    assert idx.media_of("a", 2) == ()
