"""Admin library behind ``kvstore ls / inspect / rm / prune / verify / compact / stats``.

Every function takes a store path (default ``$KVSTORE_PATH`` or ``~/.cache/kvstore``), never
creates a store, is safe while engines and daemons use it, and returns a frozen dataclass
(``to_jsonable`` turns it into the CLI's JSON). See ``docs/cli.md``.
"""

from kvstore.admin.common import (
    AdminError,
    StoreNotFoundError,
    StoreServedError,
    default_store_path,
    format_age,
    to_jsonable,
)
from kvstore.admin.compaction import CompactReport, compact
from kvstore.admin.filters import FilterError, parse_filter, parse_sort
from kvstore.admin.findings import FindingEntry
from kvstore.admin.inventory import (
    BlockEntry,
    Fragmentation,
    HitCounters,
    IndexInfo,
    Listing,
    NamespaceEntry,
    NamespaceStats,
    PathStats,
    StoreSummary,
    TargetSummary,
    TierUsage,
    inspect_store,
    inspect_target,
    list_blocks,
    list_namespaces,
    store_stats,
)
from kvstore.admin.live import (
    DaemonNamespaceStats,
    DaemonStats,
    DaemonUnavailableError,
    daemon_stats,
)
from kvstore.admin.pruning import PruneResult, prune
from kvstore.admin.removal import (
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
from kvstore.admin.verification import VerifyResult, verify

__all__ = [
    "AdminError",
    "BlockEntry",
    "CompactReport",
    "DaemonNamespaceStats",
    "DaemonStats",
    "DaemonUnavailableError",
    "FilterError",
    "FindingEntry",
    "Fragmentation",
    "HitCounters",
    "IndexInfo",
    "Listing",
    "NamespaceEntry",
    "NamespaceStats",
    "NamespaceTarget",
    "PathStats",
    "PruneResult",
    "RemovalPlan",
    "RemovalResult",
    "RepairPlan",
    "StoreNotFoundError",
    "StoreServedError",
    "StoreSummary",
    "TargetSummary",
    "TargetError",
    "TierUsage",
    "VerifyResult",
    "compact",
    "daemon_stats",
    "default_store_path",
    "execute_removal",
    "format_age",
    "inspect_store",
    "inspect_target",
    "list_blocks",
    "list_namespaces",
    "parse_filter",
    "parse_sort",
    "plan_removal",
    "preview_removal",
    "prune",
    "remove",
    "repair",
    "store_stats",
    "to_jsonable",
    "verify",
]
