"""Adversarial reliability pass, round 6: ``kvstore batch run`` input files and the partial
file a job resumes from, and prefix-pack imports interrupted half way, then retried.

Every attack checks the promise: hostile input is a clear error (a line error naming the line,
or exit status 2 naming what to change), never a traceback; a corrupt or foreign partial file
is recomputed, never wrong results; an interrupted import leaves nothing served with wrong
bytes, and the retry holds every block of the pack exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, fetch_exact, keyed_kv, run_bounded
from support.attacks import BN, LAY, T, attack_store
from support.batch_jobs import Killed, dying_engine, save_llama

from kvstore.cli import main
from kvstore.integrations.batch.jobs import PartialResults, partial_path, read_requests
from kvstore.integrations.batch.requests import BatchRequest, Completion, LineError

VOCAB = 512
GOOD = b'{"custom_id": "ok", "token_ids": [1, 2, 3], "max_tokens": 2}'


def _req(**kw) -> bytes:
    return json.dumps({"custom_id": "x", "token_ids": [1, 2]} | kw).encode()


# -- kvstore batch run: request lines ----------------------------------------------------------
HOSTILE = [
    (b'{"custom_id": "a\xff\xfe", "token_ids": [1]}', None,
     "not UTF-8 text (a byte that is not UTF-8 at character 17): re-encode the file as UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, None, "not valid JSON (nested thousands of levels deep)"),
    (b'{"custom_id": "x", "token_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
     "not valid JSON (nested thousands of levels deep)"),
    (b'{"custom_id": "x", "token_ids": [' + b"9" * 5000 + b"]}", None,
     "not valid JSON here: an integer of more than 4,300 digits (no token id, count or seed "
     "is that long)"),
    (b'{"custom_id": "x", "token_ids": [' + b"9" * 1000 + b"]}", "x",
     "token_ids has token id 999"),
    (b'{"custom_id": "x", "token_ids": [1], "temperature": ' + b"9" * 400 + b"}", "x",
     "temperature must be in [0, 100], got a number of 400 digits"),
    (b'{"custom_id": "x", "token_ids": [1], "top_p": -' + b"9" * 400 + b"}", "x",
     "top_p must be in (0, 1], got a number of 400 digits"),
    (_req(seed=2**64), "x", "seed must be in [-2**63, 2**64), got 18446744073709551616"),
    (_req(seed=-(2**63) - 1), "x", "seed must be in [-2**63, 2**64)"),
    (b'{"custom_id": "x", "token_ids": [1], "seed": ' + b"9" * 1000 + b"}", "x",
     "seed must be in [-2**63, 2**64), got 999"),
    (b'{"custom_id": "x", "token_ids": [1], "temperature": NaN}', "x",
     "temperature must be a number, got NaN"),
    (b'{"custom_id": "x", "token_ids": [1], "top_p": Infinity}', "x",
     "top_p must be a number, got Infinity"),
    (b'{"custom_id": "x", "token_ids": [1], "temperature": -1e999}', "x",
     "temperature must be a number, got -Infinity"),
    (_req(temperature="0.5"), "x", 'temperature must be a number, got "0.5"'),
    (_req(max_tokens=True), "x", "max_tokens must be a whole number, got true"),
    (_req(max_tokens=[4]), "x", "max_tokens must be a whole number, got [4]"),
    (_req(token_ids={"0": 1}), "x", "token_ids must be a list of token ids"),
    (_req(custom_id=["x"]), None, 'custom_id must be a non-empty string, got ["x"]'),
    (_req(stop_token_ids=[True]), "x", "stop_token_ids must be a list of token ids"),
    (b'"just a string"', None, "a request must be a JSON object"),
    (b"\x00\x00\x00\x00", None, "not valid JSON"),
]


@pytest.mark.parametrize("line,cid,msg", HOSTILE, ids=[
    "not_utf8", "nested_100k", "nested_token_ids", "int_5000_digits", "token_id_1000_digits",
    "temperature_400_digits", "top_p_400_digits", "seed_2_64", "seed_below_int64",
    "seed_1000_digits", "temperature_nan", "top_p_inf", "temperature_minus_inf",
    "temperature_string", "max_tokens_bool", "max_tokens_list", "token_ids_object",
    "custom_id_list", "stop_token_ids_bool", "json_string", "nul_bytes"])
def test_a_hostile_request_line_is_an_error_naming_its_line(tmp_path, line, cid, msg):
    """Before: a line nested 100k deep was a RecursionError, an int of 400 digits as
    temperature or top_p an OverflowError (tracebacks, nothing ran); a byte that is not UTF-8
    became U+FFFD in the prompt or custom_id and ran as if sent; a seed past 2**64 passed and
    killed the job mid-run when the engine seeded its generator."""
    f = tmp_path / "in.jsonl"
    f.write_bytes(GOOD + b"\n" + line + b"\n" + GOOD.replace(b'"ok"', b'"ok2"') + b"\n")
    job = read_requests(f, vocab=VOCAB, context=256)
    assert [r.custom_id for r in job.requests] == ["ok", "ok2"]
    (err,) = job.errors
    assert isinstance(err, LineError) and err.line == 2 and err.custom_id == cid
    assert err.message.startswith(msg), err.message


def test_a_byte_order_mark_before_line_1_is_not_part_of_it(tmp_path):
    """Some editors start a UTF-8 file with a BOM: line 1 was "not valid JSON"."""
    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + GOOD + b"\n" + GOOD.replace(b'"ok"', b'"ok2"') + b"\n")
    job = read_requests(f, vocab=VOCAB, context=256)
    assert not job.errors and [r.custom_id for r in job.requests] == ["ok", "ok2"]


def test_seeds_at_the_ends_of_the_generator_range_are_requests(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\n".join(_req(custom_id=f"s{i}", seed=s, temperature=0.5)
                             for i, s in enumerate((2**64 - 1, -(2**63), 0))) + b"\n")
    job = read_requests(f, vocab=VOCAB)
    assert not job.errors
    assert [r.params.seed for r in job.requests] == [2**64 - 1, -(2**63), 0]


def test_duplicate_custom_ids_keep_the_first_line_only(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b"\n".join([_req(custom_id="d", token_ids=[1]), _req(custom_id="d", token_ids=[2]),
                              _req(custom_id="d", token_ids=[1])]) + b"\n")
    job = read_requests(f, vocab=VOCAB)
    assert [r.token_ids for r in job.requests] == [(1,)]
    assert [(e.line, e.message) for e in job.errors] == [
        (n, "custom_id 'd' is already used on line 1: custom_ids must be unique") for n in (2, 3)]


# -- kvstore batch run end to end --------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return save_llama(tmp_path_factory.mktemp("model"), VOCAB, hidden=32, layers=1, heads=2,
                      kv_heads=1)


def run_cli(*args) -> int:
    return main(["batch", "run", *map(str, args)])


def _no_model(monkeypatch):
    from kvstore.commands import batch as cmd

    def refuse(*a, **k):
        raise AssertionError("the model must not be loaded for this")

    monkeypatch.setattr(cmd, "_model_info", refuse)


def test_hostile_lines_in_a_job_are_error_lines_and_the_rest_runs(model_dir, tmp_path, capsys):
    """A seed past 2**64 with temperature > 0 used to pass the checks and raise ValueError
    ("Overflow when unpacking long long") out of the engine: a traceback, no OUT."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [GOOD, _req(custom_id="big-seed", seed=2**64, temperature=0.7),
             b"[" * 100_000 + b"]" * 100_000,
             b'{"custom_id": "t", "token_ids": [1], "temperature": ' + b"9" * 400 + b"}",
             b'{"custom_id": "bad\xff", "token_ids": [1]}',
             _req(custom_id="max-seed", seed=2**64 - 1, temperature=0.7, max_tokens=2)]
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert run_cli(src, out, "--model", model_dir) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "line 2 (custom_id 'big-seed'): seed must be in [-2**63, 2**64)" in err
    assert "line 3: not valid JSON (nested thousands of levels deep)" in err
    assert "line 4 (custom_id 't'): temperature must be in [0, 100]" in err
    assert "line 5: not UTF-8 text" in err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.get("custom_id") for r in recs] == ["ok", "big-seed", None, "t", None, "max-seed"]
    assert [("error" in r) for r in recs] == [False, True, True, True, True, False]
    assert len(recs[0]["token_ids"]) == 2 and len(recs[5]["token_ids"]) == 2
    assert not partial_path(out).exists()


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["empty", "blank_lines"])
def test_an_empty_job_writes_an_empty_output(model_dir, tmp_path, capsys, content):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(content)
    assert run_cli(src, out, "--model", model_dir, "--format", "json") == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert (summary["lines"], summary["requests"], summary["completed"]) == (0, 0, 0)
    assert out.read_bytes() == b"" and not partial_path(out).exists()


def test_input_that_is_a_directory_or_missing_is_exit_2(model_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert run_cli(tmp_path, out, "--model", model_dir) == 2
    assert capsys.readouterr().err.strip() == f"kvstore batch: error: Is a directory: {tmp_path}"
    assert run_cli(tmp_path / "nope.jsonl", out, "--model", model_dir) == 2
    assert "No such file or directory: " + str(tmp_path / "nope.jsonl") in capsys.readouterr().err
    assert not out.exists()


def test_an_output_path_that_cannot_be_written_is_refused_before_the_model_loads(
        model_dir, tmp_path, capsys, monkeypatch):
    """Before: OUT in a missing directory failed after the model loaded, naming
    ``OUT.partial.tmp``; OUT a directory ran the whole job, then failed renaming onto it."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(GOOD + b"\n")
    _no_model(monkeypatch)
    missing = tmp_path / "no" / "such" / "out.jsonl"
    assert run_cli(src, missing, "--model", model_dir) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvstore batch: error: OUT {missing}: the directory {missing.parent} does not exist; "
        "create it or give another path")
    d = tmp_path / "outdir"
    d.mkdir()
    assert run_cli(src, d, "--model", model_dir) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvstore batch: error: OUT {d} is a directory: give a file path for the results")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "outdir"]
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.partial").mkdir()
    assert run_cli(src, out, "--model", model_dir) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvstore batch: error: {out}.partial (where an interrupted job's results go) is a "
        "directory: move it away or give another OUT")


def test_a_failed_final_write_leaves_no_tmp_and_keeps_the_partial(model_dir, tmp_path,
                                                                   monkeypatch):
    """The rename onto OUT failing (a full disk, a file system gone read-only) left OUT.tmp
    behind; now it is removed, and OUT.partial keeps the results for the next run."""
    from kvstore.integrations.batch import jobs

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _job(src, n=3)
    real = jobs.os.replace

    def failing(a, b):  # only the final rename onto OUT (os is one module for everyone)
        if Path(b) == out:
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(jobs.os, "replace", failing)
    assert run_cli(src, out, "--model", model_dir) != 0  # said as "error: No space left ..."
    assert not Path(f"{out}.tmp").exists() and not out.exists()
    assert len(partial_path(out).read_text().splitlines()) == 3
    monkeypatch.setattr(jobs.os, "replace", real)
    assert run_cli(src, out, "--model", model_dir) == 0
    assert len(out.read_text().splitlines()) == 3 and not partial_path(out).exists()


# -- the partial file of an interrupted job ----------------------------------------------------
def _job(path: Path, n: int = 6, salt: int = 0) -> None:
    path.write_text("".join(json.dumps({"custom_id": f"q{i}", "max_tokens": 3,
                                        "token_ids": [7, 8, 9, 10, 11 + i + salt]}) + "\n"
                            for i in range(n)))


def _interrupted(monkeypatch, src, out, model_dir, after: int) -> None:
    """Run the job on ``src`` and kill it after ``after`` results: ``OUT.partial`` holds them."""
    from kvstore.commands import batch as cmd

    real = cmd._open_engine
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(real, after))
    with pytest.raises(Killed):
        run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1")
    monkeypatch.setattr(cmd, "_open_engine", real)
    assert len(partial_path(out).read_text().splitlines()) == after


def _resume(src, out, model_dir, capsys) -> int:
    """Run again; the number of results kept from the partial file."""
    capsys.readouterr()
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1", "--format",
                   "json") == 0
    return json.loads(capsys.readouterr().out)["summary"]["resumed"]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    _job(d / "in.jsonl")
    assert run_cli(d / "in.jsonl", d / "ref.jsonl", "--model", model_dir,
                   "--max-batch-rows", "1") == 0
    return (d / "ref.jsonl").read_text()


def _flip_a_token(text: str) -> str:
    """The first line's first generated token id changed: still valid JSON."""
    first, rest = text.split("\n", 1)
    rec = json.loads(first)
    rec["token_ids"][0] = (rec["token_ids"][0] + 1) % VOCAB
    return json.dumps(rec) + "\n" + rest


CORRUPTIONS = {
    "token_flipped": (_flip_a_token, 3),
    "cut_mid_line": (lambda t: t[: len(t) - 10], 3),
    "cut_at_line_end": (lambda t: t[: t.index("\n") + 1], 1),
    "nested_100k": (lambda t: "[" * 100_000 + "]" * 100_000 + "\n" + t, 4),
    "not_utf8_and_nul": (lambda t: "\udcff\x00\x00garbage\n" + t, 4),
    "emptied": (lambda t: "", 0),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_damaged_partial_file_is_recomputed_never_wrong(model_dir, tmp_path, monkeypatch,
                                                          capsys, reference, name):
    """Four results finished, then the partial file was damaged: the resumed job keeps the
    lines that are intact and recomputes the rest; OUT equals the uninterrupted run's. Before:
    a line nested 100k deep was a RecursionError out of the resume (a traceback, every run
    after it too), and a token id changed on disk (still JSON) was kept and written to OUT."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _job(src)
    _interrupted(monkeypatch, src, out, model_dir, after=4)
    damage, kept = CORRUPTIONS[name]
    p = partial_path(out)
    p.write_bytes(damage(p.read_text()).encode("utf-8", "surrogateescape"))
    assert _resume(src, out, model_dir, capsys) == kept
    assert out.read_text() == reference
    assert not p.exists()


def test_a_partial_file_of_another_input_keeps_only_identical_requests(model_dir, tmp_path,
                                                                        monkeypatch, capsys,
                                                                        reference):
    """The partial file of a job whose requests differ (same custom_ids, other prompts) keeps
    nothing; identical requests under the same custom_id are the same result and are kept."""
    other, src, out = tmp_path / "other.jsonl", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _job(other, salt=100)
    _interrupted(monkeypatch, other, out, model_dir, after=4)
    _job(src)
    assert _resume(src, out, model_dir, capsys) == 0
    assert out.read_text() == reference
    out.unlink()
    _job(other, n=3)  # q0..q2 as in src
    _interrupted(monkeypatch, other, out, model_dir, after=2)
    assert _resume(src, out, model_dir, capsys) == 2
    assert out.read_text() == reference


def test_partial_lines_without_their_check_are_not_kept(tmp_path):
    """A line of a partial file is kept only with the digest of its record (a line altered
    on disk that is still JSON runs again)."""
    reqs = [BatchRequest(c, (1, 2, i)) for i, c in enumerate("ab")]
    p = PartialResults(tmp_path / "out.jsonl", job="j")
    p.start({}, reqs)
    for r in reqs:
        p.add(r, Completion(r.custom_id, (9, 10), "length", 3, 0))
    p.close(remove=False)
    lines = partial_path(tmp_path / "out.jsonl").read_text().splitlines()
    a, b = (json.loads(x) for x in lines)
    del a["check"]
    b["cached_tokens"] = 1
    partial_path(tmp_path / "out.jsonl").write_text(
        json.dumps(a) + "\n" + json.dumps(b) + "\n" + "\n".join(lines) + "\n")
    got = PartialResults(tmp_path / "out.jsonl", "j").load(reqs)
    assert sorted(got) == ["a", "b"] and got["b"].cached_tokens == 0
    partial_path(tmp_path / "out.jsonl").write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    assert PartialResults(tmp_path / "out.jsonl", "j").load(reqs) == {}


# -- prefix packs: an import interrupted half way, then retried --------------------------------
MODEL = "attacks/round6"
CHAINS = 4  # of 6 blocks each; written 2 blocks a segment on import: 12 segments


def _chain(s, i: int):
    return s.block_keys([i * 100_000 + t for t in range(6 * T)])


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pack")
    with attack_store(d / "src", model=MODEL) as s:
        for i in range(CHAINS):
            ks = _chain(s, i)
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == 6
        s.flush()
    out = d / "p.kvpack"
    assert main(["export", "--store", str(d / "src"), "--namespace", MODEL, "-o", str(out)]) == 0
    return out


def _small_segments(monkeypatch) -> None:
    """Imports write 2 blocks a segment, so an interruption can fall between segments."""
    from kvstore.tiers.disk import tier, writes

    monkeypatch.setattr(tier.DiskTier, "_write_options",
                        lambda self: writes.WriteOptions(self.codec, self.zstd_level, 2 * BN))


def _target(path: Path, present: int) -> None:
    """A store at ``path`` holding the first ``present`` chains of the pack already."""
    with attack_store(path, model=MODEL) as s:
        for i in range(present):
            ks = _chain(s, i)
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == 6
        s.flush()


def _check_store(path: Path, capsys) -> None:
    """Every block of the pack exactly once, exact bytes, and ``kvstore verify`` clean."""
    from kvstore.tiers.disk import DiskTier

    t = DiskTier(path, capacity_bytes=0, readonly=True)
    try:
        keys = [r.key for r in t.records()]
    finally:
        t.close()
    assert len(keys) == len(set(keys)) == 6 * CHAINS
    with attack_store(path, model=MODEL, warm=8) as s:
        for i in range(CHAINS):
            assert fetch_exact(s, _chain(s, i)) == 6
        assert s.stats().damaged == 0
    capsys.readouterr()
    assert main(["verify", "--store", str(path), "--grace", "0", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"] == [], doc["findings"]


def _served_exact_or_missed(path: Path) -> None:
    """What an interrupted import left: every lookup a miss or exact bytes."""
    with attack_store(path, model=MODEL, warm=8) as s:
        for i in range(CHAINS):
            fetch_exact(s, _chain(s, i))
        assert s.stats().damaged == 0


@pytest.mark.parametrize("where", ["staging", "publishing", "index_commit"])
@pytest.mark.parametrize("present", [0, 1])
def test_an_import_interrupted_in_process_then_retried_holds_each_block_once(
        pack, tmp_path, monkeypatch, capsys, where, present):
    """Interrupted (a BaseException, as a Ctrl-C or a kill unwinds) while writing segments,
    after some were published, or in the index commit: nothing of it is visible, no file is
    left behind, and the retry imports every block once."""
    from kvstore.tiers.disk import segments, writes

    _small_segments(monkeypatch)
    q = tmp_path / "Q"
    _target(q, present)
    name, target = {"staging": ("create_segment", segments.create_segment),
                    "publishing": ("finish_segment", segments.finish_segment),
                    "index_commit": ("write_ops", writes.write_ops)}[where]
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == (1 if where == "index_commit" else 3):
            raise Killed
        return target(*a, **k)

    monkeypatch.setattr(segments if where != "index_commit" else writes, name, interrupted)
    with pytest.raises(Killed):
        main(["import", str(pack), "--store", str(q)])
    monkeypatch.setattr(segments if where != "index_commit" else writes, name, target)
    _served_exact_or_missed(q)
    assert not list((q / "segments").glob("*.tmp"))
    capsys.readouterr()
    assert main(["import", str(pack), "--store", str(q), "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["imported"], res["present"]) == (6 * (CHAINS - present), 6 * present)
    _check_store(q, capsys)


_KILLER = """
import os, signal, sys
from kvstore.tiers.disk import segments, tier, writes
tier.DiskTier._write_options = lambda self: writes.WriteOptions(
    self.codec, self.zstd_level, {seg})
real, calls = {module}.{name}, []
def killed(*a, **k):
    calls.append(1)
    if len(calls) == {after}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
{module}.{name} = killed
from kvstore.cli import main
sys.exit(main(["import", sys.argv[1], "--store", sys.argv[2], "--create"]))
"""


@pytest.mark.parametrize("where,after", [("create_segment", 3), ("finish_segment", 3),
                                         ("write_ops", 1)])
def test_an_import_killed_then_retried_holds_each_block_once(pack, tmp_path, capsys,
                                                              where, after):
    """SIGKILL half way through ``kvstore import`` (no cleanup runs): what it left is never
    served with wrong bytes, the retry imports every block once, and once ``kvstore prune``
    has removed the files the killed process left (``verify`` names them), the store is clean."""
    q = tmp_path / "Q"
    module = "writes" if where == "write_ops" else "segments"
    script = _KILLER.format(seg=2 * BN, name=where, after=after, module=module)
    p = subprocess.run([sys.executable, "-c", script, str(pack), str(q)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    _served_exact_or_missed(q)
    capsys.readouterr()
    assert run_bounded(lambda: main(["import", str(pack), "--store", str(q), "--format",
                                     "json"]), 60) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["imported"], res["present"]) == (6 * CHAINS, 0)
    assert main(["verify", "--store", str(q), "--format", "json"]) == 0  # young: in flight?
    capsys.readouterr()
    assert main(["verify", "--store", str(q), "--grace", "0", "--format", "json"]) == 1
    found = json.loads(capsys.readouterr().out)["findings"]
    assert found and {(f["kind"], f["action"]) for f in found} <= {
        ("temp_file", "remove"), ("orphan_segment", "remove")}, found
    assert {f["path"] for f in found} == {str(q / "segments" / n)
                                          for n in os.listdir(q / "segments")} - {
        str(q / "segments" / f"{r:016x}.safetensors") for r in _live_segments(q)}
    assert main(["prune", "--store", str(q), "--grace", "0", "-y"]) == 0
    _check_store(q, capsys)


def _live_segments(path: Path) -> set[int]:
    from kvstore.tiers.disk import DiskTier

    t = DiskTier(path, capacity_bytes=0, readonly=True)
    try:
        return {r.segment for r in t.records()}
    finally:
        t.close()


def test_an_import_killed_while_creating_the_store_is_retried_with_the_same_command(
        pack, tmp_path, capsys):
    """Killed between making the store's directories and its index (``--create``): the
    retry of the same command refused the path ("not a kvstore store: it has no
    index/data.mdb") although it held nothing but the empty ``segments/`` and ``index/``."""
    q = tmp_path / "Q"
    script = ("import os, signal, sys, lmdb\n"
              "lmdb.open = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
              "from kvstore.cli import main\n"
              "main(['import', sys.argv[1], '--store', sys.argv[2], '--create'])\n")
    p = subprocess.run([sys.executable, "-c", script, str(pack), str(q)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert sorted(x.relative_to(q).as_posix() for x in q.rglob("*")) == ["index", "segments"]
    assert main(["import", str(pack), "--store", str(q), "--create"]) == 0
    _check_store(q, capsys)
    # a directory holding any file is not taken for an empty one
    other = tmp_path / "other"
    (other / "index").mkdir(parents=True)
    (other / "index" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["import", str(pack), "--store", str(other), "--create"]) == 2
    assert "is not a kvstore store" in capsys.readouterr().err
    assert sorted(x.name for x in other.rglob("*")) == ["index", "notes.txt"]
