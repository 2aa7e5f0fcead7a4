"""Adversarial reliability pass, round 8: what operators run against a store that is in use.
``kvstore prune``, ``verify --fix``, ``compact``, ``recover`` and ``import`` run beside an
engine in another process that keeps putting (its puts overflowing a tiny warm tier straight
to disk), flushing and evicting; the same command run twice at once; commands interrupted
half way (SIGKILL, and Ctrl-C landing just after an index commit), then run again.

Every attack checks the promise: every chain a ``flush`` vouched for is served whole with
exactly its bytes afterwards (``fetch_exact``: a miss is allowed only where the operator asked
for a deletion), no flush of the engine fails because of the command, an interrupted command
leaves a store that opens, serves exact bytes and verifies clean once the command is run
again, and nothing waits without a bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, TESTS, fetch_exact, keyed_kv
from support.attacks import LAY, T, attack_store, vouched_chains

from kvstore.cli import main as cli

MODEL = "attacks/round8"
LAYOUT = "bfloat16 L2 P2 T4 H2 D8"


def chain_keys(s, i: int, n: int):
    return s.block_keys([(700 + i) * 100_000 + t for t in range(n * T)])


#: an engine in another process: puts chain i (``n`` blocks) through a warm tier of ``warm``
#: slots (a chain longer than that overflows straight to disk: its tail is committed before
#: its head), flushes and reports it; with ``scratch`` it also puts a throw-away chain and
#: evicts it from disk after the flush, so that compaction has dead bytes to reclaim. Each
#: line is one write (a kill between print's pieces left "flushed" with no number).
_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from conftest import keyed_kv
from support.attacks import LAY, attack_store
from kvstore.errors import NotDurableError
s = attack_store(sys.argv[2], model="attacks/round8", warm=int(sys.argv[3]))
n, scratch = int(sys.argv[4]), sys.argv[5] == "1"
print("ready", flush=True)
i = 0
while True:
    ks = s.block_keys([(700 + i) * 100_000 + t for t in range(n * 4)])
    s.put(ks, keyed_kv(LAY, ks))
    junk = s.block_keys([(300 + i) * 100_000 + t for t in range(n * 4)]) if scratch else []
    if junk:
        s.put(junk, keyed_kv(LAY, junk))
    try:
        s.flush(30)
    except NotDurableError as e:
        sys.stdout.write(f"not durable {i} {e}\n".replace("\n", " ") + "\n")
        sys.stdout.flush()
        i += 1
        continue
    sys.stdout.write(f"flushed {i}\n")
    sys.stdout.flush()
    if junk:
        s.evict(junk, tier="disk")
    i += 1
"""


class Writer:
    """``_WRITER`` in a child process; ``lines`` collects what it printed."""

    def __init__(self, path: Path, *, warm: int, blocks: int, scratch: bool = False) -> None:
        self.blocks = blocks
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(TESTS), str(path), str(warm), str(blocks),
             "1" if scratch else "0"],
            stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.lines: list[str] = []
        assert self.proc.stdout.readline().strip() == "ready"
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    def vouched(self) -> list[int]:
        return vouched_chains(list(self.lines))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.reader.join(10)

    def check(self, path: Path, *, at_least: int) -> None:
        """Every chain vouched for is whole and exact; no flush failed."""
        vouched = self.vouched()
        failed = [x for x in self.lines if x.startswith("not durable")]
        assert not failed, failed[:3]
        assert len(vouched) >= at_least, f"only {len(vouched)} flushes"
        with attack_store(path, model=MODEL) as s:
            lost = [(i, n) for i in vouched
                    if (n := fetch_exact(s, chain_keys(s, i, self.blocks))) != self.blocks]
            assert not lost, f"chains vouched for, then cut (chain, blocks left): {lost[:8]}"
            assert s.stats().damaged == 0


def _for_a_while(writer: Writer, step, *, seconds: float, flushes: int = 3) -> int:
    """``step()`` again and again for at least ``seconds`` and until the writer vouched for
    ``flushes`` chains (30 s at most); how many steps ran."""
    t_min, t_max = time.monotonic() + seconds, time.monotonic() + 30
    runs = 0
    while time.monotonic() < t_max and (
            time.monotonic() < t_min or len(writer.vouched()) < flushes):
        step()
        runs += 1
    return runs


# -- prune / verify --fix with --grace 0 beside an engine -----------------------------------
@pytest.mark.parametrize("command", ["prune", "verify_fix"])
def test_grace_0_beside_an_engine_whose_puts_overflow_loses_nothing_vouched(tmp_path, command):
    """``prune --grace 0`` / ``verify --fix -y --grace 0`` in a loop beside an engine whose
    puts overflow a 4-slot warm tier (12-block chains: 8 blocks go straight to disk, committed
    before the 4 that wait in memory). Before: (1) those 8 blocks, their parent not on disk
    yet, were dropped as ``unreachable``, and chains the next flush vouched for came back cut
    to 4 blocks (20-46 chains of ~250 in 5 s); (2) a temp segment the engine had created but
    not yet locked was removed as a leftover, or its lock attempt failed against prune's probe
    and the next prune removed it: the engine's flush raised NotDurableError (ENOENT). Now
    unreachable blocks keep the default grace while another process has the store open, and a
    temp file is unlinked only under its lock, its writer waiting for the lock and creating
    the file again if it went first."""
    with attack_store(tmp_path, model=MODEL):
        pass
    w = Writer(tmp_path, warm=4, blocks=12)
    store = ["--store", str(tmp_path)]

    def step():
        if command == "prune":
            assert cli(["prune", *store, "-y", "--grace", "0", "--format", "json"]) == 0
        else:
            assert cli(["verify", *store, "--fix", "-y", "--grace", "0", "--format", "json"]) in (0, 1)

    try:
        _for_a_while(w, step, seconds=2.5 if command == "prune" else 3.0)
    finally:
        w.kill()
    w.check(tmp_path, at_least=3)


def test_plain_verify_at_grace_0_beside_an_engine_reports_no_unreachable_blocks(tmp_path, capsys):
    """Read-only ``verify --grace 0`` beside the same overflowing engine: the tail of a chain
    committed before its head is a write in flight, not a finding (before: ``unreachable``
    findings and exit status 1, a false alarm for a cron job)."""
    with attack_store(tmp_path, model=MODEL):
        pass
    w = Writer(tmp_path, warm=4, blocks=12)
    kinds: set[str] = set()

    def step():
        cli(["verify", "--store", str(tmp_path), "--grace", "0", "--format", "json"])
        kinds.update(f["kind"] for f in json.loads(capsys.readouterr().out)["findings"])

    try:
        _for_a_while(w, step, seconds=2.0)
    finally:
        w.kill()
    assert "unreachable" not in kinds, kinds
    w.check(tmp_path, at_least=3)


def test_a_temp_segment_pruned_before_its_writer_locked_it_is_written_again(tmp_path,
                                                                         monkeypatch):
    """``prune --grace 0`` runs in the instant between an engine creating its temp segment
    and locking it (forced here: the create is followed by a prune in another process).
    Before: prune saw an unlocked temp file, removed it, and the engine's flush failed with
    NotDurableError (ENOENT at publish). Now the writer sees its file gone once it holds the
    lock and creates it again: the flush returns and the chain is exact."""
    from kvstore.tiers.disk import inflight

    real, pruned = inflight.create_file, []

    def create_then_prune(path, *a, **kw):
        fd = real(path, *a, **kw)
        if not pruned:
            pruned.append(subprocess.run(
                [sys.executable, "-c", "import sys\nfrom kvstore.cli import main\n"
                 "sys.exit(main(sys.argv[1:]))", "prune", "--store", str(tmp_path), "-y",
                 "--grace", "0", "--format", "json"],
                capture_output=True, text=True, timeout=60, cwd=REPO))
        return fd

    with attack_store(tmp_path, model=MODEL) as s:
        monkeypatch.setattr(inflight, "create_file", create_then_prune)
        ks = chain_keys(s, 1, 3)
        assert s.put(ks, keyed_kv(LAY, ks)).wait(20) == 3
        s.flush(30)
        monkeypatch.undo()
    assert pruned and pruned[0].returncode == 0, pruned and pruned[0].stderr[-2000:]
    kinds = [f["kind"] for f in json.loads(pruned[0].stdout)["findings"]]
    assert kinds == ["temp_file"], kinds  # the race was there to lose
    _all_exact(tmp_path, [ks])


# -- compact twice at once, beside an engine ------------------------------------------------
_COMPACTOR = r"""
import sys, time
from kvstore.admin import compact
t_end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < t_end:
    n += compact(sys.argv[1], threshold=1.0).segments_rewritten
print(n, flush=True)
"""


def test_two_compactions_at_once_beside_an_engine_lose_nothing_vouched(tmp_path):
    """Two ``compact --threshold 1.0`` processes loop over one store while an engine puts,
    flushes and evicts chains from disk (dead bytes for them to reclaim): both move the same
    records at once. Held: every chain the engine vouched for is exact, no flush failed,
    ``verify`` and ``prune --grace 0`` afterwards find nothing but the killed engine's
    leftovers."""
    with attack_store(tmp_path, model=MODEL):
        pass
    w = Writer(tmp_path, warm=64, blocks=3, scratch=True)
    procs = []
    try:
        while len(w.vouched()) < 5:
            time.sleep(0.05)
        procs = [subprocess.Popen([sys.executable, "-c", _COMPACTOR, str(tmp_path), "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO) for _ in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        w.kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-800:] for _o, e in outs]
    assert sum(int(o.split()[-1]) for o, _e in outs) > 0, "nothing was compacted"
    w.check(tmp_path, at_least=5)
    assert cli(["prune", "--store", str(tmp_path), "-y", "--grace", "0"]) == 0
    assert cli(["verify", "--store", str(tmp_path), "--grace", "0"]) == 0


# -- interrupted half way, then run again ---------------------------------------------------
def _store_with_dead_bytes(path: Path, chains: int = 12) -> list[list[bytes]]:
    """``chains`` 4-block chains, one segment each; every other one cut to 2 blocks (dead
    bytes). Returns the chains as they stand."""
    out = []
    with attack_store(path, model=MODEL) as s:
        for i in range(chains):
            ks = chain_keys(s, i, 4)
            assert s.put(ks, keyed_kv(LAY, ks)).wait(20) == 4
            s.flush()
            out.append(ks)
        for ks in out[::2]:
            s.evict(ks[2:], tier="disk")
    return [ks[:2] if i % 2 == 0 else ks for i, ks in enumerate(out)]


def _all_exact(path: Path, chains) -> None:
    with attack_store(path, model=MODEL) as s:
        got = [fetch_exact(s, ks) for ks in chains]
        assert got == [len(ks) for ks in chains], f"blocks left per chain: {got}"
        assert s.stats().damaged == 0


#: run ``kvstore ARGS`` with ``MODULE.FUNC`` wrapped: after the real call returns, the
#: process sends itself ``SIGNAL`` (an interrupt lands at the next bytecode, exactly as a
#: Ctrl-C arriving during the call's fsync does; a SIGKILL ends it there)
_INTERRUPTED = r"""
import importlib, os, signal, sys
# Ctrl-C raises here whatever this process inherited: a SIGINT ignored in the parent (the
# full suite's pytest process, by the time this runs) stays ignored across exec
signal.signal(signal.SIGINT, signal.default_int_handler)
mod, func, sig = sys.argv[1], sys.argv[2], getattr(signal, sys.argv[3])
m = importlib.import_module(mod)
real = getattr(m, func)
def wrapped(*a, **kw):
    r = real(*a, **kw)
    os.kill(os.getpid(), sig)
    return r
setattr(m, func, wrapped)
from kvstore.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _run_interrupted(module: str, func: str, sig: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _INTERRUPTED, module, func, sig, *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def _garble_header(seg: Path) -> None:
    raw = bytearray(seg.read_bytes())
    raw[8:16] = b"\x00garbled"  # the JSON header's first bytes: the payloads stay whole
    seg.write_bytes(bytes(raw))


@pytest.mark.parametrize("command", ["compact", "verify_fix"])
def test_ctrl_c_just_after_a_rewrite_commits_loses_no_block(tmp_path, command):
    """Ctrl-C lands at the first bytecode after the index commit that moved blocks into a new
    segment (most likely while the commit's fsync runs). Before: the KeyboardInterrupt went
    through ``rewrite``'s clean-up, which unlinked the new segment the index now named: every
    block the compaction moved (or verify --fix repaired) became a miss, ``damaged`` counted
    each. Now the file is unlinked only when the index does not name it: exit 130, every
    block exact, and the command run again finishes with a clean store."""
    chains = _store_with_dead_bytes(tmp_path)
    store = ["--store", str(tmp_path)]
    if command == "compact":
        args = ["compact", *store, "--threshold", "1.0"]
    else:
        _garble_header(sorted((tmp_path / "segments").glob("*.safetensors"))[1])
        args = ["verify", *store, "--fix", "-y"]
    p = _run_interrupted("kvstore.tiers.disk.compaction", "write_ops", "SIGINT", *args)
    assert p.returncode == 130, p.stderr[-2000:]
    _all_exact(tmp_path, chains)
    assert cli(args) == 0
    assert cli(["prune", *store, "-y", "--grace", "0"]) == 0
    assert cli(["verify", *store, "--grace", "0"]) == 0
    _all_exact(tmp_path, chains)


def test_ctrl_c_just_after_an_import_commits_keeps_the_imported_blocks(tmp_path):
    """``kvstore import`` interrupted just after its one index commit: before, the segments it
    had published were unlinked under records naming them (every imported block a miss, each
    counted damaged, and the import's rerun skipped them as present). Now exit 130 leaves
    them in place; the rerun imports nothing new and every block is exact."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    chains = _store_with_dead_bytes(src, chains=6)
    pack = tmp_path / "p.kvpack"
    assert cli(["export", "--store", str(src), "--namespace", MODEL, "-o", str(pack)]) == 0
    args = ["import", str(pack), "--store", str(dst), "--create", "--model", MODEL,
            "--layout", LAYOUT]
    p = _run_interrupted("kvstore.tiers.disk.writes", "write_ops", "SIGINT", *args)
    assert p.returncode == 130, p.stderr[-2000:]
    _all_exact(dst, chains)
    assert cli(args) == 0
    assert cli(["verify", "--store", str(dst), "--grace", "0"]) == 0
    _all_exact(dst, chains)


@pytest.mark.parametrize("where", [
    ("kvstore.tiers.disk.segments", "finish_segment"),  # the new segment named, not committed
    ("kvstore.tiers.disk.compaction", "write_ops"),  # committed, old files not unlinked yet
], ids=["published", "committed"])
def test_compaction_killed_half_way_then_run_again(tmp_path, where):
    """SIGKILL in the middle of ``compact``: held. The store opens and serves every block
    exactly, the rerun completes, and prune (no grace) then verify leave it clean."""
    chains = _store_with_dead_bytes(tmp_path)
    store = ["--store", str(tmp_path)]
    p = _run_interrupted(*where, "SIGKILL", "compact", *store, "--threshold", "1.0")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    _all_exact(tmp_path, chains)
    assert cli(["compact", *store, "--threshold", "1.0"]) == 0
    assert cli(["prune", *store, "-y", "--grace", "0"]) == 0
    assert cli(["verify", *store, "--grace", "0"]) == 0
    _all_exact(tmp_path, chains)


@pytest.mark.parametrize("where", [
    ("kvstore.tiers.disk.recover", "_write_index"),  # the new index written, not swapped in
    ("kvstore.tiers.disk.recover", "_exchange"),  # swapped, the old one not renamed yet
    ("os", "rename"),  # the two-step swap (no RENAME_EXCHANGE): the old index moved away
], ids=["written", "exchanged", "two_step"])
def test_recover_killed_half_way_then_run_again(tmp_path, where):
    """``kvstore recover --force`` killed -9 at each step of its swap: held. The store either
    opens as it was or is refused naming ``kvstore recover``; running the same command again
    completes, and every block is exact."""
    chains = _store_with_dead_bytes(tmp_path, chains=6)
    store = ["--store", str(tmp_path)]
    args = ["recover", *store, "--force"]
    if where[0] == "os":  # no renameat2: the fallback's first rename, then the kill
        code = _INTERRUPTED.replace(
            "from kvstore.cli import main",
            "import kvstore.tiers.disk.recover as r\nr._exchange = lambda a, b: False\n"
            "from kvstore.cli import main")
        p = subprocess.run([sys.executable, "-c", code, *where, "SIGKILL", *args],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    else:
        p = _run_interrupted(*where, "SIGKILL", *args)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert cli(args) == 0
    # recover brings back blocks removed since their segment was written (docs/cli.md)
    _all_exact(tmp_path, chains)
    assert cli(["verify", *store, "--grace", "0"]) == 0


def test_two_recovers_at_once_one_runs_the_other_refuses(tmp_path):
    """Two ``kvstore recover --force`` at the same moment: each finishes with 0 or refuses
    with 2 naming the other holder ("the store ... is open in another process"); the store
    opens afterwards with every block exact."""
    chains = _store_with_dead_bytes(tmp_path, chains=6)
    code = "import sys\nfrom kvstore.cli import main\nsys.exit(main(sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, "recover", "--store", str(tmp_path),
                               "--force"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    rcs = sorted(p.returncode for p in procs)
    assert rcs in ([0, 0], [0, 2]), outs
    for p, (_o, e) in zip(procs, outs, strict=True):
        if p.returncode == 2:
            assert "another process" in e and "kvstore recover" in e, e
    _all_exact(tmp_path, chains)
    assert cli(["verify", "--store", str(tmp_path), "--grace", "0"]) == 0
    assert not [d for d in os.listdir(tmp_path) if d.startswith("index.recover-")]
