"""Adversarial reliability pass, round 15: the batch JOB path as a user or operator hits it,
``kvstore batch run IN OUT --model DIR [--store P] ...`` and the Python API behind it
(``kvstore.integrations.batch.jobs``, ``requests``, ``runner``; the engine as a black box).

The attacks: malformed and odd JSONL (a byte-order mark, CRLF line ends, no final newline,
NaN and infinities, huge integers, non-string ids, an id reused after a bad line, an empty
file), text prompts a tokenizer cannot take or turns into ids the model does not have, IN
given as OUT, two runs writing one OUT at once, a full disk while the results are written, a
run killed with SIGKILL and resumed, partial files torn or holding another job's lines, a
store of another model, a store path that is a file, and absurd batch budgets.

The promise checked: every answer is what the model computes for that prompt (greedy equal to
transformers' ``generate`` in float32), never another prompt's; a bad line or a bad flag is a
clear error naming what to change, not a traceback, and loses no finished answer; a killed
run resumes without duplicating, dropping or reordering answers.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from kvstore.integrations.batch.jobs import partial_path, read_requests  # noqa: E402
from kvstore.integrations.batch.requests import LineError, parse_request  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512
CONTEXT = 256  # save_llama's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.batch_jobs import save_llama

    return save_llama(tmp_path_factory.mktemp("model"), VOCAB, hidden=64, layers=2, heads=4,
                      kv_heads=2, spread=True)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                             dtype=torch.float32).eval()


def generate(model, ids, n):
    """Greedy ``generate`` of ``n`` new tokens (fewer at the model's context)."""
    n = min(n, CONTEXT - len(ids))
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def lock_path(out):
    return out.with_name(out.name + ".lock")


def run_cli(*args):
    from kvstore.cli import main

    return main(["batch", "run", *map(str, args)])


def job_lines(n=6, seed=0, max_tokens=5):
    rng = random.Random(seed)
    doc = [rng.randrange(VOCAB) for _ in range(40)]
    return [{"custom_id": f"q{i}", "token_ids": doc + [rng.randrange(VOCAB) for _ in range(3 + i)],
             "max_tokens": max_tokens} for i in range(n)]


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))


def records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# -- lines ------------------------------------------------------------------------------------

def test_bom_crlf_no_final_newline_nan_and_huge_ints_answers_equal_generate(model_dir, hf,
                                                                            tmp_path, capsys):
    """Held: a file an editor on another system wrote (a byte-order mark, CRLF line ends, no
    newline after the last line) with bad lines among good ones (NaN and Infinity, which
    Python's JSON reader accepts, a zero and a negative ``max_tokens``, a 40-digit
    ``max_tokens`` that runs to the model's context, a prompt one token short of it): each bad
    line is an error line naming its field, and every good answer is ``generate``'s."""
    good = job_lines(4)
    filler = [(7 * i) % VOCAB for i in range(CONTEXT - 1 - len(good[0]["token_ids"]))]
    good.append({"custom_id": "long", "token_ids": good[0]["token_ids"] + filler,
                 "max_tokens": 10**40})
    bad = ['{"custom_id": "n", "token_ids": [1], "temperature": NaN}',
           '{"custom_id": "i", "token_ids": [1], "top_p": Infinity}',
           '{"custom_id": "z", "token_ids": [1], "max_tokens": 0}',
           '{"custom_id": "m", "token_ids": [1], "max_tokens": -3}',
           '{"custom_id": "s", "token_ids": [1], "seed": ' + "9" * 30 + "}"]
    lines = [json.dumps(good[0]), *bad, *map(json.dumps, good[1:])]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())
    assert run_cli(src, out, "--model", model_dir) == 2
    err = capsys.readouterr().err
    for field in ("temperature", "top_p", "max_tokens must be >= 1", "seed must be in"):
        assert field in err, err
    recs = records(out)
    assert [r["custom_id"] for r in recs] == ["q0", "n", "i", "z", "m", "s", "q1", "q2", "q3",
                                              "long"]
    for r in recs:
        if "error" in r:
            continue
        req = next(g for g in good if g["custom_id"] == r["custom_id"])
        assert r["token_ids"] == generate(hf, req["token_ids"], min(req["max_tokens"], 99))
    assert recs[-1]["finish_reason"] == "length" and len(recs[-1]["token_ids"]) == 1


def test_an_empty_file_and_only_blank_lines(model_dir, tmp_path, capsys):
    """Held: an empty input (or only blank lines) is an empty OUT and exit 0."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    for text in ("", "\n\r\n  \n"):
        src.write_text(text)
        assert run_cli(src, out, "--model", model_dir) == 0
        assert out.read_text() == "" and not partial_path(out).exists()


@pytest.mark.parametrize("cid, words", [
    (5, "custom_id must be a non-empty string, got 5"),
    ("", 'custom_id must be a non-empty string, got ""'),
    (["a"], 'custom_id must be a non-empty string, got ["a"]'),
    (None, "custom_id must be a non-empty string, got null"),
])
def test_a_custom_id_that_is_not_a_string_is_named_as_such(cid, words):
    """Before: ``{"custom_id": 5, ...}`` was refused as "custom_id is missing", though it is
    there: the author looked for a missing field. Now the message gives what the line has."""
    e = parse_request(json.dumps({"custom_id": cid, "token_ids": [1]}), 1)
    assert isinstance(e, LineError) and words in e.message
    missing = parse_request(json.dumps({"token_ids": [1]}), 1)
    assert "custom_id is missing" in missing.message


def test_a_custom_id_reused_after_a_bad_line_is_a_duplicate(tmp_path):
    """Before: only lines that parsed counted for uniqueness, so ``a`` on a bad line 1 and
    ``a`` on a good line 2 gave OUT two lines for ``a`` (an error and an answer), and a reader
    keyed by custom_id got one or the other. Now every line naming an id claims it."""
    f = tmp_path / "in.jsonl"
    f.write_text('{"custom_id": "a", "token_ids": [1], "temprature": 1}\n'
                 '{"custom_id": "a", "token_ids": [2]}\n{"custom_id": "b", "token_ids": [3]}\n')
    job = read_requests(f, vocab=VOCAB)
    assert [r.custom_id for r in job.requests] == ["b"]
    assert "already used on line 1" in job.errors[1].message and job.errors[1].line == 2


def _tokenizer_dir(model_dir, tmp_path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "with-tok"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(d)
    return d


def test_text_prompts_a_tokenizer_cannot_take_or_maps_past_the_vocabulary(model_dir, hf,
                                                                          tmp_path, capsys):
    """Before: a text prompt with a lone surrogate (``"\\ud800"``, valid JSON) made the
    tokenizer raise inside the reading of IN: a traceback, nothing ran; and a tokenizer with
    more words than the model's vocabulary gave token ids the model has no embedding for,
    which the engine refused for the whole job. Now each is its line's error, and the other
    lines run (their answers ``generate``'s)."""
    d = _tokenizer_dir(model_dir, tmp_path, VOCAB + 20)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"custom_id": "sur", "prompt": "w5 \\ud800 w6"}\n'
                   + json.dumps({"custom_id": "big", "prompt": f"w3 w{VOCAB + 5}"}) + "\n"
                   + json.dumps({"custom_id": "ok", "prompt": "w3 w4 w5", "max_tokens": 4}) + "\n")
    assert run_cli(src, out, "--model", d) == 2
    err = capsys.readouterr().err
    assert "line 1 (custom_id 'sur')" in err and "cannot be tokenized" in err, err
    assert "line 2 (custom_id 'big')" in err and f"token id {VOCAB + 5}" in err, err
    recs = records(out)
    assert [r["custom_id"] for r in recs] == ["sur", "big", "ok"]
    assert recs[2]["token_ids"] == generate(hf, [3, 4, 5], 4)


# -- files --------------------------------------------------------------------------------------

def test_in_given_as_out_is_refused_before_anything(model_dir, tmp_path, capsys, monkeypatch):
    """Before: ``kvstore batch run q.jsonl q.jsonl`` read the requests, then replaced the
    file with the answers: the job's input was gone. Now OUT naming IN (also through a
    link) is refused before the model loads, and IN is untouched."""
    from kvstore.commands import batch as cmd

    def no_engine(*a, **k):
        raise AssertionError("must not load the model")

    monkeypatch.setattr(cmd, "_open_engine", no_engine)
    src = tmp_path / "in.jsonl"
    write_jsonl(src, job_lines(2))
    before = src.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(src)
    for out in (src, link):
        assert run_cli(src, out, "--model", model_dir) == 2
        err = capsys.readouterr().err
        assert "is the input" in err and "give another OUT" in err, err
        assert src.read_bytes() == before


@pytest.mark.parametrize("what", ["missing", "dir"])
def test_in_missing_or_a_directory_is_a_clear_error(model_dir, tmp_path, capsys, what):
    """Held: IN missing or a directory is one line naming it, exit 2."""
    src = tmp_path / "in.jsonl"
    if what == "dir":
        src.mkdir()
    assert run_cli(src, tmp_path / "out.jsonl", "--model", model_dir) == 2
    err = capsys.readouterr().err
    assert str(src) in err and "Traceback" not in err


def test_two_runs_on_one_out_at_once(model_dir, tmp_path, capsys, monkeypatch):
    """Before: a second ``kvstore batch run`` writing the same OUT while the first ran
    rewrote ``OUT.partial`` under it (the first's later results went to a file no longer
    there) and both wrote ``OUT.tmp``: answers lost or interleaved. Now the second is
    refused (exit 2, naming OUT and what to do) and the first finishes with every answer."""
    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, job_lines(4))
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir) == 0
    from support.batch_jobs import hooked_engine

    real = cmd._open_engine
    started, go = threading.Event(), threading.Event()

    def after(i, reqs):
        if i == 0:
            started.set()
            go.wait(30)

    monkeypatch.setattr(cmd, "_open_engine", hooked_engine(real, after))
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(run_cli(src, out, "--model", model_dir,
                                                          "--max-batch-rows", "1")))
    t.start()
    try:
        assert started.wait(60)
        monkeypatch.setattr(cmd, "_open_engine", real)
        capsys.readouterr()
        assert run_cli(src, out, "--model", model_dir) == 2
        err = capsys.readouterr().err
        assert "another kvstore batch run" in err and str(out) in err, err
    finally:
        go.set()
        t.join(60)
    assert rc == [0]
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()
    assert not lock_path(out).exists()


def _enospc_on(monkeypatch, suffix, after=0):
    """``open`` of a path ending in ``suffix`` gives a file whose writes past ``after`` calls
    raise ENOSPC (a full disk)."""
    import builtins

    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self._f, self._n = f, 0

        def write(self, s):
            self._n += 1
            if self._n > after:
                self._f.write(s[: len(s) // 2])  # what a full disk lets through
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._f.write(s)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def fake_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if str(file).endswith(suffix) and ("w" in mode or "a" in mode):
            return Full(f)
        return f

    monkeypatch.setattr(builtins, "open", fake_open)


def test_a_full_disk_writing_out_keeps_every_answer(model_dir, tmp_path, capsys, monkeypatch):
    """Before: ENOSPC while OUT was written said only ``error: No space left on device``.
    Now: exit 2 naming OUT, saying the old OUT is unchanged and that every answer is kept in
    ``OUT.partial``; OUT is not left half-written, and the next run keeps every answer
    (nothing recomputed) and writes OUT equal to an uninterrupted run's."""
    from support.batch_jobs import dying_engine

    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, job_lines(4))
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir) == 0
    out.write_text("old\n")
    with monkeypatch.context() as m:
        _enospc_on(m, "out.jsonl.tmp", after=2)
        assert run_cli(src, out, "--model", model_dir) == 2
    err = capsys.readouterr().err
    assert f"cannot write OUT {out} (the old one is unchanged) (No space left on device)" \
        in err and f"all 4 answers are kept in {partial_path(out)}" in err, err
    assert out.read_text() == "old\n" and not (tmp_path / "out.jsonl.tmp").exists()
    assert len(partial_path(out).read_text().splitlines()) == 4
    ran: list[str] = []
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(cmd._open_engine, -1, ran))
    assert run_cli(src, out, "--model", model_dir) == 0
    assert ran == [] and out.read_text() == (tmp_path / "ref.jsonl").read_text()


def test_a_full_disk_writing_the_partial_file_then_resume(model_dir, tmp_path, capsys,
                                                          monkeypatch):
    """Before: ENOSPC on the third result appended to ``OUT.partial`` stopped the job with
    ``error: No space left on device``, no file named (a write's OSError has no filename) and
    nothing said of the answers already saved. Now the message names ``OUT.partial``, says
    that its 2 answers are kept and to run again; the next run keeps the two whole lines
    (half of the third reached the disk), recomputes the rest and writes OUT byte for byte as
    an uninterrupted run."""
    from support.batch_jobs import dying_engine

    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, job_lines(5))
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir, "--max-batch-rows", "1") == 0
    with monkeypatch.context() as m:
        _enospc_on(m, "out.jsonl.partial", after=2)
        assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1") == 2
    err = capsys.readouterr().err
    assert f"cannot write {partial_path(out)} (No space left on device)" in err, err
    assert "the 2 answers written to it before are kept" in err and "Traceback" not in err
    assert not out.exists()
    ran: list[str] = []
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(cmd._open_engine, -1, ran))
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1") == 0
    assert len(ran) == 3
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()


def test_partial_torn_mid_line_or_holding_another_jobs_lines(model_dir, tmp_path, monkeypatch):
    """Held: ``OUT.partial`` ending in half a line (a crash while writing), with lines of
    another job (other tokens under the same custom_ids) and a line of this job with one digit
    changed: only this job's intact lines are kept, the rest run again, OUT equals an
    uninterrupted run's."""
    from support.batch_jobs import Killed, dying_engine

    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, job_lines(6))
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir, "--max-batch-rows", "1") == 0
    other = tmp_path / "other.jsonl"
    write_jsonl(other, job_lines(6, seed=1))
    real = cmd._open_engine
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(real, 3))
    with pytest.raises(Killed):
        run_cli(other, out, "--model", model_dir, "--max-batch-rows", "1")
    foreign = partial_path(out).read_text()
    with pytest.raises(Killed):
        run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1")
    mine = partial_path(out).read_text().splitlines(keepends=True)
    assert len(mine) == 3
    flipped = mine[1].replace('"token_ids": [', '"token_ids": [1', 1)
    partial_path(out).write_text(foreign + mine[0] + flipped + mine[2][: len(mine[2]) // 2])
    ran: list[str] = []
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(real, -1, ran))
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1") == 0
    assert len(ran) == 5
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()


def test_sigkill_in_the_middle_then_resume_is_byte_equal(model_dir, tmp_path):
    """Held: a ``kvstore batch run`` process killed with SIGKILL after some results reached
    ``OUT.partial``, then run again: OUT is byte for byte an uninterrupted run's (no answer
    duplicated, dropped or out of order)."""
    src, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    write_jsonl(src, job_lines(8, max_tokens=40))
    args = [sys.executable, "-m", "kvstore.cli", "batch", "run", str(src), "--model",
            str(model_dir), "--max-batch-rows", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    assert subprocess.run([*args[:6], str(ref), *args[6:]], env=env, cwd=tmp_path,
                          capture_output=True, timeout=300).returncode == 0
    p = subprocess.Popen([*args[:6], str(out), *args[6:]], env=env, cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            pp = partial_path(out)
            if pp.exists() and len(pp.read_bytes().splitlines()) >= 2:
                break
            time.sleep(0.005)
        assert p.poll() is None, "finished before it could be killed"
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(30)
    assert not out.exists() and lock_path(out).exists()  # a stale lock: taken over below
    kept = len(partial_path(out).read_bytes().splitlines())
    assert 2 <= kept < 8
    r = subprocess.run([*args[:6], str(out), *args[6:]], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == ref.read_bytes()
    assert not partial_path(out).exists() and not lock_path(out).exists()


# -- store and budgets ------------------------------------------------------------------------

def test_a_store_of_another_model_never_gives_its_kv(model_dir, hf, tmp_path, capsys):
    """Held: a store filled by a model of the same shape but other weights gives this model
    nothing (its blocks are in another namespace): answers are this model's ``generate``,
    none of the prefix loaded from the store."""
    from support.batch_jobs import save_llama

    other = tmp_path / "other"
    save_llama(other, VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, spread=False)
    src, store = tmp_path / "in.jsonl", tmp_path / "store"
    reqs = job_lines(3)
    write_jsonl(src, reqs)
    assert run_cli(src, tmp_path / "o1.jsonl", "--model", other, "--store", store) == 0
    capsys.readouterr()
    assert run_cli(src, tmp_path / "o2.jsonl", "--model", model_dir, "--store", store,
                   "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["summary"]["stored_tokens"] == 0
    for r, q in zip(records(tmp_path / "o2.jsonl"), reqs, strict=True):
        assert r["token_ids"] == generate(hf, q["token_ids"], 5)


def test_a_store_path_that_is_a_file(model_dir, tmp_path, capsys):
    """A ``--store`` that is a regular file is exit 2 with one line naming it, no traceback."""
    src, store = tmp_path / "in.jsonl", tmp_path / "store"
    write_jsonl(src, job_lines(2))
    store.write_text("not a store")
    assert run_cli(src, tmp_path / "out.jsonl", "--model", model_dir, "--store", store) == 2
    err = capsys.readouterr().err
    assert str(store) in err and "Traceback" not in err, err


def test_a_store_with_damaged_blocks_still_gives_exact_answers(model_dir, hf, tmp_path, capsys):
    """Held: every segment file of the store overwritten in its middle (flipped bytes) after
    a first run: the second run's answers are still ``generate``'s."""
    src, store = tmp_path / "in.jsonl", tmp_path / "store"
    reqs = job_lines(3)
    write_jsonl(src, reqs)
    assert run_cli(src, tmp_path / "o1.jsonl", "--model", model_dir, "--store", store) == 0
    damaged = 0
    for p in store.rglob("*"):
        if p.is_file() and p.stat().st_size > 4096 and "index" not in p.parts:
            b = bytearray(p.read_bytes())
            for i in range(len(b) // 3, len(b) // 3 + 2048):
                b[i] ^= 0xA5
            p.write_bytes(bytes(b))
            damaged += 1
    assert damaged
    capsys.readouterr()
    assert run_cli(src, tmp_path / "o2.jsonl", "--model", model_dir, "--store", store) == 0
    for r, q in zip(records(tmp_path / "o2.jsonl"), reqs, strict=True):
        assert r["token_ids"] == generate(hf, q["token_ids"], 5)


@pytest.mark.parametrize("flags", [
    ["--max-batch-tokens", str(10**30)], ["--max-batch-rows", str(10**30)],
    ["--max-prefix-tokens", str(10**30)], ["--max-batch-tokens", "1", "--max-batch-rows", "1"],
])
def test_absurd_budgets_run_and_give_exact_answers(model_dir, hf, tmp_path, capsys, flags):
    """Budgets of 10**30 (no buffer is sized from them) or of 1: the job runs, answers are
    ``generate``'s."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    reqs = job_lines(3)
    write_jsonl(src, reqs)
    assert run_cli(src, out, "--model", model_dir, *flags) == 0, capsys.readouterr().err
    for r, q in zip(records(out), reqs, strict=True):
        assert r["token_ids"] == generate(hf, q["token_ids"], 5)


def test_sampled_rows_with_huge_top_k_and_max_tokens(model_dir, tmp_path, capsys):
    """A sampled row with ``top_k`` and ``max_tokens`` of 10**30 runs to the model's context
    (``top_k`` past the vocabulary is no cut), and is the same on a second run."""
    src = tmp_path / "in.jsonl"
    ids = job_lines(1)[0]["token_ids"]
    write_jsonl(src, [{"custom_id": "s", "token_ids": ids, "temperature": 1.0, "top_k": 10**30,
                       "max_tokens": 10**30, "seed": 2**64 - 1}])
    for name in ("a", "b"):
        assert run_cli(src, tmp_path / name, "--model", model_dir) == 0, capsys.readouterr().err
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert a == b and len(a[0]["token_ids"]) == CONTEXT - len(ids)


def test_resume_after_the_input_changed(model_dir, tmp_path, monkeypatch):
    """Held: killed after 4 answers, then IN edited (lines reordered, one line's tokens
    changed, one removed, one added): the next run keeps only the answers whose request is
    unchanged, runs the rest, and OUT is an uninterrupted run's of the new IN, in its order."""
    from support.batch_jobs import Killed, dying_engine

    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    reqs = job_lines(6)
    write_jsonl(src, reqs)
    real = cmd._open_engine
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(real, 4))
    with pytest.raises(Killed):
        run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1")
    done = [json.loads(x)["custom_id"] for x in partial_path(out).read_text().splitlines()]
    assert len(done) == 4
    new = [dict(r) for r in reversed(reqs)]
    changed = next(r for r in new if r["custom_id"] == done[0])
    changed["token_ids"] = changed["token_ids"][:-1] + [7]
    new = [r for r in new if r["custom_id"] != done[1]]
    new.append({**reqs[0], "custom_id": "added"})
    write_jsonl(src, new)
    monkeypatch.setattr(cmd, "_open_engine", real)
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir, "--max-batch-rows", "1") == 0
    ran: list[str] = []
    monkeypatch.setattr(cmd, "_open_engine", dying_engine(real, -1, ran))
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1") == 0
    assert sorted(ran) == sorted({r["custom_id"] for r in new} - set(done[2:]))
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()


def test_ctrl_c_in_the_middle_keeps_the_answers_and_the_lock_goes(model_dir, tmp_path, capsys,
                                                                  monkeypatch):
    """Held: Ctrl-C (KeyboardInterrupt) after 2 answers is exit 130 with "interrupted", no
    traceback; ``OUT.lock`` is gone, the 2 answers are in ``OUT.partial`` and the next run
    resumes to an uninterrupted run's OUT."""
    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, job_lines(4))
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir, "--max-batch-rows", "1") == 0
    from support.batch_jobs import hooked_engine

    real = cmd._open_engine

    def after(i, reqs):
        if i == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(cmd, "_open_engine", hooked_engine(real, after))
    capsys.readouterr()
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1") == 130
    assert "interrupted" in capsys.readouterr().err
    assert not lock_path(out).exists() and not out.exists()
    assert len(partial_path(out).read_text().splitlines()) == 2
    monkeypatch.setattr(cmd, "_open_engine", real)
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1") == 0
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_store_whose_index_is_damaged(model_dir, hf, tmp_path, capsys, damage):
    """A store whose index file was truncated or overwritten: either a clear one-line error
    (exit 2, no traceback) or a run whose answers are ``generate``'s, never other KV."""
    src, store = tmp_path / "in.jsonl", tmp_path / "store"
    reqs = job_lines(3)
    write_jsonl(src, reqs)
    assert run_cli(src, tmp_path / "o1.jsonl", "--model", model_dir, "--store", store) == 0
    files = [p for p in (store / "index").rglob("*") if p.is_file() and "lock" not in p.name]
    assert files
    for p in files:
        if damage == "truncate":
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
        else:
            p.write_bytes(bytes(random.Random(1).randrange(256) for _ in range(p.stat().st_size)))
    capsys.readouterr()
    rc = run_cli(src, tmp_path / "o2.jsonl", "--model", model_dir, "--store", store)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if rc == 2:
        assert str(store) in err, err
    else:
        assert rc == 0
        for r, q in zip(records(tmp_path / "o2.jsonl"), reqs, strict=True):
            assert r["token_ids"] == generate(hf, q["token_ids"], 5)


def test_the_store_is_closed_when_the_command_returns(model_dir, tmp_path, capsys):
    """Before: ``kvstore batch run --store P`` never closed the store it opened; the
    interpreter's exit hook did, after the exit status was decided (a flush failing there
    still gave 0), and in a process that went on (the CLI's ``main`` called from Python) the
    store stayed open with its index mapped, so a file changed under it could end the process
    with SIGBUS. Now the store is closed before the command returns."""
    from kvstore.tiers.disk.env import open_in_process

    src, store = tmp_path / "in.jsonl", tmp_path / "store"
    write_jsonl(src, job_lines(2))
    assert run_cli(src, tmp_path / "o.jsonl", "--model", model_dir, "--store", store) == 0
    assert not open_in_process(str(store / "index"))


def test_out_in_a_directory_this_user_cannot_write(model_dir, tmp_path, capsys, monkeypatch):
    """Before: OUT in a directory that refuses new files was found only once the model had
    loaded (writing ``OUT.partial.tmp``). Now it is exit 2 naming the file before the model
    loads (taking ``OUT.lock`` is the first write). Simulated: the tests run as root, which
    ``chmod`` does not stop."""
    from kvstore.commands import batch as cmd

    def no_engine(*a, **k):
        raise AssertionError("must not load the model")

    src, out = tmp_path / "in.jsonl", tmp_path / "ro" / "out.jsonl"
    out.parent.mkdir()
    write_jsonl(src, job_lines(2))
    real_open = os.open

    def deny(path, flags, *a, **k):
        if os.fspath(path).startswith(str(out.parent)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(cmd, "_open_engine", no_engine)
    monkeypatch.setattr(os, "open", deny)
    assert run_cli(src, out, "--model", model_dir) == 2
    err = capsys.readouterr().err
    assert f"Permission denied: {out}.lock" in err and "Traceback" not in err, err
