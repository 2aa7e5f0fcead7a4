"""A batch plan on an offline ``vllm.LLM`` (with prefix caching and, optionally, the kvstore
connector).

vLLM's automatic prefix caching only shares blocks that are already computed when a request
is scheduled: requests of one step that share a prefix each compute it. :class:`VLLMEngine`
therefore submits each shared prefix of the plan first, depth by depth (a system prompt,
then the documents under it), cut to whole vLLM blocks, with ``max_tokens=1``: each is
computed once and cached (and, with the kvstore connector, saved to the store for later jobs
and engines). Then every request goes in, in plan order, in one ``generate`` call, and finds
its prefix cached. Token counts are vLLM's own counters (``vllm:prompt_tokens_by_source``).

Without a tokenizer (``skip_tokenizer_init``) vLLM knows no end-of-sequence token; the engine
passes the model's ``generation_config.eos_token_id`` as stop tokens, so both engines stop
where ``model.generate`` stops.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.integrations.batch.engines import EngineReport, OnDone
from kvstore.integrations.batch.engines.schedule import schedule
from kvstore.integrations.batch.plan import BatchPlan, plan_batch
from kvstore.integrations.batch.requests import BatchRequest, Completion

__all__ = ["VLLMEngine", "vllm_counters"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def vllm_counters(llm: Any) -> dict[tuple[str, str], float]:
    """vLLM's counters as ``{(name, source label): value}`` (source "" when unlabelled)."""
    out: dict[tuple[str, str], float] = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if type(m).__name__ == "Counter" and isinstance(v, (int, float)):
            key = (m.name, str((getattr(m, "labels", None) or {}).get("source", "")))
            out[key] = out.get(key, 0) + v
    return out


def _eos_from_config(model_dir: str) -> tuple[int, ...]:
    import json

    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            if v is not None:
                return (v,) if isinstance(v, int) else tuple(int(t) for t in v)
    return ()


class VLLMEngine:
    """Runs :class:`BatchRequest` s on ``llm`` (a ``vllm.LLM`` with prefix caching on).

    ``block_size``: vLLM's KV block size (prefixes are primed in whole blocks); ``salt``:
    the ``cache_salt`` of every request; ``eos``: stop tokens added when vLLM has no
    tokenizer (see the module docstring).
    """

    name = "vllm"

    def __init__(self, llm: Any, *, block_size: int, salt: str | None = None,
                 detokenize: bool = True, eos: Sequence[int] = ()) -> None:
        self.llm, self.block_size, self.salt = llm, block_size, salt
        self.detokenize, self.eos = detokenize, tuple(eos)

    #: vLLM's KV block size :meth:`open` asks for by default
    BLOCK_SIZE = 32

    @classmethod
    def open(cls, model_dir: str, *, store_path: str | None = None, salt: str | None = None,
             dtype: str = "auto", max_batch_tokens: int = 8192, block_size: int = BLOCK_SIZE,
             cpu_capacity: int | str | None = None, **llm_kwargs: Any) -> VLLMEngine:
        """An offline ``vllm.LLM`` on ``model_dir`` (the kvstore connector on ``store_path``,
        its warm tier ``cpu_capacity``: default the connector's)."""
        try:
            from vllm import LLM
            from vllm.config import KVTransferConfig
        except ImportError as e:
            from kvstore.errors import ConfigError

            raise ConfigError(f"the vllm engine needs vLLM, which does not import here ({e}); "
                              "run with the python of a vLLM environment (pip install vllm)") from e
        has_tok = any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES)
        kw: dict[str, Any] = dict(model=model_dir, dtype=dtype, enable_prefix_caching=True,
                                  block_size=block_size, skip_tokenizer_init=not has_tok,
                                  max_num_batched_tokens=max_batch_tokens,
                                  disable_log_stats=False, enforce_eager=True)
        if store_path:
            from kvstore.integrations.vllm import kvstore_transfer

            extra: dict[str, Any] = {"store_path": store_path}
            if cpu_capacity is not None:
                extra["cpu_capacity"] = cpu_capacity
            kw["kv_transfer_config"] = KVTransferConfig(**kvstore_transfer(extra))
        kw.update(llm_kwargs)
        eos = () if has_tok else _eos_from_config(model_dir)
        return cls(LLM(**kw), block_size=block_size, salt=salt, detokenize=has_tok, eos=eos)

    def close(self) -> None:
        """Drop the engine (and flush the connector's stores)."""
        self.llm = None
        try:
            from kvstore.integrations.vllm.store_registry import close_all
        except ImportError:  # pragma: no cover - the connector is part of kvstore
            return
        close_all()

    def plan(self, requests: Sequence[BatchRequest]) -> BatchPlan:
        return plan_batch([r.token_ids for r in requests], block_tokens=self.block_size,
                          budget_blocks=None)

    def _prompt(self, ids: Sequence[int]) -> Any:
        from vllm.inputs import TokensPrompt

        p = TokensPrompt(prompt_token_ids=list(ids))
        if self.salt is not None:
            p["cache_salt"] = self.salt
        return p

    def _params(self, r: BatchRequest) -> Any:
        from vllm import SamplingParams

        p = r.params
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos))
        return SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1, seed=p.seed, stop=list(p.stop) or None,
            stop_token_ids=stop_ids or None, ignore_eos=p.ignore_eos, detokenize=self.detokenize)

    def prime_waves(self, requests: Sequence[BatchRequest], plan: BatchPlan) -> list[list[tuple[int, ...]]]:
        """The shared prefixes to compute first, whole blocks only, by depth (parents first)."""
        lengths = [len(r.token_ids) for r in requests]
        sched = schedule(plan, lengths)
        depth: list[int] = []
        waves: list[list[tuple[int, ...]]] = []
        for n in sched.nodes:
            d = depth[n.parent] + 1 if n.parent >= 0 else 0
            depth.append(d)
            cut = n.prefix_len // self.block_size * self.block_size
            if cut:
                while len(waves) <= d:
                    waves.append([])
                waves[d].append(tuple(requests[n.source].token_ids[:cut]))
        return [sorted(set(w)) for w in waves if w]

    def run(self, requests: Sequence[BatchRequest], *, on_done: OnDone | None = None,
            plan: BatchPlan | None = None) -> EngineReport:
        """Prime the plan's prefixes, then run ``requests`` in plan order."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        if not requests:
            return EngineReport(0, 0, 0, 0, 0, 0, 0.0, "vllm metrics")
        plan = plan or self.plan(requests)
        before = vllm_counters(self.llm)
        prime = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        for wave in self.prime_waves(requests, plan):
            self.llm.generate([self._prompt(p) for p in wave], prime, use_tqdm=False)
        order = list(plan.order)
        outs = self.llm.generate([self._prompt(requests[i].token_ids) for i in order],
                                 [self._params(requests[i]) for i in order], use_tqdm=False)
        generated = 0
        for i, o in zip(order, outs, strict=True):
            c = self._completion(requests[i], o)
            generated += len(c.token_ids)
            if on_done is not None:
                on_done(i, c)
        after = vllm_counters(self.llm)

        def delta(name: str, source: str = "") -> int:
            return int(after.get((name, source), 0) - before.get((name, source), 0))

        return EngineReport(
            requests=len(requests), prompt_tokens=sum(len(r.token_ids) for r in requests),
            computed_tokens=delta("vllm:prompt_tokens_by_source", "local_compute"),
            stored_tokens=delta("vllm:prompt_tokens_by_source", "external_kv_transfer"),
            generated_tokens=generated, forwards=0, seconds=time.perf_counter() - t0,
            token_source="vllm metrics")

    def _completion(self, r: BatchRequest, o: Any) -> Completion:
        c = o.outputs[0]
        stop = c.stop_reason
        if isinstance(stop, int) and stop in self.eos and stop not in r.params.stop_token_ids:
            stop = None  # an end-of-sequence token, as the transformers engine reports it
        return Completion(
            custom_id=r.custom_id, token_ids=tuple(c.token_ids), finish_reason=str(c.finish_reason),
            prompt_tokens=len(r.token_ids), cached_tokens=int(o.num_cached_tokens or 0),
            text=c.text if self.detokenize else None,
            stop_reason=stop if isinstance(stop, (str, int)) else None)
