"""``kvstore serve`` subprocesses for the tests: ``DaemonProcess`` lives in the package, beside
the daemon it starts (:mod:`kvstore.daemon.process`; the ``daemon`` benchmark uses it too), and
is re-exported here."""

from __future__ import annotations

from kvstore.daemon.process import DaemonProcess

__all__ = ["DaemonProcess"]
