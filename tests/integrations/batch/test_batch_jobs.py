"""Batch jobs: request lines, the resumable partial file, ordered output, ``kvstore batch run``."""

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.integrations.batch.jobs import PartialResults, partial_path, read_requests
from kvstore.integrations.batch.requests import BatchRequest, LineError, parse_request

VOCAB = 512


def parse(obj, **kw):
    return parse_request(obj if isinstance(obj, str) else json.dumps(obj), 3, vocab=VOCAB, **kw)


@pytest.mark.parametrize("line, words", [
    ("{bad json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"token_ids": [1]}, "custom_id is missing"),
    ({"custom_id": "a", "token_ids": [1], "temprature": 1}, "unknown field 'temprature'"),
    ({"custom_id": "a", "token_ids": []}, "prompt is empty"),
    ({"custom_id": "a", "prompt": ""}, "needs a tokenizer"),
    ({"custom_id": "a"}, "exactly one of prompt"),
    ({"custom_id": "a", "prompt": "x", "token_ids": [1]}, "exactly one of prompt"),
    ({"custom_id": "a", "token_ids": [1, 600]}, "outside the vocabulary"),
    ({"custom_id": "a", "token_ids": [1, "2"]}, "list of token ids"),
    ({"custom_id": "a", "token_ids": [1], "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"custom_id": "a", "token_ids": [1], "max_tokens": 2.5}, "whole number"),
    ({"custom_id": "a", "token_ids": [1], "temperature": -1}, "temperature must be in"),
    ({"custom_id": "a", "token_ids": [1], "top_p": 0}, "top_p must be in (0"),
    ({"custom_id": "a", "token_ids": [1], "stop": "x"}, "stop strings need a tokenizer"),
    ({"custom_id": "a", "token_ids": [1], "ignore_eos": "yes"}, "true or false"),
    ({"custom_id": "a", "token_ids": [1] * 64}, "the model's context is 64"),
])
def test_bad_lines_say_what_to_change(line, words):
    e = parse(line, context=64)
    assert isinstance(e, LineError) and e.line == 3
    assert words in e.message


def test_good_line_and_defaults():
    r = parse({"custom_id": "q", "token_ids": [5, 6], "stop_token_ids": [7], "seed": 3,
               "temperature": 0.7, "top_p": 0.9, "top_k": 4, "max_tokens": 9})
    assert isinstance(r, BatchRequest) and r.token_ids == (5, 6) and r.line == 3
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids) == \
        (9, 0.7, 0.9, 4, 3, (7,))
    d = parse({"custom_id": "q", "token_ids": [5]}).params
    assert d.greedy and d.max_tokens == 16 and d.top_p == 1.0
    t = parse({"custom_id": "q", "prompt": "a b", "stop": ["x"]}, tokenize=lambda s: [1, 2])
    assert t.token_ids == (1, 2) and t.prompt == "a b" and t.params.stop == ("x",)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["custom_id", "prompt", "token_ids", "max_tokens",
                                        "temperature", "top_p", "stop", "seed", "junk"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-5, 600), st.floats(),
                                 st.text(max_size=3),
                                 st.lists(st.integers(-2, 600), max_size=4))))
def test_any_object_is_a_request_or_an_error(obj):
    r = parse_request(json.dumps(obj), 1, vocab=VOCAB, context=100, tokenize=lambda s: [1] * len(s))
    assert isinstance(r, (BatchRequest, LineError))


def test_duplicate_custom_id_and_blank_lines(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"custom_id": "a", "token_ids": [1]}\n\n{"custom_id": "a", "token_ids": [2]}\n')
    job = read_requests(f, vocab=VOCAB)
    assert len(job.entries) == 2 and len(job.requests) == 1
    assert "already used on line 1" in job.errors[0].message and job.errors[0].line == 3


def test_partial_keeps_matching_results_and_drops_torn_lines(tmp_path):
    from kvstore.integrations.batch.requests import Completion

    reqs = [BatchRequest(c, (1, 2, i)) for i, c in enumerate("abc")]
    p = PartialResults(tmp_path / "out.jsonl", job="j1")
    p.start({}, reqs)
    for r in reqs[:2]:
        p.add(r, Completion(r.custom_id, (9,), "length", 3, 0))
    p.close(remove=False)
    with open(partial_path(tmp_path / "out.jsonl"), "a") as f:
        f.write('{"custom_id": "c", "token_ids": [1')  # torn by a kill
    assert sorted(PartialResults(tmp_path / "out.jsonl", "j1").load(reqs)) == ["a", "b"]
    changed = [BatchRequest("a", (1, 2, 99))] + reqs[1:]
    assert sorted(PartialResults(tmp_path / "out.jsonl", "j1").load(changed)) == ["b"]
    assert PartialResults(tmp_path / "out.jsonl", "other model").load(reqs) == {}


# -- end to end -------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.batch_jobs import save_llama

    return save_llama(tmp_path_factory.mktemp("model"), VOCAB, hidden=64, layers=2, heads=4,
                      kv_heads=2, spread=True)


def add_tokenizer(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.save_pretrained(d)
    return fast


def write_job(path, n=8, seed=0, bad=True):
    rng = random.Random(seed)
    doc = [rng.randrange(VOCAB) for _ in range(60)]
    lines = [json.dumps({"custom_id": f"q{i}", "token_ids": doc + [rng.randrange(VOCAB)
                                                                    for _ in range(4 + i)],
                         "max_tokens": 5}) for i in range(n)]
    if bad:
        lines.insert(2, "{not json")
        lines.insert(5, json.dumps({"custom_id": "long", "token_ids": [1] * 300}))
        lines.insert(6, json.dumps({"custom_id": "q1", "token_ids": [3]}))
    path.write_text("\n".join(lines) + "\n")
    return lines


def run_cli(*args):
    from kvstore.cli import main

    return main(["batch", "run", *map(str, args)])


def test_cli_runs_good_lines_reports_bad_ones(model_dir, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(src)
    assert run_cli(src, out, "--model", model_dir, "--format", "json") == 2
    cap = capsys.readouterr()
    assert "line 3: not valid JSON" in cap.err
    assert "line 6 (custom_id 'long')" in cap.err and "context is 256" in cap.err
    assert "line 7 (custom_id 'q1'): custom_id 'q1' is already used on line 2" in cap.err
    summary = json.loads(cap.out)["summary"]
    assert summary["requests"] == 8 and len(summary["errors"]) == 3
    assert summary["computed_tokens"] <= summary["naive_tokens"]
    assert summary["computed_tokens"] == summary["lower_bound_tokens"]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 11  # one per input line, in input order
    assert [r.get("custom_id") for r in recs][:4] == ["q0", "q1", None, "q2"]
    assert recs[2]["error"]["message"].startswith("not valid JSON") and recs[2]["line"] == 3
    ok = [r for r in recs if "error" not in r]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in ok)
    assert all(r["cached_tokens"] >= 60 for r in ok)
    assert not partial_path(out).exists()


def test_cli_on_error_fail_runs_nothing(model_dir, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(src)
    assert run_cli(src, out, "--model", model_dir, "--on-error", "fail") == 2
    assert not out.exists()


def test_cli_plan_only(model_dir, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_job(src, bad=False)
    assert run_cli(src, "--model", model_dir, "--plan-only", "--format", "json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 8 and len(doc["plan"]["groups"]) == 1
    assert doc["plan"]["groups"][0]["shared_tokens"] >= 60


def test_resume_after_interruption_recomputes_nothing_finished(model_dir, tmp_path, monkeypatch):
    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(src, n=12, bad=False)
    assert run_cli(src, tmp_path / "ref.jsonl", "--model", model_dir, "--max-batch-rows", "3") == 0

    from support.batch_jobs import Killed, dying_engine

    real = cmd._open_engine
    ran: list[str] = []

    def wrapped(die_after):
        return dying_engine(real, die_after, ran)

    monkeypatch.setattr(cmd, "_open_engine", wrapped(5))  # dies after 5 results, as if killed
    with pytest.raises(Killed):
        run_cli(src, out, "--model", model_dir, "--max-batch-rows", "3")
    assert not out.exists() and len(partial_path(out).read_text().splitlines()) == 5
    ran.clear()
    monkeypatch.setattr(cmd, "_open_engine", wrapped(-1))
    assert run_cli(src, out, "--model", model_dir, "--max-batch-rows", "3") == 0
    assert len(ran) == 7  # the 5 finished ones were kept, not recomputed
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()
    assert not partial_path(out).exists()


def test_text_prompts_and_stop_strings_with_a_tokenizer(model_dir, tmp_path):
    import torch

    d = tmp_path / "with-tok"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    tok = add_tokenizer(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    prompt = " ".join(f"w{i}" for i in range(7, 47))
    ids = tok(prompt, return_tensors="pt").input_ids
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    stop = f"w{plain[3]}"
    # where transformers' stop_strings stops: the first token whose text completes the string
    # (its StopStringCriteria cannot index this word-level vocabulary, so computed here)
    cut = next(j for j in range(8) if stop in tok.decode(plain[: j + 1]))
    hf = plain[: cut + 1]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "t", "prompt": prompt, "max_tokens": 8,
                               "stop": [stop]}) + "\n"
                   + json.dumps({"custom_id": "u", "prompt": prompt, "max_tokens": 8}) + "\n")
    assert run_cli(src, out, "--model", d) == 0
    t, u = (json.loads(x) for x in out.read_text().splitlines())
    assert t["token_ids"] == hf and t["finish_reason"] == "stop" and t["stop_reason"] == stop
    full = tok.decode(t["token_ids"], skip_special_tokens=True)
    assert t["text"] == full[: full.find(stop)] and stop not in t["text"]
    assert u["token_ids"] == plain and u["text"] == tok.decode(plain)


def test_every_line_failing_for_one_reason_is_said_once_and_nothing_runs(model_dir, tmp_path,
                                                                         capsys, monkeypatch):
    """Issue 31 item 6: text prompts to a model without a tokenizer fail every line alike."""
    from kvstore.commands import batch as cmd

    def no_engine(args, tok, prompts=()):
        raise AssertionError("no line can run: the model must not be loaded")

    monkeypatch.setattr(cmd, "_open_engine", no_engine)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": f"question {i}"}) + "\n"
                           for i in range(5)))
    assert run_cli(src, out, "--model", model_dir) == 2
    cap = capsys.readouterr()
    assert cap.err.count("needs a tokenizer") == 1, cap.err
    assert "all 5 lines" in cap.err and "nothing ran" in cap.err
    assert "(from )" not in cap.out and cap.out == ""
    assert not out.exists()
    # different reasons: each line is named, then that nothing ran
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n{bad\n")
    assert run_cli(src, out, "--model", model_dir) == 2
    err = capsys.readouterr().err
    assert "line 1 (custom_id 'a')" in err and "line 2: not valid JSON" in err
    assert "nothing ran" in err and not out.exists()


def test_summary_of_a_job_with_nothing_left_to_compute(model_dir, tmp_path, capsys, monkeypatch):
    """Every result kept from an interrupted run: no engine report, no "(from )"."""
    from kvstore.commands import batch as cmd

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(src, n=3, bad=False)

    class Killed(BaseException):
        pass

    from support.batch_jobs import hooked_engine

    real = cmd._open_engine

    def after(i, reqs):
        if i == len(reqs) - 1:
            raise Killed  # killed after the last result, before OUT was written

    monkeypatch.setattr(cmd, "_open_engine", hooked_engine(real, after))
    with pytest.raises(Killed):
        run_cli(src, out, "--model", model_dir, "--max-batch-rows", "1")
    monkeypatch.setattr(cmd, "_open_engine", real)
    capsys.readouterr()
    assert run_cli(src, out, "--model", model_dir) == 0
    text = capsys.readouterr().out
    assert "3 kept from an interrupted run" in text and "(from )" not in text
    assert len(out.read_text().splitlines()) == 3


# -- memory: the store's warm tier sized from the job, --cpu-capacity, peak RSS -------------------
BLOCK = 8192  # the fixture model's block: 2 layers x (K, V) x 16 tokens x 2 heads x 16 x 4 B


def record_store(monkeypatch):
    """Wrap ``_open_engine``: the warm-tier capacity of the store the engine really got."""
    from kvstore.commands import batch as cmd

    real = cmd._open_engine
    seen = {}

    def open_engine(args, tok, prompts=()):
        engine, warm = real(args, tok, prompts)
        if engine.store is not None:
            seen["warm"] = engine.store.stats().tier("warm").capacity_bytes
        seen["max_prefix_tokens"] = engine.max_prefix_tokens
        return engine, warm

    monkeypatch.setattr(cmd, "_open_engine", open_engine)
    return seen


def test_warm_tier_is_sized_from_the_job_and_peak_rss_is_reported(model_dir, tmp_path, capsys,
                                                                    monkeypatch):
    """Issue 28: with --store, the warm tier was open_store's 4 GiB, faulted in at open (a
    tiny model's job peaked at 4.8-5.1 GB); now it follows the job."""
    from kvstore.integrations.batch.memory import DEFAULT_CAP, MIN_BLOCKS, peak_rss

    seen = record_store(monkeypatch)
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    write_job(small, bad=False)  # one 60-token document: 3 full blocks
    rng = random.Random(1)
    docs = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(4)]
    big.write_text("".join(json.dumps({"custom_id": f"d{i}-{j}", "max_tokens": 2,
                                       "token_ids": d + [rng.randrange(VOCAB) for _ in range(5)]})
                           + "\n" for i, d in enumerate(docs) for j in range(3)))
    sized = {}
    for name, src in (("small", small), ("big", big)):
        assert run_cli(src, tmp_path / f"{name}.out", "--model", model_dir, "--store",
                       tmp_path / "s", "--format", "json") == 0
        doc = json.loads(capsys.readouterr().out)
        store = doc["store"]
        assert store["sized_from"] == "job" and store["block_bytes"] == BLOCK
        assert store["cpu_capacity_bytes"] == seen["warm"]  # what the store really got
        sized[name] = store
        peak = doc["summary"]["peak_rss_bytes"]
        assert 50 << 20 < peak <= peak_rss()  # this process's, in bytes (not KiB)
    assert sized["small"]["prefix_blocks"] == 3
    assert sized["small"]["cpu_capacity_bytes"] == MIN_BLOCKS * BLOCK  # 128 KiB
    assert sized["small"]["cpu_capacity_bytes"] * 1000 < DEFAULT_CAP
    assert sized["big"]["prefix_blocks"] == 4 * (200 // 16)
    assert sized["big"]["cpu_capacity_bytes"] == -(-48 * 5 // 4) * BLOCK  # 1.25x headroom

    assert run_cli(small, tmp_path / "t.out", "--model", model_dir, "--store", tmp_path / "s") == 0
    text = capsys.readouterr().out
    # the whole suite's process is measured: on CI it passed 1 GiB and printed "1.0 GiB"
    assert re.search(r"peak memory \(RSS\)\s+\d+(\.\d+)? (MiB|GiB)\b", text), text
    assert "sized from the job's 3 shared-prefix blocks" in text
    assert run_cli(small, tmp_path / "u.out", "--model", model_dir) == 0  # no store: RSS only
    text = capsys.readouterr().out
    assert "peak memory (RSS)" in text and "store warm tier" not in text


def test_summary_names_the_cpu_threads(model_dir, tmp_path, capsys):
    from kvstore.integrations.batch.engines.threads import usable_cores

    job = tmp_path / "in.jsonl"
    write_job(job, bad=False)
    assert run_cli(job, tmp_path / "a.out", "--model", model_dir, "--format", "json") == 0
    few, most = json.loads(capsys.readouterr().out)["summary"]["threads"]
    assert 1 <= few <= most <= usable_cores()
    assert run_cli(job, tmp_path / "b.out", "--model", model_dir) == 0
    assert re.search(r"CPU threads\s+\d", capsys.readouterr().out)


def test_cpu_capacity_and_max_prefix_tokens_override(model_dir, tmp_path, capsys, monkeypatch):
    seen = record_store(monkeypatch)
    src = tmp_path / "in.jsonl"
    write_job(src, bad=False)
    assert run_cli(src, tmp_path / "o.jsonl", "--model", model_dir, "--store", tmp_path / "s",
                   "--cpu-capacity", "1MiB", "--max-prefix-tokens", "500",
                   "--format", "json") == 0
    store = json.loads(capsys.readouterr().out)["store"]
    assert store["sized_from"] == "--cpu-capacity" and store["cpu_capacity_bytes"] == 1 << 20
    assert seen == {"warm": 1 << 20, "max_prefix_tokens": 500}
    assert run_cli(src, tmp_path / "p.jsonl", "--model", model_dir, "--store", tmp_path / "s",
                   "--cpu-capacity", "1MiB") == 0
    assert "1.0 MiB (128 blocks of 8.0 KiB), from --cpu-capacity" in capsys.readouterr().out


@pytest.mark.parametrize("value, words", [
    ("-1MiB", "negative"),
    ("lots", "is not a size"),
    ("12XB", "is not a size"),
    ("0", "leaves the store no warm tier"),
])
def test_bad_cpu_capacity_is_a_usage_error(model_dir, tmp_path, capsys, value, words):
    src = tmp_path / "in.jsonl"
    write_job(src, bad=False)
    with pytest.raises(SystemExit) as e:
        run_cli(src, tmp_path / "o.jsonl", "--model", model_dir, "--store", tmp_path / "s",
                f"--cpu-capacity={value}")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-capacity" in err and words in err, err
    assert "leave --cpu-capacity out to size the tier from the job" in err
    assert "0 disables" not in err  # the shared parser's hint does not hold here


def test_cpu_capacity_below_one_block_or_without_a_store(model_dir, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_job(src, bad=False)
    out = tmp_path / "o.jsonl"
    assert run_cli(src, out, "--model", model_dir, "--store", tmp_path / "s",
                   "--cpu-capacity", "4KiB") == 2
    err = capsys.readouterr().err
    assert "--cpu-capacity 4.0 KiB is smaller than one block of this model (8.0 KiB: 2 layers" in err
    assert "give at least 8.0 KiB" in err and "leave --cpu-capacity out" in err
    assert not out.exists() and not (tmp_path / "s").exists()
    assert run_cli(src, out, "--model", model_dir, "--cpu-capacity", "1MiB") == 2
    assert "give --store PATH too" in capsys.readouterr().err and not out.exists()


def test_a_prefix_of_whole_blocks_loaded_from_the_store(model_dir, tmp_path, capsys):
    """The second run finds the whole shared prefix (64 tokens: 4 blocks) in the store and
    runs no forward for it (it used to run one over 0 tokens, which failed)."""
    rng = random.Random(3)
    doc = [rng.randrange(VOCAB) for _ in range(64)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "max_tokens": 3, "token_ids":
                                       doc + [rng.randrange(VOCAB) for _ in range(3 + i)]})
                           + "\n" for i in range(4)))
    runs = []
    for name in ("a", "b"):
        assert run_cli(src, tmp_path / f"{name}.jsonl", "--model", model_dir, "--store",
                       tmp_path / "s", "--format", "json") == 0
        runs.append(json.loads(capsys.readouterr().out)["summary"])
    assert runs[0]["stored_tokens"] == 0 and runs[1]["stored_tokens"] == 64
    assert runs[1]["computed_tokens"] == runs[0]["computed_tokens"] - 64
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


def test_prefix_blocks_count_nested_prefixes_once():
    from kvstore.integrations.batch.memory import MIN_BLOCKS, prefix_blocks, warm_capacity

    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(40)]  # 2 full blocks, shared by all
    docs = [system + [rng.randrange(VOCAB) for _ in range(50)] for _ in range(2)]  # 90: 5 blocks
    prompts = [d + [rng.randrange(VOCAB) for _ in range(4)] for d in docs for _ in range(3)]
    assert prefix_blocks(prompts, 16) == 2 + 2 * (5 - 2)
    assert prefix_blocks(prompts[:1], 16) == 0  # one prompt shares nothing
    assert warm_capacity([], block_tokens=16, block_nbytes=100).capacity == MIN_BLOCKS * 100
    capped = warm_capacity(prompts, block_tokens=16, block_nbytes=100, cap=250)
    assert capped.capacity == 200 and capped.capped and capped.blocks == 2
    assert warm_capacity(prompts, block_tokens=16, block_nbytes=100, cap=10).capacity == 100


def test_vllm_engine_gets_the_job_sized_warm_tier(model_dir, tmp_path, monkeypatch):
    """``--engine vllm --store``: the connector's warm tier is sized the same way (vLLM's
    32-token blocks), or ``--cpu-capacity``; a fake ``vllm`` records what the engine asks."""
    import argparse
    import sys
    import types

    from kvstore.commands import batch as cmd

    asked = {}
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kw: asked.setdefault("llm", kw)
    config = types.ModuleType("vllm.config")
    config.KVTransferConfig = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    rng = random.Random(2)
    doc = [rng.randrange(VOCAB) for _ in range(100)]  # 3 blocks of 32 tokens
    prompts = [doc + [rng.randrange(VOCAB)] for _ in range(3)]
    args = argparse.Namespace(engine="vllm", model=str(model_dir), store=str(tmp_path / "s"),
                              salt=None, dtype="auto", max_batch_tokens=512, cpu_capacity=None)
    engine, warm = cmd._open_engine(args, None, prompts)
    extra = asked["llm"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert warm.prefix_blocks == 3 and warm.block_nbytes == 2 * BLOCK  # 32-token blocks
    assert extra == {"store_path": args.store, "cpu_capacity": warm.capacity}
    assert warm.capacity == 16 * 2 * BLOCK
    args.cpu_capacity = 3 << 20
    asked.clear()
    engine, warm = cmd._open_engine(args, None, prompts)
    assert asked["llm"]["kv_transfer_config"]["kv_connector_extra_config"]["cpu_capacity"] == 3 << 20
    assert warm.source == "--cpu-capacity"
