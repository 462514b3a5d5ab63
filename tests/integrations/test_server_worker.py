"""The server's engine thread (integrations/server/worker.py) without HTTP: a burst of requests submitted one by
one, as the HTTP thread parses them, starts in one first step."""
from __future__ import annotations

import queue
import time

import torch

from hf_paged.engine import Engine
from hf_paged.engine.settings import resolve_generation
from hf_paged.integrations.server import worker as server_worker
from tiny_models import VOCAB, make_model


def test_a_burst_submitted_one_by_one_starts_in_one_step():
    model = make_model("llama", seed=3)
    engine = Engine(model, max_num_seqs=8)
    first_step = []
    step = engine.step

    def recording_step():
        if not first_step:
            first_step.append(engine.scheduler.requests_running() + engine.scheduler.requests_waiting())
        return step()

    engine.step = recording_step
    worker = server_worker.EngineWorker(engine, max_queue=8)
    worker.start()
    done = queue.Queue()
    params = resolve_generation(model.generation_config, max_new_tokens=3, do_sample=False)
    gen = torch.Generator().manual_seed(4)
    try:
        for i in range(5):            # 1 ms apart: well inside COALESCE_GAP_S, as parsed requests arrive
            ids = torch.randint(3, VOCAB, (6 + i,), generator=gen).tolist()
            worker.submit(server_worker.Handle(ids, params, lambda item: done.put(item) if item[0] in ("done", "error") else None))
            time.sleep(0.001)
        finished = [done.get(timeout=60) for _ in range(5)]
    finally:
        worker.shutdown(10)
    assert all(kind == "done" for kind, _ in finished)
    # 5 when every 1 ms sleep is on time; without the coalescing the first step sees 1 (checked by hand). A
    # loaded machine may oversleep a gap, hence >= 3.
    assert first_step and first_step[0] >= 3, f"the first step saw {first_step} requests of the burst of 5"
    assert server_worker.COALESCE_GAP_S <= 0.01 and server_worker.COALESCE_MAX_S <= 0.1   # a lone request's cost



def test_a_request_the_engine_cannot_take_fails_alone():
    """add_request raising something other than a bad request's ValueError (weights changed mid-run, a bug):
    that request gets a "fault" (HTTP 500), the engine thread serves the next one (it died, leaving that request
    hanging and every later one answered 503)."""
    model = make_model("llama", seed=3)
    engine = Engine(model, max_num_seqs=8)
    add = engine.add_request
    calls = []

    def flaky_add(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the model's weights changed while the engine has requests running")
        return add(*args, **kwargs)

    engine.add_request = flaky_add
    worker = server_worker.EngineWorker(engine, max_queue=8)
    worker.start()
    done = queue.Queue()
    params = resolve_generation(model.generation_config, max_new_tokens=3, do_sample=False)
    try:
        for _ in range(2):
            last = lambda item: done.put(item) if item[0] in ("done", "error", "fault") else None  # noqa: E731
            worker.submit(server_worker.Handle([5, 6, 7], params, last))
            time.sleep(0.05)
        finished = [done.get(timeout=60) for _ in range(2)]
    finally:
        worker.shutdown(10)
    assert [kind for kind, _ in finished] == ["fault", "done"] and "weights changed" in finished[0][1]
    assert worker.error is None
