"""Engines that execute a batch of requests on a model, sharing each common prefix.

- :mod:`.transformers`: :class:`~.transformers.TransformersEngine`, token batching on a
  transformers model: each shared prefix computed once (or loaded from a kvstore store), the
  group's suffixes in one batched forward against it, then decoded together;
- :mod:`.vllm`: :class:`~.vllm.VLLMEngine`, an offline ``vllm.LLM`` (with the kvstore
  connector) fed the plan: each shared prefix first, then the requests in plan order.

Both satisfy :class:`Engine`. Importing this package imports neither framework.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.integrations.batch.requests import BatchRequest, Completion

__all__ = ["ENGINES", "Engine", "EngineReport", "OnDone"]

#: engine names the CLI knows, and the module of each
ENGINES = {
    "transformers": "kvstore.integrations.batch.engines.transformers",
    "vllm": "kvstore.integrations.batch.engines.vllm",
}

#: called once per finished request, with its index in the ``requests`` passed to ``run``
OnDone = Callable[[int, Completion], None]


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What one :meth:`Engine.run` computed."""

    requests: int
    prompt_tokens: int  # sum of the prompts' lengths
    computed_tokens: int  # prompt tokens the model ran a forward over
    stored_tokens: int  # prompt tokens loaded from a kvstore store (or a connector) instead
    generated_tokens: int
    forwards: int  # model forward passes (engine steps, for vLLM)
    seconds: float
    token_source: str  # where computed_tokens comes from ("engine", "vllm metrics")
    threads: tuple[int, int] = (0, 0)  # fewest and most CPU threads a forward ran on (0: not known)


class Engine(Protocol):
    """Runs requests; calls ``on_done`` as each finishes (in any order)."""

    name: str

    def run(self, requests: Sequence[BatchRequest], *, on_done: OnDone | None = None
            ) -> EngineReport: ...
