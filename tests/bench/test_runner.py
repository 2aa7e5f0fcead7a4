"""kvstore bench's runner: a section whose optional dependency is missing is skipped, one
whose own kvstore import is broken fails loudly; every section's module imports."""

import importlib
import io

import pytest

from kvstore.bench import BenchOptions, runner


@pytest.mark.parametrize("name", sorted(runner.SECTIONS))
def test_every_sections_module_imports_or_names_a_missing_optional_dependency(name):
    try:
        importlib.import_module(runner.SECTIONS[name].module)
    except ImportError as e:  # vllm, transformers, lmcache: optional, and not kvstore
        assert (e.name or "").split(".")[0] != "kvstore", e


def _section(monkeypatch, error):
    def boom(name, opts):
        raise error

    monkeypatch.setattr(runner, "_run_one", boom)
    return runner.run_sections(["promotion"], BenchOptions(quick=True), log=io.StringIO())


def test_a_missing_optional_dependency_skips_the_section(monkeypatch):
    got = _section(monkeypatch, ModuleNotFoundError("No module named 'vllm'", name="vllm"))
    assert got.skipped and not got.failed


def test_a_broken_kvstore_import_fails_the_section_not_skips_it(monkeypatch):
    # regression: promotion imported names kvstore.bench.disk no longer had, and every run
    # printed it as "skipped, not available" for months
    got = _section(monkeypatch, ImportError("cannot import name '_drop_cache'",
                                            name="kvstore.bench.disk"))
    assert not got.skipped and [f.section for f in got.failed] == ["promotion"]


def test_promotion_runs(tmp_path):
    from kvstore.bench import promotion

    rows = promotion.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    assert [r.unit for r in rows] == ["GB/s", "GB/s"]
    assert all(r.value > 0 and r.ref_value > 0 for r in rows)
