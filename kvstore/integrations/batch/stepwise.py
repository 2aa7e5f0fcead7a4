"""Run a :class:`~kvstore.integrations.batch.plan.BatchPlan` one prompt at a time through the
transformers bridge, pinning each shared prefix in the store while its group runs.

This is the store-centred runner: every prompt goes through
:class:`~kvstore.integrations.transformers.PrefixCachedModel` (longest cached prefix loaded,
the rest computed, new blocks put), so the plan's simulation of the store can be checked
against the real store. For throughput, the token-batched engines
(:mod:`kvstore.integrations.batch.engines`) run many prompts per forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the runner's model comes from the optional transformers bridge
    from kvstore.integrations.batch.plan import BatchPlan
    from kvstore.integrations.transformers import PrefixCachedModel

__all__ = ["BatchRunResult", "BatchRunner"]


@dataclass(frozen=True, eq=False)
class BatchRunResult:
    """What :meth:`BatchRunner.run` did; ``outputs[i]`` belongs to prompt ``i`` of the batch."""

    order: tuple[int, ...]
    outputs: tuple[Any, ...]  # PrefillResult or GenerationResult per prompt (batch order)
    prompt_tokens: int
    computed_tokens: int  # tokens the model actually computed
    reused_tokens: int
    seconds: float

    @property
    def next_tokens(self) -> tuple[int, ...]:
        return tuple(getattr(o, "prefill", o).next_token for o in self.outputs)


class BatchRunner:
    """Execute a :class:`BatchPlan` through a :class:`PrefixCachedModel`.

    Each step prefills (or, with ``max_new_tokens``, greedily generates) one prompt, waits for
    its new blocks to be stored, then pins the prefixes of the groups the step opened and
    releases the groups it closed. Plan with the same ``max_new_tokens`` for the plan's
    simulation to count the prompt + answer blocks a generation puts.
    """

    def __init__(self, model: PrefixCachedModel) -> None:
        self.model = model
        self.store = model.store

    def run(
        self,
        plan: BatchPlan,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 0,
        order: str = "planned",
        salt: str | bytes | None = None,
        progress: Callable[[], object] | None = None,
    ) -> BatchRunResult:
        """Run ``prompts`` in the plan's order (``order="arrival"``: batch order, no pins;
        ``"naive"``: batch order without the cache). ``salt`` defaults to the model's; pins
        use the same salt as the prefills, so they pin the blocks just put."""
        steps = self._steps(plan, prompts, order)
        salt = self.model.salt if salt is None else salt
        use_cache = order != "naive"
        receipts: dict[int, Any] = {}
        outputs: list[Any] = [None] * plan.num_prompts
        computed = reused = 0
        t0 = time.perf_counter()
        try:
            for i, pin_now, release_now in steps:
                p = prompts[i]
                answer = None
                if max_new_tokens:
                    out = self.model.generate(p, max_new_tokens, salt=salt, use_cache=use_cache)
                    pre, answer = out.prefill, out.put
                else:
                    out = pre = self.model.prefill(p, salt=salt, use_cache=use_cache)
                for put in (pre.put, answer):  # stored before the next step looks up
                    if put is not None:
                        put.wait()
                outputs[i] = out
                computed += pre.computed_tokens
                reused += pre.cached_tokens
                if pin_now or release_now:
                    self._pins(plan, p, salt, pin_now, release_now, receipts)
                if progress is not None:
                    progress()
        finally:
            for r in receipts.values():
                r.release()
        return BatchRunResult(
            order=tuple(i for i, _, _ in steps), outputs=tuple(outputs),
            prompt_tokens=sum(len(p) for p in prompts), computed_tokens=computed,
            reused_tokens=reused, seconds=time.perf_counter() - t0,
        )

    def _steps(self, plan: BatchPlan, prompts: Sequence[Sequence[int]], order: str
               ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        if len(prompts) != plan.num_prompts:
            raise ValueError(f"the plan is for {plan.num_prompts} prompts, got {len(prompts)}")
        if plan.block_tokens != self.store.layout.block_tokens:
            raise ValueError("the plan was made for another block size than the store's")
        if order not in ("planned", "arrival", "naive"):
            raise ValueError(f"order must be 'planned', 'arrival' or 'naive', got {order!r}")
        if order == "planned":
            return [(s.prompt, s.pin_after, s.release_after) for s in plan.steps]
        return [(i, (), ()) for i in range(plan.num_prompts)]

    def _pins(self, plan: BatchPlan, prompt: Sequence[int], salt: str | bytes | None,
              pin_now: Sequence[int], release_now: Sequence[int], receipts: dict[int, Any]) -> None:
        keys = self.store.block_keys(prompt, salt)
        for g in pin_now:
            receipts[g] = self.store.pin(keys[: plan.groups[g].blocks])
        for g in release_now:
            r = receipts.pop(g, None)
            if r is not None:
                r.release()
