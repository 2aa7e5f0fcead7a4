"""``kvstore explain`` (and ``kvstore.admin.explain``): every miss reason on stores built with
``open_store``, the namespace fields named when a block is stored under another namespace,
typo'd model ids, the CLI's table/JSON, prompt inputs, and a live daemon."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from support.admin import cli_without_torch, kv_for, open_test_store, prompt_tokens, small_layout

from kvstore.admin.explain import Status, explain
from kvstore.admin.nsmatch import (
    FORMAT_VERSION,
    NamespaceNotFoundError,
    parse_extras,
    parse_layout,
)
from kvstore.cli import main
from kvstore.layout import KVLayout
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk import tombstones as tomb

LAY = small_layout()  # bfloat16 L2 P2 T4 H2 D16: 1 KiB blocks
LAYOUT = "bfloat16 L2 P2 T4 H2 D16"
A = parse_layout(LAYOUT, model_id="m/a")


def _tokens(i: int = 0, blocks: int = 4, *, extra: int = 0) -> list[int]:
    return prompt_tokens(i, blocks, LAY.block_tokens, shared=0) + list(range(extra))


def _put(path, model: str = "m/a", prompts=((0, 4),), *, salt=None, layout=None,
         **kw) -> list[list[bytes]]:
    lay = layout or LAY
    chains = []
    with open_test_store(path, model, lay, **kw) as s:
        for i, n in prompts:
            keys = s.block_keys(prompt_tokens(i, n, lay.block_tokens, shared=0), salt)
            s.put(keys, kv_for(keys, lay)).wait()
            chains.append([bytes(k) for k in keys])
    return chains


def _statuses(e) -> list[str]:
    return [b.status.value for b in e.per_block]


def _trace(path, keys: list[bytes], reason: tomb.Reason, tier: tomb.TierCode,
           detail: tomb.Detail = tomb.Detail.NONE, nid: bytes | None = None) -> None:
    """The tombstones the disk tier writes in the transaction that removes the records
    (eviction, drop_entries), added here when this tier does not write them yet."""
    t = DiskTier(path, capacity_bytes=0)
    try:
        nid = nid or A.id
        got = tomb.lookup_on(t, nid, keys)
        if got is tomb.NOT_KEPT or any(g is None for g in got):
            tomb.record_on(t, [(nid + k, 0) for k in keys], reason, tier, detail=detail)
    finally:
        t.close()


# -- namespaces and fields -----------------------------------------------------------------------

def test_fields_hash_like_the_engine():
    from kvstore.namespace import FORMAT_VERSION as NS_FORMAT
    from kvstore.namespace import Namespace

    assert FORMAT_VERSION == NS_FORMAT
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=4)
    ns = Namespace.create("m/a", lay, model_revision="r", tp_rank=1, tp_size=2,
                          extras={"lora": "x", "b": "1"})
    f = parse_layout(LAYOUT + " tp1/2", model_id="m/a", revision="r",
                     extras=parse_extras(["lora=x", "b=1"]))
    assert f.id == ns.id
    assert parse_layout(LAYOUT, model_id="m/a").id == Namespace.create("m/a", lay).id


@pytest.mark.parametrize("bad", ["bfloat16 L2 T4 H2", "L2 P2 T4 H2 D16", "bfloat16 L2 P3 T4 H2 D16",
                                 "bf16 L2 P2 T4 H2 D16", "bfloat16 L2 P2 T4 H2 D16 tp2/2"])
def test_bad_layouts_are_refused_with_an_example(bad):
    with pytest.raises(Exception, match="--layout") as ei:
        parse_layout(bad, model_id="m")
    assert "bfloat16 L32" in str(ei.value) or "rank" in str(ei.value)


# -- where blocks are ------------------------------------------------------------------------------

def test_all_blocks_hit_on_disk_and_the_partial_block_is_not_a_block(tmp_path):
    _put(tmp_path / "s")
    e = explain(tmp_path / "s", _tokens(extra=3), namespace=A)
    assert e.blocks == 4 and e.tokens == 19 and e.lookup_blocks == 4 and e.reused_tokens == 16
    assert _statuses(e) == ["hit"] * 4 and {b.tier for b in e.per_block} == {"disk"}
    assert [(r.first, r.last, r.status) for r in e.runs] == [(0, 3, Status.HIT)]
    assert e.namespace_registered and not e.closest


def test_never_stored_says_whether_evictions_can_be_ruled_out(tmp_path):
    _put(tmp_path / "s", prompts=((0, 2),))
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert _statuses(e) == ["hit", "hit", "never_stored", "never_stored"]
    if not e.tombstones_kept:  # an index without the tombstones database
        assert "cannot be ruled out" in e.runs[-1].text
    t = DiskTier(tmp_path / "s", capacity_bytes=0)
    tomb.db_in(t._ensure(), create=True)
    t.close()
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert e.tombstones_kept and e.runs[-1].text.startswith("never stored (no trace")


def test_evicted_by_the_disk_tier_says_when(tmp_path):
    (chain,) = _put(tmp_path / "s")
    t = DiskTier(tmp_path / "s", capacity_bytes=2 * LAY.block_nbytes)
    gone = t.evict_to_budget()
    t.close()
    assert sorted(gone) == sorted(chain[2:])  # leaf first
    _trace(tmp_path / "s", gone, tomb.Reason.EVICTED, tomb.TierCode.DISK)
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert _statuses(e) == ["hit", "hit", "evicted", "evicted"]
    b = e.per_block[3]
    assert b.tier == "disk" and b.when is not None and abs(b.when - time.time()) < 600
    assert "evicted by the disk tier" in e.runs[-1].text and "ago" in e.runs[-1].text


def test_removed_and_unreachable_below_it(tmp_path):
    (chain,) = _put(tmp_path / "s")
    t = DiskTier(tmp_path / "s", capacity_bytes=0)
    assert t.delete([chain[1]], namespace_id=A.id) == 1  # leaves its children orphaned
    t.close()
    _trace(tmp_path / "s", [chain[1]], tomb.Reason.REMOVED, tomb.TierCode.DISK)
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert _statuses(e) == ["hit", "removed", "unreachable", "unreachable"]
    assert e.lookup_blocks == 1 and "block 1" in e.runs[-1].text


def _corrupt(path, key: bytes, how: str) -> None:
    t = DiskTier(path, capacity_bytes=0, readonly=True)
    r = t.get_record(key, A.id)
    t.close()
    seg = os.path.join(path, "segments", f"{r.segment:016x}.safetensors")
    if how == "flip":
        with open(seg, "r+b") as f:
            f.seek(r.offset + 5)
            b = f.read(1)
            f.seek(r.offset + 5)
            f.write(bytes([b[0] ^ 0xFF]))
    elif how == "truncate":
        os.truncate(seg, r.offset + 10)
    else:
        os.unlink(seg)


@pytest.mark.parametrize("how,why,verify", [("flip", "checksum_mismatch", True),
                                            ("truncate", "short_segment", False),
                                            ("unlink", "missing_segment", False)])
def test_damaged_records_are_named(tmp_path, how, why, verify):
    with open_test_store(tmp_path / "s", "m/a", LAY) as s:  # blocks 2-3 in a segment of their own
        chain = s.block_keys(_tokens())
        s.put(chain[:2], kv_for(chain[:2], LAY)).wait()
        s.flush()
        s.put(chain[2:], kv_for(chain[2:], LAY)).wait()
    _corrupt(tmp_path / "s", chain[2], how)
    e = explain(tmp_path / "s", _tokens(), namespace=A, verify=verify)
    b = e.per_block[2]
    assert b.status is Status.DAMAGED and b.why == why and b.tier == "disk"
    assert e.lookup_blocks == 2 and e.per_block[3].status in (Status.UNREACHABLE, Status.DAMAGED)
    if how == "flip":  # without --verify only the file sizes are checked
        assert explain(tmp_path / "s", _tokens(), namespace=A).per_block[2].status is Status.HIT


def test_damaged_and_dropped_by_a_read(tmp_path):
    (chain,) = _put(tmp_path / "s")
    _corrupt(tmp_path / "s", chain[3], "flip")
    t = DiskTier(tmp_path / "s", capacity_bytes=0)
    assert t.read_into(chain[3], torch.empty(LAY.block_nbytes, dtype=torch.uint8),
                       A.id).value == "damaged"
    assert t.get_record(chain[3], A.id) is None  # dropped
    t.close()
    _trace(tmp_path / "s", [chain[3]], tomb.Reason.DAMAGED, tomb.TierCode.DISK,
           tomb.Detail.CHECKSUM_MISMATCH)
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    b = e.per_block[3]
    assert b.status is Status.DROPPED and b.why == "checksum_mismatch"
    assert "damaged (its bytes do not match their checksum) and dropped" in e.runs[-1].text


def test_pruned_unreachable(tmp_path):
    (chain,) = _put(tmp_path / "s")
    t = DiskTier(tmp_path / "s", capacity_bytes=0)
    t.delete(chain[2:], namespace_id=A.id, reason=tomb.Reason.PRUNED,
             detail=tomb.Detail.UNREACHABLE)  # as prune's unreachable pass does
    t.close()
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert _statuses(e)[2:] == ["pruned", "pruned"] and "prune" in e.runs[-1].text


# -- another namespace, another salt, nobody's namespace --------------------------------------------

VARIANTS = [
    ("model", {"model": "m/b"}),
    ("revision", {"model_revision": "r2"}),
    ("dtype", {"layout": KVLayout(num_layers=2, num_kv_heads=2, head_dim=16,
                                  dtype=torch.float16, block_tokens=4)}),
    ("layout", {"layout": KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=4)}),
    ("layout", {"layout": KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8)}),
    ("tp_rank", {"tp_rank": 1, "tp_size": 2}),
    ("extras", {"namespace_extras": {"lora": "adapter-7"}}),
]


@pytest.mark.parametrize("field,kw", VARIANTS)
def test_stored_under_another_namespace_names_the_field(tmp_path, field, kw):
    kw = dict(kw)
    model = kw.pop("model", "m/a")
    lay = kw.pop("layout", LAY)
    with open_test_store(tmp_path / "s", model, lay, **kw) as s:
        toks = _tokens()  # 16 tokens: 4 blocks of 4, or 2 of 8
        keys = s.block_keys(toks)
        s.put(keys, kv_for(keys, lay)).wait()
    _put(tmp_path / "s", prompts=((5, 1),))  # m/a itself is registered, holds other prompts
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert e.namespace_registered
    assert _statuses(e) == ["other_namespace"] * 4
    b = e.per_block[0]
    assert field in b.differs and len(e.holders) == 1
    assert e.holders[0].namespace_id == b.namespace_id
    assert f"{field} " in e.runs[0].text and " there, " in e.runs[0].text


def test_a_typod_model_id_is_a_namespace_nobody_opened(tmp_path):
    _put(tmp_path / "s", model="meta-llama/Llama-3.1-8B")
    typo = parse_layout(LAYOUT, model_id="meta-llama/Llama-3.1-8b")
    e = explain(tmp_path / "s", _tokens(), namespace=typo)
    assert not e.namespace_registered
    (m,) = e.closest
    assert m.model_id == "meta-llama/Llama-3.1-8B" and [d.field for d in m.differs] == ["model"]
    assert _statuses(e) == ["other_namespace"] * 4
    e2 = explain(tmp_path / "s", _tokens(i=3), namespace=typo)
    assert _statuses(e2) == ["never_stored"] * 4 and "no engine has opened" in e2.runs[0].text


def test_another_salt(tmp_path):
    _put(tmp_path / "s", salt="tenant-a")
    e = explain(tmp_path / "s", _tokens(), namespace=A, salt="tenant-b", try_salts=["tenant-a"])
    assert _statuses(e) == ["other_salt"] * 4 and e.per_block[0].salt == "tenant-a"
    assert "under salt 'tenant-a'" in e.runs[0].text
    assert _statuses(explain(tmp_path / "s", _tokens(), namespace=A)) == ["never_stored"] * 4
    _put(tmp_path / "s2")
    e = explain(tmp_path / "s2", _tokens(), namespace=A, salt="x")
    assert _statuses(e) == ["other_salt"] * 4 and e.per_block[0].salt is None
    assert "without a salt" in e.runs[0].text


def test_salted_blocks_without_a_salt_name_the_salt_flag(tmp_path, capsys):
    """Issue 31: blocks stored under a salt, explained without one, were 'never_stored' with
    no hint; the salt is hashed into every key, so explain says how to look under one."""
    _put(tmp_path / "s", salt="tenant-a")
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert _statuses(e) == ["never_stored"] * 4
    assert "--salt SALT" in e.runs[0].text and "cache salt" in e.runs[0].text
    assert main(["explain", "--store", str(tmp_path / "s"), "--namespace", "m/a", "--tokens",
                 json.dumps(_tokens())]) == 0
    assert "--salt SALT" in capsys.readouterr().out
    e = explain(tmp_path / "s", _tokens(), namespace=A, salt="tenant-a")
    assert e.lookup_blocks == 4
    e = explain(tmp_path / "s", _tokens(), namespace=A, salt="tenant-b")  # a salt was given
    assert _statuses(e) == ["never_stored"] * 4 and "--salt" not in e.runs[0].text
    _put(tmp_path / "s", prompts=((0, 2),))  # the first half stored without a salt too
    e = explain(tmp_path / "s", _tokens(), namespace=A)
    assert _statuses(e) == ["hit"] * 2 + ["never_stored"] * 2
    assert all("--salt" not in r.text for r in e.runs)  # a miss after hits: not a salt


def test_namespace_by_id_prefix_or_model(tmp_path):
    _put(tmp_path / "s")
    _put(tmp_path / "s", model="m/b")
    assert explain(tmp_path / "s", _tokens(), namespace=A.id.hex()[:6]).lookup_blocks == 4
    assert explain(tmp_path / "s", _tokens(), namespace="m/a").lookup_blocks == 4
    with pytest.raises(NamespaceNotFoundError, match="did you mean 'm/a'"):
        explain(tmp_path / "s", _tokens(), namespace="m/aa")


# -- the command line ------------------------------------------------------------------------------

def _json(capsys) -> dict:
    data = json.loads(capsys.readouterr().out)
    assert data.pop("schema") == "kvstore.explain/1"
    return data


def test_cli_table_and_json(tmp_path, capsys):
    _put(tmp_path / "s", prompts=((0, 2),))
    toks = json.dumps(_tokens())
    base = ["explain", "--store", str(tmp_path / "s"), "--model", "m/a", "--layout", LAYOUT]
    assert main([*base, "--tokens", toks]) == 0
    out = capsys.readouterr().out
    assert "0-1" in out and "hit" in out and "never_stored" in out
    assert "A lookup finds 2 of 4 block(s): 8 of 16 tokens reused (50.0%)" in out
    assert main([*base, "--tokens", toks, "--format", "json"]) == 0
    data = _json(capsys)
    assert data["lookup_blocks"] == 2 and data["namespace_id"] == A.id.hex()
    assert [b["status"] for b in data["per_block"]] == ["hit", "hit", "never_stored", "never_stored"]
    assert [r["status"] for r in data["runs"]] == ["hit", "never_stored"]
    assert main([*base, "--tokens", toks, "--blocks"]) == 0
    assert capsys.readouterr().out.count("never_stored") == 2


def test_cli_prompt_files(tmp_path, capsys):
    _put(tmp_path / "s")
    f1, f2, f3 = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.txt"
    f1.write_text(json.dumps(_tokens()))
    f2.write_text(json.dumps({"prompt_token_ids": [_tokens()]}))
    f3.write_text(" ".join(map(str, _tokens())))
    for f in (f1, f2, f3):
        assert main(["explain", "--store", str(tmp_path / "s"), "--namespace", "m/a",
                     "--tokens-file", str(f), "--format", "json"]) == 0
        assert _json(capsys)["lookup_blocks"] == 4


@pytest.mark.parametrize("args,msg", [
    (["--namespace", "m/zz", "--tokens", "[1,2,3,4]"], "no namespace matches"),
    (["--model", "m/a", "--tokens", "[1,2,3,4]"], "name the namespace"),
    (["--model", "m/a", "--layout", "L2", "--tokens", "[1]"], "bad --layout"),
    (["--namespace", "m/a", "--tokens", "[1, -2]"], "out of range"),
    (["--namespace", "m/a", "--tokens", "[1, 2"], "not valid JSON"),
    (["--namespace", "m/a", "--text", "hello"], "--tokenizer"),
])
def test_cli_bad_input_exits_2(tmp_path, capsys, args, msg):
    _put(tmp_path / "s")
    assert main(["explain", "--store", str(tmp_path / "s"), *args]) == 2
    assert msg in capsys.readouterr().err


def test_cli_text_through_a_local_tokenizer(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]"] + [f"w{i}" for i in range(64)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(
        tmp_path / "tok")
    text = " ".join(f"w{i}" for i in range(1, 17))
    with open_test_store(tmp_path / "s", "m/a", LAY) as s:
        keys = s.block_keys(list(range(2, 18)))
        s.put(keys, kv_for(keys, LAY)).wait()
    assert main(["explain", "--store", str(tmp_path / "s"), "--namespace", "m/a", "--text", text,
                 "--tokenizer", str(tmp_path / "tok"), "--format", "json"]) == 0
    assert _json(capsys)["lookup_blocks"] == 4


# -- live, through a daemon ------------------------------------------------------------------------

def test_live_daemon_reports_the_warm_tier(tmp_path, serve):
    from kvstore.client import connect

    d = serve("--cpu-capacity", "64KiB")
    with connect(d.socket_path, layout=LAY, model_id="m/a", device="cpu") as c:
        keys = c.block_keys(_tokens())
        assert c.put(keys[:3], kv_for(keys[:3], LAY)).wait() == 3
        c.flush()
        e = explain(d.path, _tokens(), namespace=A, socket=str(d.socket_path))
        assert e.socket == str(d.socket_path)
        assert [b.tier for b in e.per_block] == ["warm", "warm", "warm", None]
        assert _statuses(e) == ["hit"] * 3 + ["never_stored"]
        assert c.evict(keys, tier="warm") >= 0
        e = explain(d.path, _tokens(), namespace=A, socket=str(d.socket_path))
        assert {b.tier for b in e.per_block[:3]} <= {"warm", "disk"}
        assert e.lookup_blocks == 3
    other = parse_layout(LAYOUT, model_id="m/typo")
    e = explain(d.path, _tokens(), namespace=other, socket=str(d.socket_path))
    assert e.socket is None and "not asked" in e.live_note  # a hello would open it


def test_explain_socket_never_imports_torch(tmp_path, serve):
    """``kvstore explain --socket`` asks a daemon and reads the disk: no torch (issue 31:
    4.5 s)."""
    from kvstore.client import connect

    d = serve("--cpu-capacity", "64KiB")
    with connect(d.socket_path, layout=LAY, model_id="m/a", device="cpu") as c:
        keys = c.block_keys(_tokens())
        assert c.put(keys[:3], kv_for(keys[:3], LAY)).wait() == 3
    p, took = cli_without_torch("explain", "--store", str(d.path), "--socket", str(d.socket_path),
                                "--namespace", "m/a", "--tokens", json.dumps(_tokens()),
                                "--format", "json")
    assert p.returncode == 0, p.stderr  # 99: it imported torch
    data = json.loads(p.stdout)
    assert [b["tier"] for b in data["per_block"]] == ["warm", "warm", "warm", None]
    print(f"kvstore explain --socket: {took:.2f} s in process")
