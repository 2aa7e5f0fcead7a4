"""Adversarial reliability pass, round 5: the files operators hand to the CLI (``kvstore
replay`` traces, ``kvstore explain`` prompts), prefix packs, the daemon's requests after
hello, and namespaces crossing.

Every attack checks the promise: hostile input is a clear error (exit status 2, the message
naming the line or the field) or a counted miss, never a traceback, never wrong KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import fetch_exact, keyed_kv
from support.attacks import LAY, T, attack_store

from kvstore.cli import main

MODEL = "attacks/round5"


def _line(body: bytes) -> bytes:
    return b'{"timestamp":1,"input_length":8,"output_length":1,"hash_ids":[1,2]}\n' + body + b"\n"


# -- kvstore replay: trace files ---------------------------------------------------------------
@pytest.mark.parametrize("body,msg", [
    (b'{"timestamp":2,"hash_ids":[1]}\xff\xfe', ":2: not UTF-8 text"),
    (b'{"timestamp":2,"hash_ids":[18446744073709551616]}', ":2: hash_ids must be a list of "
     "non-negative integers below 2**64"),
    (b'{"timestamp":2,"hash_ids":[-1]}', ":2: hash_ids must be a list of non-negative"),
    (b'{"timestamp":' + b"9" * 5000 + b',"hash_ids":[1]}', ":2: not a trace request (a number "
     "with thousands of digits)"),
    (b'{"timestamp":' + b"9" * 400 + b',"hash_ids":[1]}', ":2: timestamp, input_length and "
     "output_length must be non-negative integers below 2**63"),
    (b"[" * 100_000 + b"]" * 100_000, ":2: not a trace request (JSON nested thousands"),
    (b'{"timestamp":2,"hash_ids":[1],"input_length":1e999}', ":2: timestamp, input_length"),
], ids=["not_utf8", "hash_id_2_64", "hash_id_negative", "5000_digits", "timestamp_1e400",
        "nested_100k", "length_inf"])
def test_a_hostile_trace_line_is_a_usage_error_naming_its_line(tmp_path, capsys, body, msg):
    """A trace line with a byte that is not UTF-8, a hash id past uint64, an int of 5000
    digits, a timestamp no float holds, or 100k nested brackets: exit status 2 and a message
    naming the file and line. Before, each was a traceback (exit 1): UnicodeDecodeError,
    OverflowError in numpy, ValueError of int() and RecursionError out of json."""
    p = tmp_path / "t.jsonl"
    p.write_bytes(_line(body))
    assert main(["replay", str(p), "--simulate-only"]) == 2
    err = capsys.readouterr().err
    assert f"{p}{msg}" in err and "Traceback" not in err, err


def test_hash_ids_at_the_top_of_uint64_replay(tmp_path, capsys):
    """The largest hash id a trace may hold is replayed (its tokens wrap modulo 2**32)."""
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp":1,"input_length":8,"output_length":1,"hash_ids":[18446744073709551615]}\n'
                 '{"timestamp":2,"input_length":8,"output_length":1,"hash_ids":[18446744073709551615]}\n')
    assert main(["replay", str(p), "--simulate-only", "--format", "json"]) == 0
    assert '"requests": 2' in capsys.readouterr().out


# -- kvstore explain: prompts -----------------------------------------------------------------
@pytest.mark.parametrize("how", ["file", "inline"])
def test_a_prompt_nested_100k_deep_is_a_usage_error(tmp_path, capsys, how):
    """``kvstore explain --tokens '[[[[...'`` (or a file of it): exit 2 naming the problem.
    Before: a RecursionError traceback out of json.loads (only ValueError was caught)."""
    deep = "[" * 100_000 + "]" * 100_000
    if how == "file":
        (tmp_path / "p.json").write_text(deep)
        src = ["--tokens-file", str(tmp_path / "p.json")]
    else:
        src = ["--tokens", '{"tokens":' + deep + "}"]
    assert main(["explain", "--store", str(tmp_path / "s"), "--model", MODEL, "--layout",
                 "bfloat16 L2 P2 T4 H2 D8", *src]) == 2
    err = capsys.readouterr().err
    assert "nested thousands of levels deep" in err and "Traceback" not in err, err


# -- the disk index: a damaged segment record ------------------------------------------------
def _damage_segment_records(path: Path, how: str) -> None:
    import lmdb

    from kvstore.tiers.disk import index as di

    env = lmdb.open(str(path / "index"), max_dbs=10, subdir=True)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(di.DB_SEGS, txn=txn, create=False)
            items = list(txn.cursor(db=db))
            assert items
            for k, v in items:
                if how == "missing":
                    txn.delete(k, db=db)
                elif how == "garbage":
                    txn.put(k, b"\xff" * len(v), db=db)
                else:  # "count 1": decodes, but counts 1 live block of 6
                    txn.put(k, v[:4] + (1).to_bytes(4, "little") + v[8:], db=db)
    finally:
        env.close()


@pytest.mark.parametrize("how", ["missing", "garbage", "count_1"])
def test_a_damaged_segment_record_never_gets_the_segments_other_blocks_unlinked(tmp_path, how):
    """A segment's ``segs`` record in the index deleted, overwritten or counting 1 live
    block of 6; then one block of that segment is evicted from disk. The other 5 flushed
    blocks stay readable (the file is kept, and ``kvstore verify`` names the accounting).
    Before, the count (taken as 0, or 1) fell to 0 and the segment file was unlinked under
    the 5 blocks the index still held: acknowledged blocks lost."""
    with attack_store(tmp_path, model=MODEL) as s:
        ks = s.block_keys(list(range(6 * T)))
        assert s.put(ks, keyed_kv(LAY, ks)).wait() == 6
        s.flush()
    _damage_segment_records(tmp_path, how)
    with attack_store(tmp_path, model=MODEL) as s:
        ks = s.block_keys(list(range(6 * T)))
        assert s.evict([ks[-1]], tier="disk") == 1
    assert len(list((tmp_path / "segments").glob("*.safetensors"))) == 1
    with attack_store(tmp_path, model=MODEL) as s:
        ks = s.block_keys(list(range(6 * T)))
        assert s.lookup(ks) == 5
        assert fetch_exact(s, ks) == 5
        assert s.stats().damaged == 0
    # what the warning says to run recounts it; then the store checks clean, blocks intact
    from kvstore.cli import main

    store = str(tmp_path)
    assert main(["verify", "--store", store]) == 1
    assert main(["verify", "--store", store, "--fix", "-y"]) == 0
    assert main(["verify", "--store", store]) == 0
    with attack_store(tmp_path, model=MODEL) as s:
        ks = s.block_keys(list(range(6 * T)))
        assert fetch_exact(s, ks) == 5


# -- the daemon: requests after hello ---------------------------------------------------------
_K = b"\x01" * 32
_BAD_REQUESTS = [
    ("lookup", [_K + b"x", None]), ("lookup", [_K, b"short"]), ("fetch", [[_K], None]),
    ("put", [_K, None, "", 0]), ("put", [_K, None, "s", 1 << 40]), ("put", [_K, None, 5, 0]),
    ("put", [_K]), ("commit", [0]), ("commit", [1 << 62]), ("commit", [-1]), ("abort", ["1"]),
    ("release", [True]), ("evict", [_K, "cold"]), ("evict", [b"", 3]), ("flush", [-1]),
    ("flush", [float("nan")]), ("flush", [True]), ("unpin", [None]), ("pin", {"a": 1}),
    ("lookup_report", [1, 2]), ("lookup_report", [1 << 41, 0, 0]), ("remove", [_K, None]),
    ("hello", []), ("nosuchop", []), ("stats", [1]), ("ping", [None]),
]


def test_malformed_requests_after_hello_get_error_codes_and_the_daemon_serves_on(serve):
    """A connection that said hello sends requests with wrong types, out-of-range ids,
    unknown grants and ops it may not send: each gets an error reply with a code other than
    INTERNAL (and no traceback in the daemon's log), and another client is served throughout."""
    from test_attacks_round3 import _raw, _raw_call

    from kvstore import connect
    from kvstore.wire import messages as m
    from kvstore.wire import protocol
    from kvstore.wire.errors import ErrorCode

    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "0")
    with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        keys = c.block_keys(list(range(4 * T)))
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
        for op, args in _BAD_REQUESTS:
            with _raw(d.socket_path) as s:
                r = _raw_call(s, "hello", 1, protocol.make_hello(LAY, MODEL + "/x").to_wire())
                assert r is not None and r[1] == m.OK, r
                r = _raw_call(s, op, 2, args)
            assert r is not None and r[1] == m.ERROR, (op, args, r)
            assert r[2][0] != ErrorCode.INTERNAL, (op, args, r)
            assert fetch_exact(c, keys) == 4, (op, args)
    assert "Traceback" not in d.log()


# -- the client: a daemon naming slots no lease or grant can have -----------------------------
def _until(fn, seconds: float = 10.0):
    import time

    end = time.monotonic() + seconds
    while True:
        got = fn()
        if got or time.monotonic() > end:
            return got
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["past_slab", "twice", "extra", "negative", "grant_position"])
def test_a_daemon_naming_impossible_slots_is_a_miss_never_wrong_kv(serve, monkeypatch, how):
    """A reply (of a daemon of another version, or an impostor on the socket) whose lease
    names a slot past the shared slab, a slot twice, more slots than keys or a negative one,
    or whose grant names a put position outside the put: the call is a miss (a fetch of 0
    blocks, a put of 0), the connection is dropped, and the next calls are exact again.
    Before, the client copied by those slots: other blocks' bytes returned as these keys'
    (wrong KV), a torch error out of ``fetch`` or more rows than keys."""
    from kvstore import connect
    from kvstore.wire import channel as ch
    from kvstore.wire import messages as m

    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "0")
    real = ch.Channel.call
    armed = {"on": False}

    def call(self, req, timeout=True):
        r = real(self, req, timeout)
        if not armed["on"]:
            return r
        if how != "grant_position" and isinstance(r, m.Lease) and r.slots:
            armed["on"] = False
            s = r.slots
            bad = {"past_slab": [s[0] + 10**6, *s[1:]], "twice": [s[0]] * len(s),
                   "extra": [*s, s[0] + 1], "negative": [-1, *s[1:]]}[how]
            return m.Lease(r.lease_id, bad)
        if how == "grant_position" and isinstance(r, m.Grant) and r.slots:
            armed["on"] = False
            return m.Grant(r.grant_id, [p + 100 for p in r.positions], r.slots, r.duplicates)
        return r

    monkeypatch.setattr(ch.Channel, "call", call)
    with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        keys = c.block_keys(list(range(4 * T)))
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
        armed["on"] = True
        if how == "grant_position":
            other = c.block_keys(list(range(100, 100 + 4 * T)))
            assert c.put(other, keyed_kv(LAY, other)).wait() == 0
            assert not armed["on"]
            assert _until(lambda: c.put(other, keyed_kv(LAY, other)).wait()) == 4
            assert fetch_exact(c, other) == 4
        else:
            got = c.fetch(keys).wait()
            assert got.shape[0] == 0 and not armed["on"]
        assert _until(lambda: fetch_exact(c, keys)) == 4
    assert "Traceback" not in d.log()
