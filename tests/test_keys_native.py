"""The native key chain (kvstore._native) against the pure-Python path and the spec."""

from __future__ import annotations

import array
import hashlib
import os
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import keys
from kvstore.errors import KeyFormatError, TokenError
from kvstore.keys import block_keys, chain_python, root_key, tokens_to_u32le

_native = pytest.importorskip("kvstore._native", reason="native extension not built")

IMPLS = [
    "portable",
    pytest.param(
        "sha-ni",
        marks=pytest.mark.skipif(not _native.cpu_has_sha_ni(), reason="CPU has no SHA-NI"),
    ),
]
NID = hashlib.sha256(b"kvstore-golden-namespace").digest()
U32_MAX = 2**32 - 1


def spec_keys(nid, tokens, bt, salt=b"", extras=None):
    """docs/architecture.md "Keys" written out longhand with hashlib, independent of kvstore."""
    k = hashlib.sha256(b"kvstore/1" + nid + salt).digest()
    out = []
    for i in range(len(tokens) // bt):
        data = k + struct.pack(f"<{bt}I", *tokens[i * bt : (i + 1) * bt])
        if extras is not None and extras[i]:
            data += bytes(extras[i])
        k = hashlib.sha256(data).digest()
        out.append(k)
    return out


def run_py(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, check=True,
                          capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------------------------
# golden vectors

GOLDEN_TOKENS = [*range(40), U32_MAX, 0, 128000, 7]
GOLDEN_ROOT = "f7f799ebb1f29b9624e069f72f033a21d9fd4f0ef8bdccaedff6dc4b773b67fb"  # salt tenant-a
GOLDEN_BT16 = [
    "1dce597249edffc2c778203c5d7f8921db29f42c8b9e6d7e00a8ad5ff696c653",
    "ba11bd9368b9ff26afd8827d047bb7d3b62dbada57a498b60d63beaf5499558a",
]
GOLDEN_EXTRAS = [None, b"img:1", b"", None, bytes(range(100)), None, None, None, b"x", None, b"tail"]
GOLDEN_BT4_EXTRAS = [
    "9ffd0faa72c4a77cc42f90ea41099f1e44589d1404398e209d1fa66a71761b3b",
    "ddc6b1128f41e2fe5f9e879bb9cc58c02f8018a4b1058570cce666a23038a156",
    "2aeda009d0c7ae9b2b37563f12e0d07f92d7f6ae886a8177eb36591cb62b8f65",
    "9e3c9e011178d30d7dc9137d2ee7408ec1b6759a93fa8925817a2331cda6678e",
    "4232954ad79baac53260977e19f9e08625041a7f9f994736b9f0205e52b4f8b7",
    "4bfce48f3267a9e66c91546de1a9b362080c71f20f7b32f852cc586625ea8500",
    "31ed8bf571eb93835a6f1b525dcfdc7ec351e68450797686b71b5d92d4b29eb8",
    "14df586c08a98ccd5f9c8e81e9d1ac9e13ba89eda024f8709a8cd75da8a72fbc",
    "d53a8b25c7e90f9e2f869c5c559c55e8b47dbfe2fea3cd14021a5c8ba85fbf7d",
    "3e3234dc0b2db5d0784c48867ec9ef4adac095631ef88d85157859faa1c0a07a",
    "b8c73f69364357cdac5178bef3d16c31d430ce8e6f993c0dc6e8ffc4f4acc906",
]


def test_backend_is_native():
    pure = os.environ.get("KVSTORE_PURE_PYTHON", "") not in ("", "0")
    assert keys.backend == ("python" if pure else "native")
    assert _native.active_impl() in ("sha-ni", "portable")
    assert isinstance(_native.cpu_has_sha_ni(), bool)
    if not _native.cpu_has_sha_ni():
        assert _native.active_impl() == "portable"


def test_spec_reference_matches_golden():
    assert root_key(NID, "tenant-a").hex() == GOLDEN_ROOT
    assert [k.hex() for k in spec_keys(NID, GOLDEN_TOKENS, 16, b"tenant-a")] == GOLDEN_BT16
    got = spec_keys(NID, GOLDEN_TOKENS, 4, b"", GOLDEN_EXTRAS)
    assert [k.hex() for k in got] == GOLDEN_BT4_EXTRAS


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_native(impl):
    root = root_key(NID, "tenant-a")
    got = _native.chain_keys(root, GOLDEN_TOKENS, 16, None, impl=impl)
    assert [k.hex() for k in got] == GOLDEN_BT16
    got = _native.chain_keys(root_key(NID), GOLDEN_TOKENS, 4, GOLDEN_EXTRAS, impl=impl)
    assert [k.hex() for k in got] == GOLDEN_BT4_EXTRAS
    tb = tokens_to_u32le(GOLDEN_TOKENS)
    assert _native.chain_keys(root, tb, 16, impl=impl) == chain_python(root, tb, 16, None)


def test_golden_block_keys():
    assert [k.hex() for k in block_keys(NID, GOLDEN_TOKENS, 16, salt="tenant-a")] == GOLDEN_BT16
    got = block_keys(NID, GOLDEN_TOKENS, 4, extras=GOLDEN_EXTRAS)
    assert [k.hex() for k in got] == GOLDEN_BT4_EXTRAS


# ------------------------------------------------------------------------------------------
# the SHA-256 primitive: NIST (FIPS 180-2 appendix B / CAVS) vectors, on both impls

NIST = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
     "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
    (b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopq"
     b"klmnopqrlmnopqrsmnopqrstnopqrstu",
     "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
    (b"\xbd", "68325720aabd7c82f30f554b313d0570c95accbb7dc4b5aae11204c08ffe732b"),
    (b"\xc9\x8c\x8e\x55", "7abc22c0ae5af26ce93dbb94433a0e0b2e119d014f8e7f65bd56c61ccccd9504"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("msg", "digest"), NIST, ids=range(len(NIST)))
def test_sha256_nist(impl, msg, digest):
    assert _native.sha256(msg, impl=impl).hex() == digest
    assert hashlib.sha256(msg).hexdigest() == digest


@pytest.mark.parametrize("impl", IMPLS)
def test_sha256_every_length_around_block_edges(impl):
    data = bytes(range(256)) * 3
    for n in range(0, 300):
        assert _native.sha256(data[:n], impl=impl) == hashlib.sha256(data[:n]).digest(), n
    big = os.urandom((1 << 17) + 13)  # over the GIL-release threshold
    assert _native.sha256(big, impl=impl) == hashlib.sha256(big).digest()
    assert _native.sha256(memoryview(big)[5:], impl=impl) == hashlib.sha256(big[5:]).digest()


def test_impl_argument_is_checked():
    with pytest.raises(ValueError, match="impl"):
        _native.sha256(b"", impl="avx9000")
    with pytest.raises(TypeError, match="impl"):
        _native.chain_keys(bytes(32), [], 1, impl=1)
    if not _native.cpu_has_sha_ni():
        with pytest.raises(ValueError, match="sha-ni"):
            _native.sha256(b"", impl="sha-ni")


# ------------------------------------------------------------------------------------------
# native == python on generated inputs

token = st.integers(min_value=0, max_value=U32_MAX)
tokens_st = st.lists(
    st.one_of(token, st.sampled_from([0, 1, U32_MAX, U32_MAX - 1, 2**31 - 1, 2**31, 2**30])),
    max_size=300,
)
salts = st.one_of(st.none(), st.text(max_size=12), st.binary(max_size=40))
extra = st.one_of(st.none(), st.binary(max_size=150))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=tokens_st, bt=st.integers(1, 40), salt=salts, data=st.data())
def test_native_matches_python(tokens, bt, salt, data):
    n_full = len(tokens) // bt
    extras = data.draw(st.one_of(st.none(), st.lists(extra, min_size=n_full, max_size=n_full)))
    root = root_key(NID, salt)
    tb = tokens_to_u32le(tokens)
    want = chain_python(root, tb, bt, extras)
    for impl in ("portable", "sha-ni") if _native.cpu_has_sha_ni() else ("portable",):
        assert _native.chain_keys(root, tokens, bt, extras, impl=impl) == want
        assert _native.chain_keys(root, tb, bt, extras, impl=impl) == want
    got = block_keys(NID, tokens, bt, salt=salt, extras=extras)
    assert list(got) == want
    assert got.namespace_id == NID and got.parent is None
    if len(tokens) < 60:
        assert want == spec_keys(NID, tokens, bt, keys.salt_bytes(salt), extras)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bt", [1, 3, 4, 8, 12, 13, 15, 16, 17, 24, 32, 64, 100])
def test_block_sizes_and_long_chains(impl, bt):
    rng = np.random.default_rng(bt)
    tokens = rng.integers(0, 2**32, size=bt * 150 + bt // 2, dtype=np.uint64).tolist()
    root = root_key(NID, b"s")
    tb = tokens_to_u32le(tokens)
    want = chain_python(root, tb, bt, None)
    assert len(want) == 150  # > 64 blocks: hashed with the GIL released
    assert _native.chain_keys(root, tokens, bt, None, impl=impl) == want
    ex = [None if i % 3 else bytes([i % 256]) * (i % 90) for i in range(150)]
    assert _native.chain_keys(root, tb, bt, ex, impl=impl) == chain_python(root, tb, bt, ex)


def test_empty_and_partial_inputs():
    root = root_key(NID)
    for tokens in ([], [5], list(range(15))):
        assert _native.chain_keys(root, tokens, 16, None) == []
        assert _native.chain_keys(root, tokens, 16, []) == []
        assert list(block_keys(NID, tokens, 16)) == []
    assert _native.chain_keys(root, list(range(17)), 16) == chain_python(
        root, tokens_to_u32le(range(17)), 16, None)
    assert _native.chain_keys(root, [1, 2, 3], 2**70) == []  # huge block: no full block
    assert list(block_keys(NID, [1, 2, 3], 2**70)) == []


# ------------------------------------------------------------------------------------------
# implementations and backends agree across processes

KEYS_CODE = (
    "from kvstore import keys, _native\n"
    "ks = keys.block_keys(bytes(range(32)), list(range(1000)) + [2**32 - 1] * 40, 16,"
    " salt='t', extras=[bytes([i]) * i for i in range(65)])\n"
    "print(keys.backend, _native.active_impl(), ''.join(k.hex() for k in ks))\n"
)


def _expected_keys_hex() -> str:
    ks = block_keys(bytes(range(32)), list(range(1000)) + [U32_MAX] * 40, 16, salt="t",
                    extras=[bytes([i]) * i for i in range(65)])
    return "".join(k.hex() for k in ks)


def test_portable_env_in_subprocess_gives_same_keys():
    backend, impl, hexkeys = run_py(KEYS_CODE, KVSTORE_NATIVE_PORTABLE="1").split()
    assert (backend, impl) == ("native", "portable")
    assert hexkeys == _expected_keys_hex()
    backend, impl, hexkeys = run_py(KEYS_CODE).split()
    assert backend == "native"
    assert impl == ("sha-ni" if _native.cpu_has_sha_ni() else "portable")
    assert hexkeys == _expected_keys_hex()


def test_portable_env_read_at_call_time(monkeypatch):
    monkeypatch.setenv("KVSTORE_NATIVE_PORTABLE", "1")
    assert _native.active_impl() == "portable"
    monkeypatch.setenv("KVSTORE_NATIVE_PORTABLE", "0")
    assert _native.active_impl() == ("sha-ni" if _native.cpu_has_sha_ni() else "portable")


def test_pure_python_env_in_subprocess():
    code = KEYS_CODE.replace("keys, _native", "keys").replace(", _native.active_impl()", "")
    backend, hexkeys = run_py(code, KVSTORE_PURE_PYTHON="1").split()
    assert backend == "python"
    assert hexkeys == _expected_keys_hex()


# ------------------------------------------------------------------------------------------
# token containers

BASE = [*range(0, 70), 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 127999, 5, 6, 7, 8, 9]


def _containers():
    yield "list", list(BASE)
    yield "tuple", tuple(BASE)
    yield "array.array I", array.array("I", BASE)
    yield "array.array Q", array.array("Q", BASE)
    yield "range", range(0, 80)  # via tokens_to_u32le
    for dt in ("<u4", ">u4", "<i8", ">i8", "<u8", ">u8", "=i8"):
        yield f"numpy {dt}", np.array(BASE, dtype=dt)
    yield "numpy int32", np.array(BASE[:70], dtype=np.int32)
    yield "numpy int16", np.array(BASE[:70], dtype=np.int16)
    yield "numpy uint16", np.array(BASE[:70], dtype=np.uint16)
    yield "numpy uint8", np.array(BASE[:70], dtype=np.uint8)
    yield "numpy strided", np.array(BASE * 2, dtype=np.int64)[::2]
    yield "numpy reversed", np.array(BASE[::-1], dtype=np.uint32)[::-1]
    yield "numpy one row", np.array(BASE, dtype=np.int64).reshape(1, 80)
    yield "numpy one row, strided", np.array(BASE * 2, dtype=np.int64).reshape(2, 80)[:1, ::2][:, ::1]
    yield "numpy scalars in a list", [np.int64(t) for t in BASE]
    yield "torch int64", torch.tensor(BASE, dtype=torch.int64)
    yield "torch int32", torch.tensor(BASE[:70], dtype=torch.int32)
    yield "torch uint32", torch.tensor(BASE, dtype=torch.uint32)
    yield "torch int64 one row", torch.tensor(BASE, dtype=torch.int64).reshape(1, 80)
    yield "torch non-contiguous", torch.tensor(BASE * 2, dtype=torch.int64)[::2]


@pytest.mark.parametrize(("name", "tokens"), list(_containers()), ids=lambda v: v if isinstance(v, str) else "")
def test_containers_agree(name, tokens):
    flat = (tokens.flatten().tolist() if hasattr(tokens, "flatten") else [int(t) for t in tokens])
    want = chain_python(root_key(NID), tokens_to_u32le(flat), 8, None)
    assert list(block_keys(NID, tokens, 8)) == want
    assert list(block_keys(NID, flat, 8)) == want
    if isinstance(tokens, (list, tuple, array.array)) or (
        isinstance(tokens, np.ndarray)
        and tokens.dtype.itemsize > 1
        and tokens.ndim == 1
    ):
        assert _native.chain_keys(root_key(NID), tokens, 8) == want


def test_u32_bytes_and_memoryviews_direct():
    root = root_key(NID)
    want = chain_python(root, tokens_to_u32le(BASE), 8, None)
    assert _native.chain_keys(root, tokens_to_u32le(BASE), 8) == want
    mv = memoryview(array.array("q", BASE))
    assert _native.chain_keys(root, mv, 8) == want
    assert _native.chain_keys(root, mv[::1], 8) == want
    assert _native.chain_keys(bytearray(root), BASE, 8) == want  # root: any bytes-like
    with pytest.raises(ValueError, match="multiple of 4"):
        _native.chain_keys(root, b"\x00" * 6, 1)
    with pytest.raises(TypeError, match="format"):
        _native.chain_keys(root, bytearray(8), 1)  # bytes-like but not uint32 LE bytes
    with pytest.raises(TypeError, match="format"):
        _native.chain_keys(root, np.zeros(4, dtype=np.float32), 1)
    with pytest.raises(TypeError, match="format"):
        _native.chain_keys(root, np.zeros(4, dtype=bool), 1)


# ------------------------------------------------------------------------------------------
# errors

BAD_TOKENS = [
    [1, -1],
    [2**32],
    [0, 2**64],
    [-(2**70)],
    [1.0],
    [1, "2"],
    [None],
    [1, 2.5, 3],
    np.array([1.5]),
    np.array([1, -1]),
    np.array([2**32], dtype=np.int64),
    np.array([2**40], dtype=np.uint64),
    np.array([True, False]),
    np.array(["1", "2"]),
    torch.tensor([True]),
    [True, False] * 8,  # bools are ints to Python, never token ids
    [1, 2, False],
    (5, True),
    np.array(BASE, dtype=np.int64).reshape(8, 10),  # a batch of prompts: never one flattened
    np.array(BASE, dtype=np.int64).reshape(10, 8).T,
    torch.tensor(BASE, dtype=torch.int64).reshape(8, 10),
    torch.tensor(BASE, dtype=torch.int64).reshape(10, 8).t(),
    torch.tensor(7),
    np.int64(7),
    torch.tensor([1.0]),
    torch.tensor([-1]),
    torch.tensor([2**33]),
    torch.tensor([1, -5], dtype=torch.int32),
    "abc",
    b"\x00\x00\x00\x00",
]


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_bad_tokens_raise_token_error_like_python(bad):
    with pytest.raises(TokenError) as native_err:
        block_keys(NID, bad, 1)
    with pytest.raises(TokenError) as python_err:
        tokens_to_u32le(bad)
    assert str(native_err.value) == str(python_err.value)


@pytest.mark.parametrize(
    ("tokens", "exc", "match"),
    [
        ([1, -1], OverflowError, r"token id -1 \(at index 1\)"),
        ([0, 0, 2**32], OverflowError, r"token id 4294967296 \(at index 2\)"),
        ([2**100], OverflowError, "out of range"),
        (np.array([3, -7], dtype=np.int32), OverflowError, r"token id -7 \(at index 1\)"),
        (np.array([2**63 + 5], dtype=np.uint64), OverflowError, str(2**63 + 5)),
        (np.array([0, 2**32], dtype=">i8"), OverflowError, r"token id 4294967296"),
        ([1, 2.0], TypeError, r"must be ints.*2\.0.*float.*index 1"),
        (["7"], TypeError, "str"),
        ({1, 2}, TypeError, "set"),
        (7, TypeError, "int"),
        ([1, True], TypeError, r"True \(bool\) at index 1"),
        ((False,), TypeError, "bool"),
    ],
)
def test_native_error_types(tokens, exc, match):
    with pytest.raises(exc, match=match):
        _native.chain_keys(root_key(NID), tokens, 1)


def test_native_argument_errors():
    root = root_key(NID)
    with pytest.raises(ValueError, match="root must be 32 bytes"):
        _native.chain_keys(b"short", [1], 1)
    with pytest.raises(ValueError, match="block_tokens"):
        _native.chain_keys(root, [1], 0)
    with pytest.raises(ValueError, match="block_tokens"):
        _native.chain_keys(root, [1], -3)
    with pytest.raises(ValueError, match="one entry per full block"):
        _native.chain_keys(root, [1, 2, 3], 1, [None, None])
    with pytest.raises(TypeError, match=r"extras\[1\]"):
        _native.chain_keys(root, [1, 2], 1, [b"a", "b"])
    with pytest.raises(TypeError, match="extras must be"):
        _native.chain_keys(root, [1, 2], 1, b"ab")
    # extras may be any bytes-like object
    want = chain_python(root, tokens_to_u32le([1, 2]), 1, [b"ab", b"cd"])
    assert _native.chain_keys(root, [1, 2], 1, [bytearray(b"ab"), memoryview(b"cd")]) == want


def test_block_keys_extras_errors_match_python():
    with pytest.raises(KeyFormatError):
        block_keys(NID, list(range(8)), 4, extras=[None])
    with pytest.raises(KeyFormatError):
        block_keys(NID, np.arange(8), 4, extras=[None, 3])
    # bad tokens are reported before bad extras, as on the Python path
    with pytest.raises(TokenError):
        block_keys(NID, [1, -1, 3, 4], 2, extras=[None])
    # the partial last block may carry an (ignored) extra, as on the Python path
    assert block_keys(NID, list(range(10)), 4, extras=[b"a", b"b", b"c"]) == block_keys(
        NID, list(range(8)), 4, extras=[b"a", b"b"])
    # a non-contiguous memoryview extra works like bytes(e)
    mv = memoryview(b"abcdef")[::2]
    assert block_keys(NID, [1, 2], 2, extras=[mv]) == block_keys(NID, [1, 2], 2, extras=[b"ace"])


# ------------------------------------------------------------------------------------------
# robustness

class EvilIndex:
    """An int-like whose __index__ mutates the list being converted."""

    def __init__(self, victim: list, value: int) -> None:
        self.victim, self.value = victim, value

    def __index__(self) -> int:
        self.victim.clear()
        return self.value


def test_list_mutated_during_conversion_is_safe():
    tokens: list = list(range(40))
    tokens.append(EvilIndex(tokens, 40))
    tokens.extend(range(41, 64))
    snapshot = list(range(64))
    got = _native.chain_keys(root_key(NID), tokens, 16)
    assert got == chain_python(root_key(NID), tokens_to_u32le(snapshot), 16, None)
    assert tokens == []


def test_threads_get_identical_keys():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128000, size=16 * 200).tolist() for _ in range(4)]
    want = [chain_python(root_key(NID), tokens_to_u32le(p), 16, None) for p in prompts]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                assert list(block_keys(NID, prompts[i], 16)) == want[i]
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


_KEY_LISTS = st.lists(
    st.one_of(
        st.binary(min_size=32, max_size=32),
        st.binary(min_size=0, max_size=40),
        st.builds(bytearray, st.binary(min_size=32, max_size=32)),
        st.integers(),
        st.none(),
    ),
    max_size=12,
)


@given(_KEY_LISTS, st.booleans())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_all_keys_and_join_keys_match_python(items, as_tuple):
    seq = tuple(items) if as_tuple else items
    expect = all(type(k) is bytes and len(k) == 32 for k in seq)
    assert _native.all_keys(seq) is expect
    assert _native.join_keys(seq) == (b"".join(seq) if expect else None)
    # the pure-Python fallback agrees
    saved = keys._native
    keys._native = None
    try:
        assert keys.all_keys(seq) is expect
        assert keys.join_keys(seq) == (b"".join(seq) if expect else None)
    finally:
        keys._native = saved


def test_all_keys_accepts_keychains_and_rejects_other_containers():
    chain = keys.block_keys(os.urandom(32), list(range(64)), 16)
    assert _native.all_keys(chain) and keys.all_keys(chain)
    assert _native.join_keys(chain) == b"".join(chain)
    assert _native.all_keys([]) and _native.join_keys([]) == b""
    for other in (b"k" * 32, "s", iter(chain), set(chain), None):
        assert not _native.all_keys(other) and _native.join_keys(other) is None
