"""Batched prefix sharing (kept for ``from kvstore.batch import ...``): the package is
:mod:`kvstore.integrations.batch`, where the plan, the engines and batch jobs live."""

from __future__ import annotations

from kvstore.integrations.batch import (
    BatchPlan,
    BatchRunner,
    BatchRunResult,
    PlanStep,
    SharedPrefix,
    plan_batch,
    simulate,
)

__all__ = [
    "BatchPlan",
    "BatchRunResult",
    "BatchRunner",
    "PlanStep",
    "SharedPrefix",
    "plan_batch",
    "simulate",
]
