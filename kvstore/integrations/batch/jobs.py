"""Batch job files: the JSONL input, the resumable partial results, the ordered output.

- :func:`read_requests`: every non-blank input line becomes a :class:`BatchRequest` or a
  :class:`LineError` (bad JSON, unknown field, empty prompt, a prompt too long for the model,
  a repeated ``custom_id``), in input order;
- :class:`PartialResults`: ``OUT.partial``, one line per finished request, appended and
  flushed as each finishes, with a digest of the request (and the model/engine) it answers: a
  job killed half way and run again keeps those whose request did not change;
- :func:`write_output`: ``OUT`` in input order (one line per input line: the result, or the
  error that kept the line from running), written to a temporary file and renamed;
- :class:`OutputLock`: ``OUT.lock``, held while a job writes ``OUT``: a second job on the
  same ``OUT`` is refused (:class:`JobLockedError`) instead of rewriting the first's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvstore.errors import KVStoreError
from kvstore.integrations.batch.requests import (
    BatchRequest,
    Completion,
    LineError,
    parse_request,
    request_digest,
)

__all__ = ["JobInput", "JobLockedError", "JobWriteError", "OutputLock", "PartialResults",
           "partial_path", "read_requests", "write_output"]

Entry = BatchRequest | LineError


class JobLockedError(KVStoreError, RuntimeError):
    """Another job is writing the same ``OUT``."""


class JobWriteError(KVStoreError, OSError):
    """``OUT`` or ``OUT.partial`` could not be written (a full disk, say); the message says
    which answers are kept and how to go on."""

    def __init__(self, message: str, cause: OSError) -> None:
        super().__init__(message)
        self.errno = cause.errno


def _why(e: OSError) -> str:
    return e.strerror or str(e)


@dataclass(frozen=True, slots=True)
class JobInput:
    """The input file, line by line (blank lines left out)."""

    entries: tuple[Entry, ...]

    @property
    def requests(self) -> tuple[BatchRequest, ...]:
        return tuple(e for e in self.entries if isinstance(e, BatchRequest))

    @property
    def errors(self) -> tuple[LineError, ...]:
        return tuple(e for e in self.entries if isinstance(e, LineError))


def read_requests(path: str | os.PathLike[str], *,
                  tokenize: Callable[[str], Sequence[int]] | None = None,
                  vocab: int | None = None, context: int | None = None) -> JobInput:
    """Parse every line of ``path`` (see :func:`~.requests.parse_request`)."""
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    # surrogateescape, then a check: a byte that is not UTF-8 is the line's error, not a
    # U+FFFD silently put into its prompt or custom_id
    # utf-8-sig: a byte-order mark some editors write first is not part of line 1
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for no, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as u:
                entries.append(LineError(no, None, f"not UTF-8 text (a byte that is not UTF-8 "
                                                   f"at character {u.start + 1}): re-encode "
                                                   "the file as UTF-8"))
                continue
            e = parse_request(text, no, tokenize=tokenize, vocab=vocab, context=context)
            # every line naming an id claims it, a bad one too: before, "a" on a bad line and
            # "a" on a good one gave OUT an error and an answer both for "a"
            first = seen.setdefault(e.custom_id, no) if e.custom_id is not None else no
            if first != no and isinstance(e, BatchRequest):
                e = LineError(no, e.custom_id, f"custom_id {e.custom_id!r} is already used "
                                                f"on line {first}: custom_ids must be unique")
            entries.append(e)
    return JobInput(tuple(entries))


def completion_record(c: Completion) -> dict[str, Any]:
    """The output line of a completed request."""
    rec: dict[str, Any] = {"custom_id": c.custom_id, "token_ids": list(c.token_ids)}
    if c.text is not None:
        rec["text"] = c.text
    rec.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason,
               prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
               completion_tokens=len(c.token_ids))
    return rec


def error_record(e: LineError) -> dict[str, Any]:
    """The output line of a request that could not run."""
    return {"custom_id": e.custom_id, "line": e.line,
            "error": {"code": "invalid_request", "message": e.message}}


def _completion(rec: Mapping[str, Any]) -> Completion:
    stop = rec.get("stop_reason")
    return Completion(
        custom_id=str(rec["custom_id"]), token_ids=tuple(int(t) for t in rec["token_ids"]),
        finish_reason=str(rec["finish_reason"]), prompt_tokens=int(rec["prompt_tokens"]),
        cached_tokens=int(rec["cached_tokens"]),
        text=rec["text"] if isinstance(rec.get("text"), str) else None,
        stop_reason=stop if isinstance(stop, (str, int)) else None)


def _check(rec: Mapping[str, Any]) -> str:
    """A digest of a partial line's record, so that a line altered on disk is not kept."""
    return hashlib.sha256(json.dumps(rec).encode()).hexdigest()[:16]


def partial_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}.partial")


class PartialResults:
    """``OUT.partial``: finished requests of a job, kept across an interruption."""

    def __init__(self, output: str | os.PathLike[str], job: str) -> None:
        self.path = partial_path(output)
        self.job = job
        self._f: IO[str] | None = None
        self.written = 0  # answers in the file (kept ones included) since start()

    def load(self, requests: Iterable[BatchRequest]) -> dict[str, Completion]:
        """Results already in the file for these ``requests`` (same request, same job); a
        line torn by the interruption, or for a request that changed, is left out."""
        want = {r.custom_id: request_digest(r, self.job) for r in requests}
        got: dict[str, Completion] = {}
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return got
        for text in lines:
            try:
                rec = json.loads(text)
                check = rec.pop("check", None)
                if check != _check(rec):
                    continue  # altered on disk (a flipped digit is still JSON): runs again
                if want.get(rec.get("custom_id")) == rec.get("request_digest"):
                    got[rec["custom_id"]] = _completion(rec)
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue  # torn or foreign line: that request runs again
        return got

    def start(self, keep: Mapping[str, Completion], requests: Sequence[BatchRequest]) -> None:
        """Rewrite the file with ``keep`` only, then append to it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        by_id = {r.custom_id: r for r in requests}
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for cid, c in keep.items():
                    f.write(self._line(by_id[cid], c))
            os.replace(tmp, self.path)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise JobWriteError(f"cannot write {self.path} ({_why(e)}), where the job keeps "
                                "its finished answers: nothing ran; free space (or make the "
                                "directory writable) and run again", e) from e
        self.written = len(keep)

    def _line(self, r: BatchRequest, c: Completion) -> str:
        rec = completion_record(c) | {"request_digest": request_digest(r, self.job)}
        return json.dumps(rec | {"check": _check(rec)}) + "\n"

    def add(self, r: BatchRequest, c: Completion) -> None:
        assert self._f is not None, "start() first"
        try:
            self._f.write(self._line(r, c))
            self._f.flush()  # what a kill leaves behind is what the next run keeps
        except OSError as e:
            # before: the OS's bare "No space left on device", no file named, nothing said
            # of the answers already written
            f, self._f = self._f, None
            with contextlib.suppress(OSError):
                f.close()  # a torn last line is left out by the next run's load()
            raise JobWriteError(f"cannot write {self.path} ({_why(e)}): the {self.written} "
                                "answers written to it before are kept; free space and run "
                                "the same command again to compute the rest", e) from e
        self.written += 1

    def close(self, *, remove: bool) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if remove:
            self.path.unlink(missing_ok=True)


def write_output(path: str | os.PathLike[str], entries: Sequence[Entry],
                 results: Mapping[str, Completion]) -> int:
    """``path`` in input order; returns the lines written. A request without a result (the
    job failed part way) gets none: its line is missing, as the summary says."""
    tmp = Path(f"{os.fspath(path)}.tmp")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for e in entries:
                if isinstance(e, LineError):
                    rec = error_record(e)
                elif e.custom_id in results:
                    rec = completion_record(results[e.custom_id])
                else:
                    continue
                f.write(json.dumps(rec) + "\n")
                n += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the results stay in OUT.partial for the next run
        raise
    return n


def lock_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output)}.lock")


class OutputLock:
    """``OUT.lock``, held (``flock``) while a job writes ``OUT`` and ``OUT.partial``, removed
    when it ends; the kernel drops the lock of a killed job. Before, a second job on the same
    ``OUT`` rewrote ``OUT.partial`` under the first (whose later answers went to a file no
    longer there) and both wrote ``OUT.tmp``."""

    def __init__(self, output: str | os.PathLike[str]) -> None:
        self.output = output
        self.path = lock_path(output)
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                pid = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                who = f" (pid {pid})" if pid.isdigit() else ""
                raise JobLockedError(
                    f"OUT {os.fspath(self.output)} is being written by another kvstore batch "
                    f"run{who}, which holds {self.path}: wait for it to finish, or give "
                    "another OUT") from None
            try:  # still the file at the path? (a job ending unlinks it before unlocking)
                same = os.path.samestat(os.stat(self.path), os.fstat(fd))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(fd)
