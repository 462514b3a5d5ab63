"""The background engine thread: the only thread that touches the Engine.

Requests join and leave between steps through a thread-safe command queue; each step's tokens go back
to the asyncio side with ``loop.call_soon_threadsafe`` (one call per request per step). An idle engine takes a
burst of requests into one first step (``_drain``), and the thread that starts the worker gives back its
OpenMP workers first (``start``). The queue is bounded beyond what runs: ``submit`` raises :class:`QueueFull`
when the sequences in flight (submitted and not yet done: waiting for the engine thread, waiting in the engine
or running) would exceed ``max_num_seqs + max_queue``. The count is the worker's own, kept under its lock
(``submit`` adds a request's sequences, its last item takes them off), so a burst submitted between two engine
steps is counted exactly: with max_num_seqs 8 and max_queue 16, 24 requests fit and the 25th is refused. A
request with ``n`` sequences takes ``n`` (the engine's max_num_seqs counts sequences); they are taken off when
the whole request is done. ``shutdown`` stops accepting, lets in-flight requests finish within a timeout,
cancels the rest and joins the thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from hf_paged.backends.openmp import release_openmp_workers

if TYPE_CHECKING:
    from hf_paged.engine import Engine, SamplingParams

log = logging.getLogger("hf_paged.server")

# An idle engine that receives a request waits this long for the next one, and at most COALESCE_MAX_S in all,
# before its first step (see EngineWorker._drain). A lone request's first token comes this much later.
COALESCE_GAP_S = 0.005
COALESCE_MAX_S = 0.05


class QueueFull(RuntimeError):
    """The waiting queue is full (answer 503 with Retry-After)."""


class ShuttingDown(RuntimeError):
    """The server is stopping and accepts no new requests."""


class EngineFailed(RuntimeError):
    """The engine thread failed: nothing more is accepted and the server stops (as vLLM's, whose API server
    exits when its engine dies, for a supervisor to restart it)."""


@dataclass
class Handle:
    """One request as the server sees it. ``deliver(item)`` runs in the engine thread and must hand
    ``item`` to the asyncio side: ``("prompt", entries)`` once before the first tokens when the request
    asks prompt log-probabilities, lists of TokenEvents, and ``("done", RequestOutput)`` /
    ``("error", message)`` as the last item."""
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[object], None]
    slots: int = 0                       # sequences it holds in the worker's count (set by submit)
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int | None = None
    first_token: float | None = None
    last_token: dict = field(default_factory=dict)     # sequence index -> time of its last token
    cancelled: bool = False
    done: bool = False                   # set by the engine thread when the last item went out
    prompt_sent: bool = False            # its prompt log-probabilities (when asked) went out


class EngineWorker:
    """Runs ``engine`` in a thread of its own. max_queue: sequences that may wait beyond the
    engine's ``max_num_seqs`` running ones before ``submit`` raises QueueFull. metrics: a Metrics to
    update (or None)."""

    def __init__(self, engine: Engine, max_queue: int, metrics=None, on_failure: Callable[[], None] | None = None):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.on_failure = on_failure          # called in the engine thread once it failed (serve: stop the server)
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0               # sequences submitted and not yet done (see the module doc)
        self._active: dict[int, Handle] = {}      # engine request id -> handle (engine thread only)
        self._accepting = True
        self._stop = threading.Event()    # leave the loop once nothing is active
        self._abort = threading.Event()   # cancel everything still active, then leave
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.error: BaseException | None = None

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        """Start the engine thread. The calling thread's idle OpenMP workers are released first (it loaded
        the model; see hf_paged.backends.openmp): with two teams on a machine torch keeps busy, each step
        took about a fifth longer."""
        release_openmp_workers()
        self._refresh()                 # the pool's size in /metrics before the first request (no thread yet)
        self._thread = threading.Thread(target=self._run, name="hf_paged-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self):
        """The engine's EngineStats as of the last step or command (read in the engine thread)."""
        return self._stats

    @property
    def capacity(self) -> int:
        """Sequences in flight at most: the engine's running ones plus ``max_queue`` waiting."""
        return self.engine.config.max_num_seqs + self.max_queue

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet done."""
        return self._in_flight

    def submit(self, handle: Handle) -> Handle:
        slots = handle.params.num_return_sequences
        with self._lock:     # the put too: a failing engine thread drains the queue after it stops accepting
            if self.error is not None:
                raise EngineFailed("the engine failed (see the server log); the server is stopping")
            if not self._accepting or not self.alive:
                raise ShuttingDown("the server is shutting down")
            if self._in_flight + slots > self.capacity:
                raise QueueFull(f"the server is full: {self._in_flight} sequences in flight, at most "
                                f"{self.capacity} (max_num_seqs {self.engine.config.max_num_seqs} running + "
                                f"max_queue {self.max_queue} waiting); retry later")
            self._in_flight += slots
            handle.slots = slots
            self._commands.put(("add", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Cancel a request (e.g. its client disconnected); its blocks go back. Idempotent."""
        if not handle.cancelled and not handle.done:
            handle.cancelled = True
            self._commands.put(("cancel", handle))

    def cancel_all(self) -> None:
        """Cancel every request in flight (a stopping server's last second: each ends as an answer with
        finish_reason "abort", a stream with its [DONE], instead of a connection cut by uvicorn)."""
        self._commands.put(("cancel_all", None))

    def shutdown(self, timeout: float) -> bool:
        """Stop accepting, let in-flight requests finish for ``timeout`` s, cancel the rest, join.
        Returns True when the thread is gone."""
        with self._lock:
            self._accepting = False
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout))
        if self._thread.is_alive():
            log.warning("shutdown: cancelling the requests still running after %.1f s", timeout)
            self._abort.set()
            self._commands.put(("wake", None))
            self._thread.join(30.0)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            with engine.session():
                while True:
                    self._drain(block=not engine.has_work and not self._stop.is_set())
                    if self._abort.is_set():
                        for handle in list(self._active.values()):
                            self._cancel(handle)
                        self._refresh()
                        break
                    if engine.has_work:
                        events = engine.step()
                        self._dispatch(events)
                        self._refresh()
                    elif self._stop.is_set() and not self._active and self._commands.empty():
                        break
        except BaseException as exc:       # pragma: no cover - a bug or an OOM: fail every request
            self._fail_everything(exc)

    def _fail_everything(self, exc: BaseException) -> None:    # pragma: no cover
        """The engine raised: accept nothing more; every active or queued request gets an error."""
        log.error("the engine thread failed", exc_info=exc)
        with self._lock:
            self.error, self._accepting = exc, False
        failed = ("fault", "the engine failed; see the server log")
        for handle in list(self._active.values()):
            self._last(handle, failed)
        self._active.clear()
        while not self._commands.empty():
            kind, handle = self._commands.get_nowait()
            if kind == "add":
                self._last(handle, failed)
        if self.on_failure is not None:
            self.on_failure()

    def _drain(self, block: bool) -> None:
        """Apply the queued commands. ``block`` (the engine is idle): wait for one, then keep taking those that
        follow within COALESCE_GAP_S of each other (at most COALESCE_MAX_S): a burst of requests parsed one by
        one by the HTTP thread starts in one first step instead of a first step for its first request alone
        while the others queue behind it."""
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        changed = False
        deadline = time.perf_counter() + COALESCE_MAX_S
        while True:
            kind, handle = item
            if kind == "add":
                self._add(handle)
            elif kind == "cancel":
                self._cancel(handle)
            elif kind == "cancel_all":
                for active in list(self._active.values()):
                    self._cancel(active)
            changed = changed or kind != "wake"
            try:
                wait = min(COALESCE_GAP_S, deadline - time.perf_counter()) if block and kind == "add" else 0.0
                item = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
            except queue.Empty:
                break
        if changed:
            self._refresh()

    def _add(self, handle: Handle) -> None:
        if handle.cancelled:
            return self._last(handle, ("done", None))
        try:
            rid = self.engine.add_request(handle.prompt_ids, params=handle.params)
        except ValueError as exc:
            return self._last(handle, ("error", str(exc)))
        except Exception as exc:                   # the engine's fault, not the request's: it alone fails (500)
            log.error("the engine refused a request", exc_info=exc)
            return self._last(handle, ("fault", f"the engine could not take the request: {exc}"))
        output = self.engine.output(rid)
        if output.error is not None:               # can never fit: fails alone
            self.engine.forget(rid)
            return self._last(handle, ("error", output.error))
        handle.request_id = rid
        self._active[rid] = handle
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(handle.prompt_ids))

    def _cancel(self, handle: Handle) -> None:
        rid = handle.request_id
        if rid is None or rid not in self._active:
            return                                  # not added yet (the add sees .cancelled) or done
        self.engine.cancel(rid)
        self._finish(handle)

    def _finish(self, handle: Handle) -> None:
        rid = handle.request_id
        self._active.pop(rid, None)
        output = self.engine.forget(rid)                # the server keeps no finished request
        if self.metrics is not None:
            self.metrics.finished(handle, output, time.perf_counter())
        self._last(handle, ("done", output))

    def _last(self, handle: Handle, item) -> None:
        """Hand over a request's last item; the request is done for ``cancel`` from then on, and its
        sequences leave the in-flight count."""
        with self._lock:
            self._in_flight -= handle.slots
            handle.slots = 0
        handle.done = True
        handle.deliver(item)

    def _dispatch(self, events) -> None:
        now = time.perf_counter()
        by_request: dict[int, list] = {}
        for event in events:
            by_request.setdefault(event.request_id, []).append(event)
        for rid, evs in by_request.items():
            handle = self._active.get(rid)
            if handle is None:
                continue
            if self.metrics is not None:
                self.metrics.tokens(handle, evs, now)
            if not handle.prompt_sent:               # prompt log-probabilities come before any token
                handle.prompt_sent = True
                asked = self.engine.requests[rid].prompt_logprobs
                if asked is not None:
                    handle.deliver(("prompt", asked))
            handle.deliver(evs)
            if self.engine.output(rid).finished:
                self._finish(handle)

    def _refresh(self) -> None:
        stats = self.engine.stats()
        self._stats = stats
        if self.metrics is not None:
            self.metrics.engine_stats(stats)
