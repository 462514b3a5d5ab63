"""One API call seen from the asyncio side: its engine requests (one per prompt, ``n`` sequences each),
their text streams (stop sequences cut off) and its token usage.

The engine thread hands each request's items over with ``loop.call_soon_threadsafe``; ``deltas()``
turns them into (choice index, text delta, finish reason) in arrival order.
"""
from __future__ import annotations

import asyncio
from functools import partial

from .detokenize import TextStream
from .errors import ApiError
from .protocol import finish_reason
from .worker import EngineWorker, Handle, QueueFull, ShuttingDown


class ApiCall:
    """Choice ``i * n + j`` is sequence ``j`` of prompt ``i``."""

    def __init__(self, worker: EngineWorker, tokenizer, prompts: list[list[int]], params, stops, n: int):
        self.worker, self.n = worker, n
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams = {(i, j): TextStream(tokenizer, stops) for i in range(len(prompts)) for j in range(n)}
        self.done: set[tuple[int, int]] = set()          # (prompt, sequence) pairs whose last delta went out
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0
        self.handles = [Handle(ids, params, partial(self._deliver, i)) for i, ids in enumerate(prompts)]

    @property
    def choices(self) -> int:
        return len(self.handles) * self.n

    def _deliver(self, i: int, item) -> None:           # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, item))

    def submit(self) -> None:
        """Hand every request to the engine thread; all or none (503 when the queue is full or closing)."""
        try:
            for handle in self.handles:
                self.worker.submit(handle)
        except QueueFull as exc:
            self.cancel()
            raise ApiError.unavailable(exc, "queue_full")
        except ShuttingDown as exc:
            self.cancel()
            raise ApiError.unavailable(exc, "shutting_down")

    def cancel(self) -> None:
        """Cancel what still runs (a no-op for finished requests)."""
        for handle in self.handles:
            self.worker.cancel(handle)

    async def deltas(self):
        """Yield (choice index, text delta, finish reason or None) until every sequence is done."""
        pending = len(self.handles)
        while pending:
            i, item = await self.queue.get()
            if isinstance(item, tuple):                  # ("done", output) or ("error", message): the last
                kind, value = item
                if kind == "error":
                    raise ApiError(400, value, param="prompt")
                pending -= 1
                for j in range(self.n):                  # sequences that ended without an event (cancelled)
                    if (i, j) not in self.done:
                        self.done.add((i, j))
                        yield i * self.n + j, self.streams[i, j].finish(), "abort"
                continue
            for event in item:
                out = self._token(i, event)
                if out is not None:
                    yield out

    def _token(self, i: int, event):
        """The delta one TokenEvent adds to its choice, or None (nothing to send yet, or already done)."""
        key = (i, event.index)
        if key in self.done:
            return None
        stream = self.streams[key]
        self.completion_tokens += 1
        delta = stream.add(event.token)
        if event.finished or stream.stopped:
            self.done.add(key)
            delta += stream.finish()                     # may find a stop string in the last characters
            reason = "stop" if stream.stopped else finish_reason(event.finished)
            return i * self.n + event.index, delta, reason
        return (i * self.n + event.index, delta, None) if delta else None

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
