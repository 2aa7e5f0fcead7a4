"""The shared-memory data plane of the sidecar daemon: leases on warm slots, granted puts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.api import PutGrant
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey


class SharedMemoryOps:
    """Leases and granted puts (mixin of :class:`kvstore.store.Store`)."""

    # -- shared-memory data plane (used by the sidecar daemon) -------------------------------
    def lookup_split(self, keys: list[BlockKey]) -> int:
        """:meth:`lookup` for keys the daemon split from one wire blob: each is known to be a
        32-byte ``bytes``, so the per-key type checks are skipped (the 1,024-key round trip
        is latency-critical)."""
        return self._lookup(keys)

    def count_lookups(self, lookups: int, hits: int, misses: int) -> None:
        """Add lookups answered elsewhere (the daemon's clients probe its key directory
        themselves) to this store's counters."""
        with self._lock:
            c = self._counters
            c.lookups += lookups
            c.hits += hits
            c.misses += misses

    def lease_warm(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], list[int]]:
        """Pin the leading held run of ``keys`` *in the warm tier* and return it with its slots.

        Blocks only on disk are read into the warm tier first. The caller reads the slots
        (e.g. through a shared-memory mapping of the warm slab) and must then call
        :meth:`release_lease` with the returned keys. The run may be shorter than a lookup
        said (damage, or no room to stage a block).
        """
        ks = self._keys(keys)
        if self._warm is None:
            raise ConfigError("leases need a warm tier (cpu_capacity > 0)")
        self._fetch(ks, self._chain_parent(keys), None, want_result=False).wait()
        with self._lock:
            self._check_open()
            warm, cat = self._warm, self._catalog
            got: list[BlockKey] = []
            slots: list[int] = []
            for k in ks:
                if k not in warm or k in self._pending:
                    break
                cat.pin(k)
                got.append(k)
                slots.append(warm.slot(k))
            warm.touch(reversed(got))
            c = self._counters
            c.fetches += 1
            c.fetched_blocks += len(got)
            c.fetch_short += len(ks) - len(got)
            return got, slots

    def release_lease(self, keys: Sequence[bytes]) -> None:
        """Release what :meth:`lease_warm` pinned."""
        with self._lock:
            for k in keys:
                self._catalog.unpin(BlockKey(bytes(k)))

    def grant_put(self, keys: Sequence[bytes]) -> PutGrant:
        """Reserve warm slots for the blocks of ``keys`` not held yet (nothing visible yet).

        Fill ``grant.slots`` with the blocks at ``grant.positions``, then call
        :meth:`commit_put` (or :meth:`abort_put`). Blocks that find no room are left out.
        """
        ks = self._keys(keys)
        parent = self._chain_parent(keys)
        if self._warm is None:
            raise ConfigError("granted puts need a warm tier (cpu_capacity > 0)")
        with self._lock:
            self._check_open()
            c = self._counters
            c.puts += 1
            on_disk = self._disk_run(ks)
            grant = PutGrant([], [], [], [], 0)
            prev = parent
            seen: set[BlockKey] = set()  # a key twice in one put must not take two slots
            for i, k in enumerate(ks):
                if i < on_disk or self._held(k) or k in self._granted or k in seen:
                    grant.duplicates += 1
                elif prev is None or self._held(prev) or prev in self._granted or (
                    grant.keys and grant.keys[-1] == prev) or (i and i - 1 < on_disk) or (
                    i == 0 and self._disk is not None and self._disk_run([prev]) == 1):
                    grant.keys.append(k)
                    grant.parents.append(prev)
                    grant.positions.append(i)
                    seen.add(k)
                else:
                    c.put_dropped += len(ks) - i
                    break
                prev = k
            c.put_duplicates += grant.duplicates
            for k, par in zip(grant.keys, grant.parents, strict=True):
                self._catalog.add(k, par)  # protects the parents while we make room
            slots = self._reserve(self._warm, len(grant.keys)) if grant.keys else []
            for k in reversed(grant.keys[len(slots):]):
                self._catalog.forget(k)
            c.put_dropped += len(grant.keys) - len(slots)
            del grant.keys[len(slots):], grant.parents[len(slots):], grant.positions[len(slots):]
            grant.slots = slots
            for k in grant.keys:
                self._granted.add(k)
                self._catalog.pin(k)
            return grant

    def commit_put(self, grant: PutGrant) -> int:
        """Publish a granted put whose slots were filled; returns the blocks stored."""
        with self._lock:
            if self._closed:
                return 0
            warm, cat = self._warm, self._catalog
            assert warm is not None
            for k, s in zip(grant.keys, grant.slots, strict=True):
                self._granted.discard(k)
                cat.unpin(k)
                warm.insert(k, s)
                if self._writer is not None and self.config.admission == "always":
                    cat.mark_dirty(k)
            self._counters.put_blocks += len(grant.keys)
            self._touch_chain(grant.keys)
        if grant.keys and self._writer is not None:
            self._writer.notify()
        return len(grant.keys)

    def abort_put(self, grant: PutGrant) -> None:
        """Give back a granted put's slots (a client died mid-put): nothing becomes visible."""
        with self._lock:
            if self._closed:
                return
            warm, cat = self._warm, self._catalog
            assert warm is not None
            for k, s in zip(grant.keys, grant.slots, strict=True):
                self._granted.discard(k)
                cat.unpin(k)
                if k in cat and not self._held(k):
                    cat.forget(k)
                warm.release(s)
            self._counters.put_dropped += len(grant.keys)

    @property
    def warm_slab(self) -> torch.Tensor | None:
        """The warm tier's ``[slots, block_nbytes]`` bytes (for the daemon's shared memory)."""
        return None if self._warm is None else self._warm.slab.data
