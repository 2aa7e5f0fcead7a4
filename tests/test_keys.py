import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import KeyFormatError, TokenError
from kvstore.keys import KeyChain, block_keys, chain_python, root_key, tokens_to_u32le

NID = bytes(range(32))


def spec_keys(nid, tokens, bt, salt=b"", extras=None):
    """docs/architecture.md "Keys" written out longhand, independent of kvstore.keys."""
    k = hashlib.sha256(b"kvstore/1" + nid + salt).digest()
    out = []
    for i in range(len(tokens) // bt):
        data = k + struct.pack(f"<{bt}I", *tokens[i * bt : (i + 1) * bt])
        if extras and extras[i]:
            data += extras[i]
        k = hashlib.sha256(data).digest()
        out.append(k)
    return out


# Frozen vectors: these bytes must never change without a FORMAT_VERSION bump.
GOLDEN_ROOT = "0914aa6d1f4d6eba31878dbb41f3df30f7464eb542d2f1659af0ae37507d8808"
GOLDEN_ROOT_SALTED = "c0b0600019600b16e9bebd4668916ae503f03e2000214a9628aa2418c4eac2c1"
GOLDEN_RANGE40_BT16 = [
    "5b1374be1396f569bb8da0fc1f5d617c2a5cb037390ff8b7856444920669f668",
    "cdb2c6a490e1ca3cf382df31eee2f03de567d5c92c550329a7c274a9f9559c33",
]
GOLDEN_EXTRAS = [
    "b08370ec22bae53c9c2fd54a4110947e42897282211a30dddbffd2f05befb01e",
    "90fdb4d197db38987219778879c7de376327032db5afad3d2376fcfc94de0265",
    "86a435329b79a5a51a6fb7133fb1a5c711811a37ea30ca9dd71af5ba60e11fc4",
    "8326a3ba55fc1542eef99b4c424c6a444d25a3d03362583e64a7633079433337",
]


def test_golden_roots():
    assert root_key(NID).hex() == GOLDEN_ROOT
    assert root_key(NID, "tenant-a").hex() == GOLDEN_ROOT_SALTED
    assert root_key(NID, b"tenant-a").hex() == GOLDEN_ROOT_SALTED


def test_golden_chain():
    keys = block_keys(NID, list(range(40)), 16)
    assert [k.hex() for k in keys] == GOLDEN_RANGE40_BT16
    assert [k.hex() for k in spec_keys(NID, list(range(40)), 16)] == GOLDEN_RANGE40_BT16


def test_golden_chain_with_salt_and_extras():
    toks = [0, 2**32 - 1, 7, 123456] * 4
    extras = [b"img0", None, b"", b"x"]
    keys = block_keys(NID, toks, 4, salt=b"s", extras=extras)
    assert [k.hex() for k in keys] == GOLDEN_EXTRAS
    assert [k.hex() for k in spec_keys(NID, toks, 4, b"s", extras)] == GOLDEN_EXTRAS


def test_only_full_blocks_are_keyed():
    assert len(block_keys(NID, list(range(15)), 16)) == 0
    assert len(block_keys(NID, list(range(33)), 16)) == 2
    assert block_keys(NID, [], 16) == []


@pytest.mark.parametrize(
    "container",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
)
def test_token_containers_agree(container):
    toks = list(range(1000, 1064))
    assert block_keys(NID, container(toks), 16) == spec_keys(NID, toks, 16)


@pytest.mark.parametrize(
    "bad",
    [[-1, 2, 3], [2**32], [1.5, 2], ["a"], np.array([1.0, 2.0]), torch.tensor([1.0]),
     torch.tensor([-5]), np.array([-1]), np.array([True, False]), b"abcd", "abcd",
     [None]],
)
def test_bad_tokens_raise(bad):
    with pytest.raises(TokenError):
        block_keys(NID, bad, 1)


def test_bad_extras_and_block_tokens():
    with pytest.raises(KeyFormatError, match="one entry per block"):
        block_keys(NID, list(range(32)), 16, extras=[b"a"])
    with pytest.raises(KeyFormatError):
        block_keys(NID, list(range(32)), 16, extras=[b"a", 3])
    with pytest.raises(KeyFormatError):
        block_keys(NID, list(range(32)), 0)
    with pytest.raises(TokenError):
        block_keys(NID, list(range(32)), 16, salt=3)
    # one entry per block counting the trailing partial block is accepted
    assert len(block_keys(NID, list(range(40)), 16, extras=[None, None, b"p"])) == 2


def test_keychain_slices_keep_parent_and_namespace():
    keys = block_keys(NID, list(range(64)), 16)
    assert isinstance(keys, list) and isinstance(keys, KeyChain)
    assert keys.parent is None and keys.namespace_id == NID
    tail = keys[2:]
    assert isinstance(tail, KeyChain) and tail.parent == keys[1] and tail.namespace_id == NID
    assert keys[:2].parent is None
    assert keys[1:3][1:].parent == keys[1]
    assert keys[::2].parent is None
    assert "KeyChain" in repr(keys)


def test_keys_identical_in_another_process():
    code = (
        "from kvstore.keys import block_keys;"
        "print(''.join(k.hex() for k in block_keys(bytes(range(32)), list(range(100)), 16, salt='t')))"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    assert out == "".join(k.hex() for k in block_keys(NID, list(range(100)), 16, salt="t"))


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=200)


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, bt=st.integers(1, 20), salt=st.binary(max_size=8))
def test_chain_matches_spec(tokens, bt, salt):
    assert block_keys(NID, tokens, bt, salt=salt) == spec_keys(NID, tokens, bt, salt)
    assert chain_python(root_key(NID, salt), tokens_to_u32le(tokens), bt, None) == spec_keys(
        NID, tokens, bt, salt
    )


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=64),
       s1=st.binary(max_size=8), s2=st.binary(max_size=8),
       n1=st.binary(min_size=32, max_size=32), n2=st.binary(min_size=32, max_size=32))
def test_salts_and_namespaces_never_share_keys(tokens, s1, s2, n1, n2):
    a = set(block_keys(n1, tokens, 4, salt=s1))
    b = set(block_keys(n2, tokens, 4, salt=s2))
    if (n1, s1) != (n2, s2):
        assert not a & b
    else:
        assert a == b


@settings(max_examples=100, deadline=None)
@given(a=tokens_st, b=tokens_st, bt=st.integers(1, 8))
def test_equal_keys_iff_equal_prefix(a, b, bt):
    ka, kb = block_keys(NID, a, bt), block_keys(NID, b, bt)
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[: (i + 1) * bt] == b[: (i + 1) * bt])
