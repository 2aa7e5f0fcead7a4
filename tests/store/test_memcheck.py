"""A capacity the machine cannot hold is a ConfigError with the numbers, raised before any
slab is allocated (issue 16: the README Quickstart died in torch's allocator on a machine
with less memory than its cpu_capacity); and the README Quickstart runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO

import kvstore.memcheck as memcheck
from kvstore import ConfigError, KVLayout, open_store
from kvstore.memcheck import Available, check_memory, host_available

README = REPO / "README.md"
LAY = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
               block_tokens=16)


def test_host_available_reads_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24683584 kB\nMemFree:  1 kB\nMemAvailable:   20000000 kB\n")
    a = host_available(str(info), str(tmp_path / "no-cgroup"))
    assert a == Available(20000000 * 1024, 24683584 * 1024, f"MemAvailable in {info}")


def test_cgroup_limit_wins_when_lower(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100000000 kB\nMemAvailable: 90000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{4 << 30}\n")
    (cg / "memory.current").write_text(f"{3 << 30}\n")
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {1 << 29}\n")
    a = host_available(str(info), str(cg))
    assert a is not None and a.nbytes == (1 << 30) + (1 << 29) and "cgroup" in a.source
    (cg / "memory.max").write_text("max\n")  # no limit
    assert host_available(str(info), str(cg)).nbytes == 90000000 * 1024


def test_capacity_beyond_the_machine_is_a_config_error(monkeypatch):
    monkeypatch.setattr(memcheck, "host_available",
                        lambda: Available(8 << 30, 16 << 30, "MemAvailable in /proc/meminfo"))
    with pytest.raises(ConfigError) as e:
        open_store(None, layout=LAY, model_id="m", device="cpu", gpu_capacity=0,
                   cpu_capacity="32GiB")
    msg = str(e.value)
    assert "cpu_capacity=32.0 GiB" in msg and "8.0 GiB available of 16.0 GiB" in msg
    assert "32.0 GiB asked" in msg and "MemAvailable" in msg
    # with device="cpu" the hot tier is host memory too: both are counted
    with pytest.raises(ConfigError, match=r"gpu_capacity=4.0 GiB .*36.0 GiB asked"):
        check_memory(torch.device("cpu"), hot=4 << 30, host=32 << 30)
    check_memory(torch.device("cpu"), hot=0, host=8 << 30)  # exactly what is there: fits
    check_memory(torch.device("cpu"), hot=0, host=0)  # shared-memory warm tier: not counted


def test_real_machine_refuses_twice_its_memory():
    a = host_available()
    if a is None or a.total is None:
        pytest.skip("this system does not say how much memory it has")
    # no allocation happens: the check comes first (else this would die in the allocator)
    with pytest.raises(ConfigError, match="does not fit in this machine's memory"):
        open_store(None, layout=LAY, model_id="m", device="cpu", gpu_capacity=0,
                   cpu_capacity=2 * a.total)


def test_readme_quickstart_runs_as_written(tmp_path):
    text = README.read_text()
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", text, re.S)
    assert block is not None
    code = block.group(1)
    a = host_available()
    want = 10 << 30  # the snippet's cpu_capacity + gpu_capacity (host memory on a CPU-only box)
    if a is not None and a.nbytes < want and not torch.cuda.is_available():
        pytest.skip(f"the Quickstart sizes its tiers for >= 10 GiB free; {a.nbytes} here")
    env = os.environ | {"HOME": str(tmp_path)}  # its store: ~/.cache/kvstore
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    outs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(p.stdout)
    assert outs[0].startswith("0 of 62 blocks were cached")
    assert outs[1].startswith("62 of 62 blocks were cached; hit rate 100%")


def test_gpu_capacity_beyond_the_device_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    dev = torch.device("cuda", 0)  # never touched: the free figure is the patched one
    with pytest.raises(ConfigError, match=r"gpu_capacity=4.0 GiB .* on cuda:0: 1.0 GiB free "
                                          r"of 80.0 GiB"):
        check_memory(dev, hot=4 << 30, host=0)
    check_memory(dev, hot=1 << 30, host=0)


def test_shared_memory_names_the_filesystem_and_the_host(monkeypatch, tmp_path):
    """``kvstore serve``'s warm tier (a file in /dev/shm) needs room there and host memory."""
    from collections import namedtuple

    from kvstore.memcheck import check_shared_memory

    fs = namedtuple("fs", "f_bavail f_blocks f_frsize")
    monkeypatch.setattr(memcheck, "host_available",
                        lambda: Available(20 << 30, 24 << 30, "MemAvailable in /proc/meminfo"))
    monkeypatch.setattr(memcheck.os, "statvfs", lambda p: fs(3 << 18, 3 << 18, 4096))  # 3 GiB
    check_shared_memory(2 << 30, tmp_path, what="--cpu-capacity")  # fits both
    with pytest.raises(ConfigError) as e:
        check_shared_memory(4 << 30, tmp_path, what="--cpu-capacity")
    msg = str(e.value)
    assert msg.startswith("--cpu-capacity 4.0 GiB does not fit in shared memory: ")
    assert f"{tmp_path} has 3.0 GiB free of 3.0 GiB" in msg and "grow" in msg
    assert "memory available" not in msg
    with pytest.raises(ConfigError) as e:
        check_shared_memory(100 << 30, tmp_path, what="--cpu-capacity")
    assert "20.0 GiB of memory available of 24.0 GiB (MemAvailable in /proc/meminfo)" in \
        str(e.value)
    monkeypatch.setattr(memcheck.os, "statvfs", lambda p: fs(1 << 30, 1 << 30, 4096))  # 4 TiB
    with pytest.raises(ConfigError) as e:
        check_shared_memory(100 << 30, tmp_path, what="--cpu-capacity")
    assert "free of" not in str(e.value) and "grow" not in str(e.value)
