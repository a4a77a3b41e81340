"""``batchery.batch_lines``: run a chunk of a batch job's lines, carried by one message, and store their records
exactly once.

The submitter puts up to ``BATCHERY_BATCH__CHUNK_LINES`` lines of one prefix group (or lines that share nothing with
the rest of their window) in one message, so the per-message costs (the broker's pop, acknowledgement and
bookkeeping, the task's dispatch) and the job store's round trips are paid once per chunk, not per line: one
pipelined check of every line, one pipelined claim, one pipelined write. The engine still sees each line as its own
request; the chunk's lines are submitted together, so they share engine steps.

The fast path is for a chunk's first delivery only. Anything unusual sends its lines back to the queue as their own
``batchery.batch_line`` messages (the copies the job's ``pending`` ledger holds, flagged as delivered before), where
the per-line machinery takes over, keyed ``{job}-{line}`` as always: delivery counting and dead letters for a line
that kills its worker process, quarantine for one that makes engine steps fail, retries with backoff. That is

- a chunk delivered again (``redelivered``: its worker died, or the broker restored it) or retried: all its lines
  that have no record yet;
- an engine failure, or an engine this worker cannot serve with (shutting down, rebuilding for good): the lines it
  touched.

A message that is none of ours (a forged line, a task id that does not match, a line the job never queued) is
dead-lettered whole and never touches the job, as for a single line (``batchery.tasks.messages``). A line that is
invalid for the engine, too long, or past its deadline gets its error record like any line; a cancel aborts the
chunk's lines in the engine and releases their leases."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait

from pydantic import ValidationError

from batchery.broker.connection import is_redis_url, redis_from_url, retry_through_outage
from batchery.contract.batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    RESPONSES_URL,
    error_record,
    output_record,
)
from batchery.contract.errors import (
    BatcheryError,
    DeadlineExceeded,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
)
from batchery.contract.generation import GenerationRequest
from batchery.contract.names import CHUNK_JOB_HEADER, CHUNK_LINES_HEADER
from batchery.contract.outcomes import ChunkOutcome, Outcome
from batchery.contract.responses import ResponsesRequest, response_from_chat
from batchery.contract.schemas import ChatCompletionRequest, CompletionRequest, describe_validation_error
from batchery.contract.schemas.embeddings import EmbeddingRequest
from batchery.jobs.recover import push_copies
from batchery.jobs.store import LEASE_GRACE_S
from batchery.tasks import inflight, messages, quarantine, redelivery
from batchery.tasks.batch_line import _refuse, _retrying
from batchery.tasks.chat import _validate, chat_generation, resolve_timeout, shape_chat, shape_completion
from batchery.tasks.embeddings import embedding_generation, shape_embeddings
from batchery.tasks.stores import app_resource, job_store

log = logging.getLogger("batchery.batch")

WAIT_POLL_S = 0.25  # how often a waiting chunk looks at its job (a cancel) and its deadline


def batch_lines(self, job: str, lines: list, timeout: float | None = None, priority: int = 0) -> ChunkOutcome:
    """Run the chunk ``lines`` of batch job ``job`` (see the module docstring)."""
    store, watch = job_store(self.app)
    settings = self.app.batchery_settings
    redis_broker = is_redis_url(settings.broker_url)
    problem = messages.check_chunk(self.request.id, job, lines, timeout, priority)
    if problem is None:
        nums = [entry["line"] for entry in lines]
        problem = _retrying(f"checking lines of {job}", messages.check_chunk_in_job, store, job, nums, redis_broker)
    if problem is not None:
        _refuse(self, problem)
        return ChunkOutcome({Outcome.SKIPPED: len(lines) if isinstance(lines, list) else 1}, "invalid message")
    affinity = getattr(self.app, "batchery_affinity", None)
    if affinity is not None:
        kwargs = dict(job=job, lines=lines, timeout=timeout, priority=priority)
        headers = {CHUNK_JOB_HEADER: job, CHUNK_LINES_HEADER: ",".join(str(n) for n in nums)}
        owner = affinity.route(self.request, self.name, kwargs, priority, headers=headers)
        if owner is not None:
            return ChunkOutcome({Outcome.SKIPPED: len(lines)}, f"forwarded to {owner}, the worker of its prefix group")
    if (self.request.delivery_info or {}).get("redelivered") or self.request.retries:
        n = split(self.app, store, job, nums, priority)
        return ChunkOutcome({Outcome.REQUEUED: n}, f"delivered again: {n} lines queued again one by one")
    slots = app_resource(self.app, "batchery_line_slots", lambda: Slots(settings.num_task_threads))
    with slots.take(len(lines)):  # no more lines started at once than task threads, as when each is a message
        return Chunk(self, store, watch, job, lines, timeout, priority).run()


class Slots:
    """The lines a worker process runs at once, chunks or not: a chunk takes a slot per line before it claims them
    (and waits for them), so a worker that has fetched many chunks starts no more lines than it has task threads.
    A line counts as started from its claim: the completion window, cancels and the job's window see a chunk's
    lines as they would see the same lines sent one by one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self.free = self.capacity
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, n: int):
        n = min(max(1, int(n)), self.capacity)
        with self._cond:
            self._cond.wait_for(lambda: self.free >= n)
            self.free -= n
        try:
            yield
        finally:
            with self._cond:
                self.free += n
                self._cond.notify_all()


class Chunk:
    """One delivery of a chunk on the fast path."""

    def __init__(self, task, store, watch, job: str, lines: list, timeout, priority: int) -> None:
        self.task = task
        self.app = task.app
        self.settings = task.app.batchery_settings
        self.store = store
        self.watch = watch
        self.job = job
        self.lines = lines
        self.timeout = timeout
        self.priority = priority
        self.records: list[tuple[int, dict, Outcome, int, int, int]] = []  # line, record, outcome, tokens x3
        self.back: list[int] = []  # lines that go back to the queue as their own messages
        self.outcomes: dict[Outcome, int] = {}
        self.tokens = (0, 0)  # prompt and completion tokens of the lines that succeeded

    def run(self) -> ChunkOutcome:
        """Run the chunk's lines that no other copy runs in this process (``batchery.tasks.inflight``)."""
        mine = set(inflight.take(self.job, [entry["line"] for entry in self.lines]))
        others = len(self.lines) - len(mine)
        self.lines = [entry for entry in self.lines if entry["line"] in mine]
        self._count(Outcome.SKIPPED, others)
        try:
            return self._run_held()
        finally:
            inflight.release(self.job, sorted(mine))

    def _run_held(self) -> ChunkOutcome:
        try:
            lease = resolve_timeout(self.timeout, self.settings) + self.settings.retry_backoff_max + LEASE_GRACE_S
        except InvalidRequest:
            lease = self.settings.max_task_timeout + LEASE_GRACE_S
        claims = _retrying(f"claiming lines of {self.job}", self._claim, lease)
        runnable = [entry for entry, claim in zip(self.lines, claims) if claim == "run"]
        self._count(Outcome.SKIPPED, len(self.lines) - len(runnable))
        counted = self._begin_deliveries(runnable)  # as a line's own delivery would be: a death counts per line
        runnable = [entry for entry in runnable if entry["line"] not in self.back]
        if runnable:
            self._run(runnable)
        if self.records:
            _retrying(f"storing lines of {self.job}", self._write)
        if counted:
            self._end_deliveries(counted)
        if self.back:
            for n in self.back:
                _retrying(f"releasing line {n} of {self.job}", self.store.release, self.job, n)
            inflight.release(self.job, self.back)  # before their copies are queued: this worker may take them at once
            n = split(self.app, self.store, self.job, self.back, self.priority)
            self._count(Outcome.REQUEUED, n)
        prompt, completion = self.tokens
        detail = ", ".join(f"{n} {o.value}" for o, n in self.outcomes.items() if n)
        return ChunkOutcome(dict(self.outcomes), f"{len(self.lines)} lines: {detail}", prompt, completion)

    def _begin_deliveries(self, runnable: list[dict]) -> list[int]:
        """Count this delivery against each line (``batchery.tasks.redelivery``'s counters, keyed ``{job}-{line}``,
        in one round trip): should the worker process die now, each line's own messages later see it, and a line
        that keeps killing its worker is run alone and dead-lettered on its own. A line whose earlier deliveries
        died (the chunk was duplicated) goes back to run as its own message. Returns the lines counted."""
        if self.settings.max_deliveries <= 0 or not runnable:
            return []
        counters = redelivery.deliveries(self.app)
        try:
            with counters.r.pipeline(transaction=False) as p:
                for entry in runnable:
                    counters.begin_in(p, f"{self.job}-{entry['line']}")
                seen = p.execute()
        except Exception as exc:  # noqa: BLE001 - a Redis hiccup must not fail the lines
            log.warning("deliveries: could not count the deliveries of a chunk of %s (%s)", self.job, exc)
            return []
        for entry, (died, _alone, _first) in zip(runnable, seen):
            if int(died) > 0:
                self.back.append(entry["line"])
        return [entry["line"] for entry in runnable]

    def _end_deliveries(self, lines: list[int]) -> None:
        """Each counted line's delivery ended: its counts go (it showed what it does), or, for a line sent back after
        an engine failure, only this delivery is uncounted."""
        counters = redelivery.deliveries(self.app)
        back = set(self.back)

        def end() -> None:
            with counters.r.pipeline(transaction=False) as p:
                for line in lines:
                    counters.end_in(p, f"{self.job}-{line}", keep=line in back)
                p.execute()

        try:
            retry_through_outage(end, f"uncounting the deliveries of a chunk of {self.job}", logger=log)
        except Exception as exc:  # noqa: BLE001
            log.warning("deliveries: could not uncount the deliveries of a chunk of %s (%s)", self.job, exc)

    def _count(self, outcome: Outcome, n: int = 1) -> None:
        if n:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n

    def _claim(self, lease: float) -> list[str]:
        with self.store.r.pipeline(transaction=False) as p:
            for entry in self.lines:
                self.store.claim_in(p, self.job, entry["line"], lease, entry["custom_id"])
            answers = p.execute()
        return self.store.claims_answered(self.job, answers)

    def _write(self) -> None:
        with self.store.r.pipeline(transaction=False) as p:
            for line, record, outcome, prompt, completion, cached in self.records:
                failed = outcome is not Outcome.SUCCESS
                self.store.write_in(p, self.job, line, record, failed, prompt, completion, cached)
            answers = p.execute()
        if any((a[1].decode() if isinstance(a[1], bytes) else a[1]) == "finalizing" for a in answers):
            self.store.finalize(self.job)

    def _error(self, entry: dict, exc: BaseException, outcome: Outcome, status_code: int) -> None:
        line = entry["line"]
        record = error_record(
            self.job,
            line,
            entry["custom_id"],
            outcome.value,
            str(exc) if isinstance(exc, BatcheryError) else f"{type(exc).__name__}: {exc}",
            status_code=status_code,
            request_id=f"{self.job}-{line}",
        )
        self.records.append((line, record, outcome, 0, 0, 0))
        self._count(outcome)

    def _line_task(self, line: int):
        """What the per-line helpers (quarantine's strikes) read of a task: the line's own id."""
        request = types.SimpleNamespace(id=f"{self.job}-{line}", retries=0, delivery_info={})
        return types.SimpleNamespace(app=self.app, request=request)

    def _run(self, runnable: list[dict]) -> None:
        service = getattr(self.app, "batchery_service", None)
        started = time.time()
        pending: list[tuple[dict, str, object, object]] = []  # entry, engine request id, future, finish
        for entry in runnable:
            try:
                gen, finish = prepare(entry["url"], entry["body"], self.priority)
                if service is None:
                    raise EngineUnavailable("this process has no engine service (not a batchery worker)")
                rid, fut = service.submit(gen)
            except (EngineUnavailable, EngineFailure):
                self.back.append(entry["line"])
                continue
            except BatcheryError as exc:
                self._error(entry, exc, exc.outcome, exc.status_code)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug must still leave a record
                log.exception("batch %s line %d: unexpected error", self.job, entry["line"])
                self._error(entry, exc, Outcome.INTERNAL_ERROR, 500)
                continue
            pending.append((entry, rid, fut, finish))
        if not pending:
            return
        timeout = resolve_timeout(self.timeout, self.settings)
        deadline = time.monotonic() + timeout
        model = self.settings.model
        waiting = {fut: (entry, rid, finish) for entry, rid, fut, finish in pending}
        while waiting:
            left = deadline - time.monotonic()
            stopped = left > 0 and self.watch.stopped(self.job)
            if left <= 0 or stopped:
                for fut, (entry, rid, _finish) in list(waiting.items()):
                    if not service.abort(rid) and fut.done():  # finished in the same instant: its result stands
                        continue
                    del waiting[fut]
                    if stopped:  # cancelled: aborted in the engine, the lease released, no record
                        _retrying(f"releasing line {entry['line']} of {self.job}", self.store.release, self.job,
                                  entry["line"])  # fmt: skip
                        self._count(Outcome.CANCELLED)
                    else:
                        exc = DeadlineExceeded(
                            f"deadline of {timeout:g} s exceeded; the request was aborted in the engine"
                        )
                        self._error(entry, exc, exc.outcome, exc.status_code)
                finished = list(waiting)
            else:
                finished, _ = futures_wait(list(waiting), timeout=min(WAIT_POLL_S, left), return_when=FIRST_COMPLETED)
            for fut in finished:
                entry, _, finish = waiting.pop(fut)
                try:
                    result = fut.result(timeout=0)
                except BaseException as exc:  # noqa: BLE001 - the line's own outcome
                    result = exc
                self._settle(entry, result, finish, model, started)
            if self.records:  # the lines that finished together are stored together, as they finish
                _retrying(f"storing lines of {self.job}", self._write)
                self.records = []

    def _settle(self, entry: dict, result, finish, model: str, started: float) -> None:
        line = entry["line"]
        if isinstance(result, EngineFailure):
            quarantine.record(self._line_task(line), result)  # a strike, if it was in the failing step
            self.back.append(line)
            return
        if isinstance(result, EngineUnavailable):
            self.back.append(line)
            return
        if isinstance(result, BatcheryError):
            self._error(entry, result, result.outcome, result.status_code)
            return
        if isinstance(result, BaseException):
            log.error("batch %s line %d: unexpected error %r", self.job, line, result)
            self._error(entry, result, Outcome.INTERNAL_ERROR, 500)
            return
        try:
            response = finish(result, f"{self.job}-{line}", model, started)
        except BatcheryError as exc:
            self._error(entry, exc, exc.outcome, exc.status_code)
            return
        except Exception as exc:  # noqa: BLE001
            log.exception("batch %s line %d: unexpected error", self.job, line)
            self._error(entry, exc, Outcome.INTERNAL_ERROR, 500)
            return
        usage = response.get("usage") or {}
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details")) or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        record = output_record(self.job, line, entry["custom_id"], f"{self.job}-{line}", response)
        self.records.append((line, record, Outcome.SUCCESS, prompt, completion, details.get("cached_tokens") or 0))
        self.tokens = (self.tokens[0] + prompt, self.tokens[1] + completion)
        self._count(Outcome.SUCCESS)


def prepare(url: str, body: dict, priority: int):
    """A line's engine request and the function that shapes its result as the endpoint answers: ``(gen,
    finish(result, request_id, model, started) -> dict)``; ``InvalidRequest`` for a body the endpoint refuses."""
    if url == CHAT_URL:
        req = _validate(ChatCompletionRequest, body)
        return chat_generation(req, priority), lambda r, rid, model, started: shape_chat(
            req, r, rid, model, started, 0
        ).model_dump(mode="json")
    if url == COMPLETIONS_URL:
        creq = _validate(CompletionRequest, body)
        if isinstance(creq.prompt, str):
            gen = GenerationRequest(prompt=creq.prompt, sampling=creq.sampling(), priority=priority)
        else:
            gen = GenerationRequest(prompt_token_ids=list(creq.prompt), sampling=creq.sampling(), priority=priority)
        return gen, lambda r, rid, model, started: shape_completion(creq, r, rid, model, started, 0).model_dump(
            mode="json"
        )
    if url == RESPONSES_URL:
        rreq = _validate(ResponsesRequest, body)
        try:
            req = rreq.to_chat()
        except ValidationError as exc:
            raise InvalidRequest(describe_validation_error(exc)) from None
        except ValueError as exc:
            raise InvalidRequest(f"invalid request body: {exc}") from None

        def finish(r, rid, model, started):
            chat = shape_chat(req, r, rid, model, started, 0)
            return response_from_chat(chat, response_id=f"resp_{rid}", created_at=started, model=model, req=rreq)

        return chat_generation(req, priority), finish
    if url == EMBEDDINGS_URL:
        ereq = _validate(EmbeddingRequest, body)
        return embedding_generation(ereq, priority), lambda r, rid, model, started: shape_embeddings(ereq, r, model)
    raise InvalidRequest(f"unsupported url {url!r}")


def split(app, store, job: str, lines: list[int], priority: int) -> int:
    """Queue ``lines`` of ``job`` again as their own messages (the ledger's copies, flagged as delivered before, so
    quarantine reads their strikes), at the head of the queue; returns how many (lines recorded meanwhile have no
    copy left and are not queued)."""
    settings = app.batchery_settings
    copies = _retrying(f"reading the ledger of {job}", store.pending_messages, job, sorted(lines))
    if not copies:
        return 0
    broker = app_resource(app, "batchery_chunk_broker", lambda: redis_from_url(settings.broker_url))
    n = _retrying(
        f"queueing lines of {job} again", push_copies, broker, str(settings.queue), copies, True, priority
    )  # fmt: skip
    log.info("batch %s: %d lines of a chunk queued again one by one", job, n)
    return n
