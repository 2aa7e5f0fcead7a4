"""The project's layout rule: no module of the package is over 600 lines (a longer one is split
into modules with one job each; docs/architecture.md, "Package layout")."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvstore"
MAX_LINES = 600


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def test_no_module_is_over_600_lines():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules, f"no module found under {PACKAGE}"
    over = [f"{p.relative_to(PACKAGE.parent)}: {n} lines"
            for p in modules if (n := _lines(p)) > MAX_LINES]
    assert not over, (f"modules over {MAX_LINES} lines (split each into modules with one job):\n"
                      + "\n".join(over))
