"""File modes of a store (docs/operations.md, "File modes"): private whatever the umask, or
shared with one group on request.

- Private (the default): directories ``0700``, files ``0600``.
- Shared with a group (``open_store(group=)``, ``kvstore serve --group``): directories
  ``2750`` (setgid: what is created in them belongs to the group), files ``0640``, and
  ``index/lock.mdb`` ``0660`` (LMDB readers record themselves in it; it holds no KV).

A store records its sharing in its root directory: setgid with group read and search means
shared with the directory's group; anything else is private. Whatever creates a file or
directory in the store takes the mode from the directory it creates it in
(:func:`file_mode_in`, :func:`make_dirs`) and sets it with ``fchmod``/``chmod``, so the
umask never widens (nor, for the group, narrows) it.

On open (:func:`check_store`) a store that users other than its owner (and its group, when
shared) can write is refused (:class:`~kvstore.errors.StorePermissionError`, naming the path
and the ``chmod`` that fixes it); a writable open sets the modes of one that others can read
(stores of older versions: ``0755``/``0644``) with a WARNING naming what changed. Read-only
opens change nothing; ``kvstore verify`` reports loose modes (:func:`loose_paths`).
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.errors import ConfigError, StorePermissionError

log = logging.getLogger("kvstore.modes")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
SHARED_DIR = 0o2750
SHARED_FILE = 0o640
#: LMDB's lock file of a shared store: group readers write their reader slot into it
SHARED_LMDB_LOCK = 0o660
LMDB_LOCK = "lock.mdb"

#: the entries of a store's root directory that are the store's (the rest is never touched)
_STORE_ENTRIES = ("index", "segments", "daemon.lock")
_STORE_PREFIXES = ("index.",)  # index.damaged-<time>/, index.recover-<time>-<pid>/


@dataclass(frozen=True, slots=True)
class StoreModes:
    """The modes a store's files and directories get: private, or shared with ``gid``."""

    gid: int | None = None

    @property
    def shared(self) -> bool:
        return self.gid is not None

    @property
    def dir_mode(self) -> int:
        return SHARED_DIR if self.shared else PRIVATE_DIR

    def file_mode(self, name: str = "") -> int:
        if not self.shared:
            return PRIVATE_FILE
        return SHARED_LMDB_LOCK if name == LMDB_LOCK else SHARED_FILE

    def mode_for(self, path: str, st: os.stat_result) -> int:
        return (self.dir_mode if stat.S_ISDIR(st.st_mode)
                else self.file_mode(os.path.basename(path)))

    def describe(self) -> str:
        return f"shared with group {group_name(self.gid)}" if self.shared else "private"


def group_name(gid: int | None) -> str:
    if gid is None:
        return "-"
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def resolve_group(group: str | int | None) -> int | None:
    """``group=`` of ``open_store`` / ``--group``: a group name or a gid (None: none)."""
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, (str, int)):
        raise ConfigError(f"group must be a group name or a gid, got {group!r}")
    if isinstance(group, int) or group.isdigit():
        gid = int(group)
        if gid < 0:
            raise ConfigError(f"group must be a group name or a gid >= 0, got {group}")
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"group {group!r} does not exist (give a group name from "
                          "/etc/group, or a gid)") from None


def _shared_dir(st: os.stat_result) -> bool:
    return bool(st.st_mode & stat.S_ISGID) and st.st_mode & 0o050 == 0o050


def modes_of(directory: str | os.PathLike[str]) -> StoreModes:
    """The sharing ``directory`` records: setgid with group read and search is shared with
    its group; anything else (or no such directory) is private."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return StoreModes()
    return StoreModes(st.st_gid) if _shared_dir(st) else StoreModes()


def resolve_modes(root: str | os.PathLike[str], group: str | int | None) -> StoreModes:
    """The modes of the store at ``root`` opened with ``group=``: shared with that group, or
    (``None``) as the store records it (private for a new store)."""
    gid = resolve_group(group)
    return StoreModes(gid) if gid is not None else modes_of(root)


def file_mode_in(directory: str | os.PathLike[str], name: str = "") -> int:
    """The mode of a file ``name`` created in ``directory`` (as the directory records)."""
    return modes_of(directory).file_mode(name)


# -- creating --------------------------------------------------------------------------------

def _set(path: str, mode: int, gid: int | None, st: os.stat_result | None = None) -> None:
    """chgrp (when ``gid``) then chmod: a non-root chown may clear the setgid bit."""
    if gid is not None and (st is None or st.st_gid != gid):
        try:
            os.chown(path, -1, gid)
        except PermissionError:
            raise StorePermissionError(
                f"cannot give {path} to group {group_name(gid)}: this user is not a member "
                f"of it (add it with 'usermod -aG {group_name(gid)} $USER', or share with a "
                "group it belongs to)") from None
    os.chmod(path, mode)


def make_dirs(path: str | os.PathLike[str], modes: StoreModes | None = None) -> bool:
    """``mkdir -p path``: missing ancestors ``0755`` less the umask (never writable by
    others), ``path`` itself with ``modes.dir_mode`` whatever the umask (``None``: as its
    parent directory records, for directories inside a store). True if it was created."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return False
    parent = os.path.dirname(path)
    missing = []
    while parent and not os.path.exists(parent) and parent != os.path.dirname(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o755)
    if modes is None:
        modes = modes_of(os.path.dirname(path))
    try:
        os.mkdir(path, 0o700)  # private from its first instant; then the exact mode
    except FileExistsError:
        if os.path.isdir(path):
            return False
        raise
    _set(path, modes.dir_mode, modes.gid)
    return True


def create_file(path: str | os.PathLike[str], flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT, mode)`` with exactly ``mode`` whatever the umask."""
    fd = os.open(path, flags | os.O_CREAT, mode & 0o777)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def settle_files(directory: str | os.PathLike[str], names: tuple[str, ...]) -> None:
    """Give files that a library created in ``directory`` (LMDB's ``data.mdb``,
    ``lock.mdb``) the mode the directory records, if they are ours."""
    modes = modes_of(directory)
    for name in names:
        p = os.path.join(directory, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        want = modes.file_mode(name)
        if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                and stat.S_IMODE(st.st_mode) != want):
            os.chmod(p, want)


# -- checking ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Loose:
    """A path of a store whose mode is not what the store promises."""

    path: str
    mode: int  # as found (S_IMODE)
    want: int
    gid: int
    owner: int
    writable: bool  # users other than the owner (and the store's group) can write it
    why: str  # "readable by other users", ...

    @property
    def is_dir(self) -> bool:
        return bool(self.want & 0o100)

    def fix(self, modes: StoreModes) -> str:
        """The command that sets it right."""
        chgrp = (f"chgrp {group_name(modes.gid)} {self.path} && "
                 if modes.shared and self.gid != modes.gid else "")
        return f"{chgrp}chmod {self.want:o} {self.path}"


def _store_entries(root: str) -> Iterator[str]:
    """The store's own entries in its root (never a file of someone else's)."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return
    for n in names:
        if n in _STORE_ENTRIES or n.startswith(_STORE_PREFIXES):
            yield os.path.join(root, n)


def _walk(root: str) -> Iterator[str]:
    """``root`` and every path of the store under it (symbolic links are not followed)."""
    yield root
    for top in _store_entries(root):
        yield top
        if os.path.isdir(top) and not os.path.islink(top):
            for d, dirs, files in os.walk(top):
                for n in sorted(dirs) + sorted(files):
                    yield os.path.join(d, n)


def _checked(root: str) -> Iterator[str]:
    """What every open checks: the directories that gate the rest, and the index files."""
    yield root
    yield os.path.join(root, "index")
    yield os.path.join(root, "segments")
    yield os.path.join(root, "index", "data.mdb")
    yield os.path.join(root, "index", LMDB_LOCK)
    yield os.path.join(root, "daemon.lock")


def _judge(path: str, modes: StoreModes, *, follow: bool) -> Loose | None:
    """``path`` if its mode or group is not the store's (None: as promised, or absent)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return None
    want = modes.mode_for(path, st)
    m = stat.S_IMODE(st.st_mode)
    group_ok = modes.shared and st.st_gid == modes.gid
    writable = bool(m & stat.S_IWOTH) or (bool(m & stat.S_IWGRP) and not group_ok)
    if m == want and (not modes.shared or group_ok):
        return None
    if writable:
        why = ("writable by other users" if m & stat.S_IWOTH else
               f"writable by group {group_name(st.st_gid)}"
               + ("" if modes.shared else ", and the store is not shared with a group"))
    elif m & 0o007:
        why = "readable by other users"
    elif m & 0o070 and not modes.shared:
        why = (f"readable by group {group_name(st.st_gid)}, and the store is not shared "
               "with a group")
    elif m & 0o070 and not group_ok:
        why = (f"readable by group {group_name(st.st_gid)}, not the store's group "
               f"{group_name(modes.gid)}")
    elif m & ~want & 0o7777:
        why = "more open than the store promises"
    else:
        why = "stricter than the store's sharing"
    return Loose(path, m, want, st.st_gid, st.st_uid, writable, why)


def _refuse(root: str, modes: StoreModes, bad: list[Loose]) -> StorePermissionError:
    b = bad[0]
    more = f" (and {len(bad) - 1} more path(s))" if len(bad) > 1 else ""
    owner = "" if b.owner == os.geteuid() else f"; it belongs to uid {b.owner}"
    if modes.shared:
        fix = f"chmod -R o-w {root}"
        if b.gid != modes.gid:
            fix = f"chgrp -R {group_name(modes.gid)} {root} && {fix}"
    else:
        fix = f"chmod -R go-w {root}"
    return StorePermissionError(
        f"refusing to open the store at {root}: {b.path} is {b.why} (mode {b.mode:04o}"
        f"{owner}){more}, who could change any tenant's KV; check what is in it, then "
        f"run '{fix}' (kvstore keeps a store {modes.describe()}: docs/operations.md, "
        "\"File modes\")")


def check_store(root: str | os.PathLike[str], modes: StoreModes, *, writable: bool) -> None:
    """Refuse the store at ``root`` if others can write it; on a ``writable`` open, set the
    modes of the store's paths that are not the store's (WARNING when they were looser,
    INFO when the store is being shared with ``modes``' group). Read-only opens change
    nothing. A store that does not exist yet passes."""
    root = os.path.abspath(os.fspath(root))
    found = [x for p in _checked(root) if (x := _judge(p, modes, follow=True)) is not None]
    bad = [x for x in found if x.writable]
    if bad:
        raise _refuse(root, modes, bad)
    if not writable or not found:
        return
    if any(x.is_dir for x in found):  # a gate was open: everything behind it may be too
        found = [x for p in _walk(root)
                 if (x := _judge(p, modes, follow=p == root)) is not None]
        bad = [x for x in found if x.writable]
        if bad:  # reachable by others until now: refuse, as for the gates
            raise _refuse(root, modes, bad)
    _apply(root, modes, found)


def _apply(root: str, modes: StoreModes, found: list[Loose]) -> None:
    me = os.geteuid()
    done, skipped = [], []
    for x in found:
        if x.owner != me:
            skipped.append(x)
            continue
        try:
            _set(x.path, x.want, modes.gid, None)
        except FileNotFoundError:
            continue
        done.append(x)
    looser = [x for x in done if x.mode & ~x.want & 0o7777 or (modes.shared and x.gid != modes.gid)]

    def listing(xs: list[Loose]) -> str:
        shown = ", ".join(f"{x.path} {x.mode:04o} -> {x.want:04o}" for x in xs[:8])
        return shown + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")

    if looser:
        log.warning("the store at %s was readable by users it is not shared with: set the "
                    "modes of %d path(s) (kvstore keeps it %s; docs/operations.md, \"File "
                    "modes\"): %s", root, len(looser), modes.describe(), listing(looser))
    rest = [x for x in done if x not in looser]
    if rest:
        log.info("the store at %s: %d path(s) set to the modes of a store %s: %s", root,
                 len(rest), modes.describe(), listing(rest))
    if skipped:
        log.warning("the store at %s: %d path(s) not ours left as they are (their owner, or "
                    "root, can fix them): %s", root, len(skipped),
                    "; ".join(f"{x.path} ({x.why}; {x.fix(modes)})" for x in skipped[:8]))


def loose_paths(root: str | os.PathLike[str]) -> list[Loose]:
    """Every path of the store at ``root`` that is more open than the store promises
    (readable or writable by users it is not shared with, or in another group), as the
    store records its sharing; stricter modes are not reported (``kvstore verify``)."""
    root = os.path.abspath(os.fspath(root))
    modes = modes_of(root)
    out = []
    for p in _walk(root):
        x = _judge(p, modes, follow=p == root)
        if x is not None and (x.writable or x.mode & ~x.want & 0o7777
                              or (modes.shared and x.gid != modes.gid and x.mode & 0o070)):
            out.append(x)
    return out


def tighten(path: str, modes: StoreModes) -> bool:
    """Set ``path`` to the store's mode (``kvstore verify --fix``); True if it now is."""
    x = _judge(path, modes, follow=False)
    if x is None:
        return True
    if x.owner != os.geteuid():
        return False
    _set(path, x.want, modes.gid)
    return _judge(path, modes, follow=False) is None
