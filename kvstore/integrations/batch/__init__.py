"""Batched prefix sharing: plan a batch so each shared prefix is computed once, and run it.

- :mod:`.tree`, :mod:`.simulate`, :mod:`.plan`: the prefix tree, the store simulation and
  :func:`plan_batch` (a frozen :class:`BatchPlan`);
- :mod:`.engines`: token-batched execution (:class:`~.engines.transformers.TransformersEngine`,
  :class:`~.engines.vllm.VLLMEngine`);
- :mod:`.stepwise`: :class:`BatchRunner`, one prompt at a time through the transformers bridge
  with the store's pins (the plan's simulation checked against a real store);
- :mod:`.requests`, :mod:`.jobs`, :mod:`.runner`: JSONL batch jobs (``kvstore batch run``);
  :mod:`.memory`, a job's store warm tier sized from its shared prefixes, and its peak RSS.

Importing this package imports neither torch-heavy framework: the engines load on first use
(``from kvstore.integrations.batch import TransformersEngine`` imports transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.integrations.batch.plan import BatchPlan, PlanStep, SharedPrefix, plan_batch
from kvstore.integrations.batch.requests import (
    BatchRequest,
    Completion,
    LineError,
    SamplingParams,
    parse_request,
)
from kvstore.integrations.batch.simulate import simulate
from kvstore.integrations.batch.stepwise import BatchRunner, BatchRunResult
from kvstore.integrations.batch.tree import unique_tokens

if TYPE_CHECKING:
    from kvstore.integrations.batch.engines.transformers import TransformersEngine
    from kvstore.integrations.batch.engines.vllm import VLLMEngine

__all__ = [
    "BatchPlan",
    "BatchRequest",
    "BatchRunResult",
    "BatchRunner",
    "Completion",
    "LineError",
    "PlanStep",
    "SamplingParams",
    "SharedPrefix",
    "TransformersEngine",
    "VLLMEngine",
    "parse_request",
    "plan_batch",
    "simulate",
    "unique_tokens",
]

_LAZY = {
    "TransformersEngine": "kvstore.integrations.batch.engines.transformers",
    "VLLMEngine": "kvstore.integrations.batch.engines.vllm",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
