"""Changing a store while engines use it: ``rm`` (:mod:`~kvstore.admin.removal`), ``prune``
(:mod:`~kvstore.admin.pruning`), ``verify`` (:mod:`~kvstore.admin.verification`; its result
carries a repair plan that :func:`~kvstore.admin.repairing.repair` carries out) and
``compact`` (:mod:`~kvstore.admin.compaction`), re-exported here under their old home.

Every change goes through :class:`~kvstore.tiers.disk.DiskTier`, which takes LMDB's write
lock like every engine and unlinks a payload file only after the transaction that removed its
last record has committed; readers in other processes that find a file gone re-read the
record (compaction) or see a miss (removal) — never wrong bytes. A store that a
``kvstore serve`` daemon serves is changed through the daemon (``rm``) or not at all
(``prune``, ``repair``, ``compact`` raise :class:`~kvstore.admin.common.StoreServedError`):
its warm tier would keep serving what the disk no longer holds.
"""

from kvstore.admin.compaction import CompactReport, compact
from kvstore.admin.findings import DEFAULT_GRACE_S, FindingEntry
from kvstore.admin.pruning import PruneResult, prune
from kvstore.admin.removal import (
    MIN_PREFIX,
    NamespaceTarget,
    RemovalPlan,
    RemovalResult,
    TargetError,
    execute_removal,
    plan_removal,
    preview_removal,
    remove,
)
from kvstore.admin.repairing import RepairPlan, repair
from kvstore.admin.verification import VerifyProgress, VerifyResult, verify

__all__ = [
    "DEFAULT_GRACE_S",
    "MIN_PREFIX",
    "CompactReport",
    "FindingEntry",
    "NamespaceTarget",
    "PruneResult",
    "RemovalPlan",
    "RemovalResult",
    "RepairPlan",
    "TargetError",
    "VerifyProgress",
    "VerifyResult",
    "compact",
    "execute_removal",
    "plan_removal",
    "preview_removal",
    "prune",
    "remove",
    "repair",
    "verify",
]
