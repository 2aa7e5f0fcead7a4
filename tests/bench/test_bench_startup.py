"""Start-up: the admin commands that touch no tensor never import torch (the evidence the
startup bench prints). ``verify`` reads and checks block bytes, so it may."""

import pytest

from kvstore.bench.startup import _make_store, import_evidence


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    p = tmp_path_factory.mktemp("startup") / "store"
    _make_store(str(p), 200)
    return str(p)


@pytest.mark.parametrize("args", [["--help"], ["ls"], ["inspect"], ["stats"],
                                  ["ls", "--format", "json"], ["prune", "--dry-run"],
                                  ["rm", "--dry-run", "bench/startup"]])
def test_admin_commands_do_not_import_torch(store, tmp_path, args):
    argv = [*args, "--store", store] if args != ["--help"] else args
    torch_loaded, top = import_evidence(argv, str(tmp_path))
    assert top, "no import timings parsed: the evidence would be empty"
    assert not torch_loaded, f"kvstore {' '.join(args)} imported torch; heaviest: {top}"
