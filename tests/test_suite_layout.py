"""The suite's own layout: rules whose breakage shows only in some orders of collection."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_there_is_one_conftest_so_from_conftest_import_finds_it():
    # tests/ has no __init__.py, so every conftest.py is imported as the module ``conftest``:
    # a second one replaced the first in sys.modules, and a test's ``from conftest import
    # REPO`` failed in CI's whole-suite run (ImportError from tests/vllm/conftest.py)
    found = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("conftest.py"))
    assert found == ["conftest.py"], found
