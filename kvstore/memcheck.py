"""Will a tier's slab fit? Checked before the store allocates it, so that a capacity the
machine cannot hold is a :class:`~kvstore.errors.ConfigError` with the numbers instead of an
allocator error (or, for memory the kernel hands out lazily, an OOM kill once the cache fills).

Host memory available is ``MemAvailable`` of ``/proc/meminfo`` (what can be had without
swapping), or less where a cgroup v2 memory limit says so; elsewhere
``os.sysconf`` free pages. GPU memory is ``torch.cuda.mem_get_info`` of the device. Shared
memory (``kvstore serve``'s warm tiers, files in ``/dev/shm``) needs both: host memory and
room in that filesystem (a tmpfs is usually half the RAM).

A pinned warm slab is exactly what these checks count: its own mapping of ``slots *
block_nbytes`` bytes, page-locked in place (``cudaHostRegister``) and unlocked at close, never
torch's caching host allocator (which rounds a request up to a power of two: a 40 GiB tier
pinned 64 GiB). :func:`pinned_host_bytes` says how much this process holds locked now.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.sizes import format_size

_MEMINFO = "/proc/meminfo"
_CGROUP = "/sys/fs/cgroup"


@dataclass(frozen=True, slots=True)
class Available:
    """Bytes a new allocation can have, and where that figure comes from."""

    nbytes: int
    total: int | None
    source: str


def _meminfo(path: str = _MEMINFO) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_available(root: str = _CGROUP) -> int | None:
    """Room under a cgroup v2 memory limit (reclaimable page cache counted as room)."""
    limit = _read_int(os.path.join(root, "memory.max"))
    used = _read_int(os.path.join(root, "memory.current"))
    if limit is None or used is None:
        return None
    inactive = 0
    try:
        with open(os.path.join(root, "memory.stat")) as f:
            for line in f:
                if line.startswith("inactive_file "):
                    inactive = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return max(0, limit - used + inactive)


def host_available(meminfo: str = _MEMINFO, cgroup: str = _CGROUP) -> Available | None:
    """Host memory a new allocation can have, or None when this system does not say."""
    info = _meminfo(meminfo)
    avail: Available | None = None
    if "MemAvailable" in info:
        avail = Available(info["MemAvailable"], info.get("MemTotal"), f"MemAvailable in {meminfo}")
    else:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            avail = Available(os.sysconf("SC_AVPHYS_PAGES") * page,
                              os.sysconf("SC_PHYS_PAGES") * page, "free pages (os.sysconf)")
        except (ValueError, OSError, AttributeError):
            avail = None
    room = _cgroup_available(cgroup)
    if room is not None and (avail is None or room < avail.nbytes):
        limit = _read_int(os.path.join(cgroup, "memory.max"))
        avail = Available(room, limit, f"room under the cgroup limit {cgroup}/memory.max")
    return avail


def pinned_host_bytes() -> int:
    """Host bytes this process's slabs hold page-locked now (exactly their mapped bytes)."""
    from kvstore.tiers.slab import pinned_bytes

    return pinned_bytes()


def check_memory(device: object, *, hot: int, host: int) -> None:
    """Raise :class:`ConfigError` when the tiers cannot be allocated: ``hot`` bytes on
    ``device`` (a ``torch.device``: host memory too when it is the CPU) and ``host`` bytes of
    host memory (the warm tier; 0 when it lives in a shared-memory file, checked there)."""
    dev_type = getattr(device, "type", str(device))
    on_host = host + (hot if dev_type == "cpu" else 0)
    if on_host:
        avail = host_available()
        if avail is not None and on_host > avail.nbytes:
            what = f"cpu_capacity={format_size(host)} (the warm tier)" if host else ""
            if dev_type == "cpu" and hot:
                hot_part = f"gpu_capacity={format_size(hot)} (the hot tier: host memory with " \
                           "device='cpu')"
                what = f"{what} + {hot_part}" if what else hot_part
            total = f" of {format_size(avail.total)}" if avail.total else ""
            raise ConfigError(
                f"{what} does not fit in this machine's memory: {format_size(on_host)} asked, "
                f"{format_size(avail.nbytes)} available{total} ({avail.source}); lower it to "
                "what the host can spare (the disk tier keeps the rest)")
    if hot and dev_type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]
        if hot > free:
            raise ConfigError(
                f"gpu_capacity={format_size(hot)} (the hot tier) does not fit on {device}: "
                f"{format_size(free)} free of {format_size(total)}; lower gpu_capacity")


def check_shared_memory(nbytes: int, shm_dir: str | os.PathLike[str], *, what: str) -> None:
    """Raise :class:`ConfigError` when ``nbytes`` of shared memory in ``shm_dir`` cannot be
    had: more than the free space of that filesystem or than the host's available memory.
    ``what`` names the setting (``"--cpu-capacity"``), which the message starts with."""
    short: list[str] = []
    shm = os.fspath(shm_dir)
    try:
        st = os.statvfs(shm)
    except OSError:
        st = None
    no_room = st is not None and st.f_blocks > 0 and nbytes > st.f_bavail * st.f_frsize
    if st is not None and no_room:
        short.append(f"{shm} has {format_size(st.f_bavail * st.f_frsize)} free of "
                     f"{format_size(st.f_blocks * st.f_frsize)}")
    avail = host_available()
    if avail is not None and nbytes > avail.nbytes:
        total = f" of {format_size(avail.total)}" if avail.total else ""
        short.append(f"the host has {format_size(avail.nbytes)} of memory available{total} "
                     f"({avail.source})")
    if short:
        grow = f", or grow {shm}" if no_room else ""
        raise ConfigError(
            f"{what} {format_size(nbytes)} does not fit in shared memory: {' and '.join(short)}; "
            f"lower {what} to what the host can spare (the disk tier keeps the rest){grow}")
