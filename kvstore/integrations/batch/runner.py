"""A batch job end to end: read the requests, keep what an interrupted run finished, run the
rest on an engine, write the results in input order, and sum it up."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.integrations.batch.engines import Engine, EngineReport
from kvstore.integrations.batch.jobs import (
    JobInput,
    JobWriteError,
    OutputLock,
    PartialResults,
    partial_path,
    write_output,
)
from kvstore.integrations.batch.memory import peak_rss
from kvstore.integrations.batch.requests import BatchRequest, Completion, LineError
from kvstore.integrations.batch.tree import unique_tokens

__all__ = ["JobSummary", "run_job"]

ON_ERROR = ("skip", "fail")


@dataclass(frozen=True, slots=True)
class JobSummary:
    """What a job did. Token counts are those of the requests run this time."""

    engine: str
    lines: int  # non-blank input lines
    requests: int  # valid requests
    errors: tuple[LineError, ...]
    resumed: int  # results kept from an interrupted run
    completed: int  # results written (resumed included)
    ran: bool  # False: --on-error fail found bad lines, nothing ran
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the model computed
    naive_tokens: int  # every prompt computed in full
    lower_bound_tokens: int  # unique tokens of the prefix tree
    stored_tokens: int  # loaded from a kvstore store instead
    generated_tokens: int
    forwards: int
    seconds: float  # the engine's wall time
    token_source: str
    peak_rss_bytes: int = 0  # this process's peak resident set size at the end of the job
    threads: tuple[int, int] = (0, 0)  # fewest and most CPU threads a forward ran on (0: not known)

    @property
    def tokens_per_s(self) -> float:
        """Prompt + generated tokens per second of engine wall time."""
        return (self.prompt_tokens + self.generated_tokens) / self.seconds if self.seconds else 0.0

    @property
    def generated_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def run_job(job: JobInput, output: str | os.PathLike[str], engine: Engine, *,
            job_key: str = "", on_error: str = "skip", resume: bool = True,
            progress: Callable[[int, int], object] | None = None) -> JobSummary:
    """Run ``job``'s requests on ``engine`` and write ``output``.

    ``on_error="skip"`` runs the good lines and writes an error line for each bad one;
    ``"fail"`` runs nothing when any line is bad. ``resume``: results of an interrupted run
    (``OUT.partial``, same request and ``job_key``) are kept, not recomputed.
    ``progress(done, total)`` after each request.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if job.errors and on_error == "fail":
        return _summary(engine, job, 0, 0, None, ran=False, pending=())
    lock = OutputLock(output)  # a second job on this OUT is refused, not interleaved
    lock.acquire()
    try:
        return _run(job, output, engine, job_key, resume, progress)
    finally:
        lock.release()


def _run(job: JobInput, output: str | os.PathLike[str], engine: Engine, job_key: str,
         resume: bool, progress: Callable[[int, int], object] | None) -> JobSummary:
    requests = job.requests
    partial = PartialResults(output, job_key)
    done = partial.load(requests) if resume else {}
    pending = [r for r in requests if r.custom_id not in done]
    partial.start(done, requests)
    results: dict[str, Completion] = dict(done)
    total = len(requests)
    if progress is not None:
        progress(len(results), total)

    def finished(i: int, c: Completion) -> None:
        results[c.custom_id] = c
        partial.add(pending[i], c)
        if progress is not None:
            progress(len(results), total)

    try:
        report = engine.run(pending, on_done=finished) if pending else None
    finally:
        partial.close(remove=False)
    missing = [r.custom_id for r in pending if r.custom_id not in results]
    if missing:
        raise RuntimeError(f"the {engine.name} engine returned no result for {len(missing)} "
                           f"request(s), e.g. {missing[0]!r}")
    try:
        write_output(output, job.entries, results)
    except OSError as e:
        old = " (the old one is unchanged)" if os.path.exists(output) else ""
        raise JobWriteError(
            f"cannot write OUT {os.fspath(output)}{old} ({e.strerror or e}): all "
            f"{len(results)} answers are kept in {partial_path(output)}; free space and run "
            "the same command again, which writes OUT from them (nothing is recomputed)",
            e) from e
    partial.close(remove=True)
    return _summary(engine, job, len(done), len(results), report, ran=True, pending=pending)


def _summary(engine: Engine, job: JobInput, resumed: int, completed: int,
             report: EngineReport | None, *, ran: bool,
             pending: Sequence[BatchRequest]) -> JobSummary:
    prompts = [r.token_ids for r in pending]
    return JobSummary(
        engine=engine.name, lines=len(job.entries), requests=len(job.requests), errors=job.errors,
        resumed=resumed, completed=completed, ran=ran,
        prompt_tokens=sum(len(p) for p in prompts),
        computed_tokens=report.computed_tokens if report else 0,
        naive_tokens=sum(len(p) for p in prompts),
        lower_bound_tokens=unique_tokens(prompts) if prompts else 0,
        stored_tokens=report.stored_tokens if report else 0,
        generated_tokens=report.generated_tokens if report else 0,
        forwards=report.forwards if report else 0,
        seconds=report.seconds if report else 0.0,
        token_source=report.token_source if report else "",
        peak_rss_bytes=peak_rss(),
        threads=report.threads if report else (0, 0),
    )

