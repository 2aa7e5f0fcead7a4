"""Bridges between kvstore and inference frameworks.

Each bridge lives in its own module and imports its framework only when that module is
imported: ``import kvstore`` (and ``import kvstore.integrations``) never imports
``transformers``. Install the extra with ``pip install kvstore[hf]`` and use::

    from kvstore.integrations.transformers import PrefixCachedModel, layout_for
"""

from __future__ import annotations

import importlib.util

__all__ = ["transformers_available"]


def transformers_available() -> bool:
    """Whether ``transformers`` can be imported here (without importing it)."""
    return importlib.util.find_spec("transformers") is not None
