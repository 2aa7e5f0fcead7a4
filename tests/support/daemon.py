"""``kvstore serve`` subprocesses for the tests: ``DaemonProcess`` lives in the package, beside
the daemon benchmark that starts one (:mod:`kvstore.bench.procs`), and is re-exported here."""

from __future__ import annotations

from kvstore.bench.procs import DaemonProcess

__all__ = ["DaemonProcess"]
