"""Starting kvstore in a child process (the daemon launcher, ``kvstore demo``'s restarted
run, the benchmarks' echo server): the child runs the kvstore this process runs, never a
source checkout that happens to be in the working directory.

``python -m kvstore.cli`` puts the working directory first on ``sys.path``: run from a
directory holding another checkout's ``kvstore/``, the child imports that one. So the child is
started with ``-P`` (no such entry) and, when this process's kvstore is not in site-packages
(an editable install, a ``PYTHONPATH`` checkout), with its root pinned first on
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import site
import sys
from pathlib import Path


def package_root() -> Path:
    """The directory holding the ``kvstore`` package this process imported."""
    import kvstore

    return Path(kvstore.__file__).resolve().parent.parent


def _site_dirs() -> set[Path]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return {Path(d).resolve() for d in dirs if d}


def python_argv(module: str, *args: str) -> list[str]:
    """``[python, -P, -m, module, *args]``: run ``module`` of this kvstore (with :func:`env`)."""
    return [sys.executable, "-P", "-m", module, *args]


def kvstore_argv(*args: str) -> list[str]:
    """The ``kvstore`` command line ``args`` as a child process (with :func:`env`)."""
    return python_argv("kvstore.cli", *args)


def env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for :func:`python_argv` children: ``base`` (default ``os.environ``)
    with this kvstore's root first on ``PYTHONPATH`` unless it is in site-packages."""
    out = dict(os.environ if base is None else base)
    root = package_root()
    if root in _site_dirs():
        return out
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != root]
    out["PYTHONPATH"] = os.pathsep.join([str(root), *rest])
    return out
