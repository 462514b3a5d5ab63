"""Engine soak: thousands of random requests through ``engine.add_request`` / ``step`` / ``cancel``.

Requests arrive over time (a few per step), mixing greedy and seeded sampling, ``num_return_sequences``
1-3 on sampled ones, extra EOS ids, prompts that share a few system prefixes, and cancellations of
waiting, running and already finished requests. The pool is tiny, so sequences are preempted and
cached blocks evicted all the time.

Checked: the block layer's invariants after every step; the streamed tokens equal each request's final
output; every output's length and finish reason agree with its settings; no block is held at the end;
the soak really preempted, evicted and hit the prefix cache; and a random sample of requests that were
not cancelled equal ``model.generate`` on their prompt alone: 20 greedy, 8 seeded n=1 sampled
(``torch.manual_seed(seed)`` then generate), and 8 greedy-as-``top_k=1``-sampling with n = 2-3, whose
forked sequences (shared blocks, copy-on-write) must each equal greedy generate.

A fixed seed by default; ``HF_PAGED_SEED=<int>`` runs another one (the seed is printed, use -s to see
it, and is in every failure message). ``HF_PAGED_SOAK_REQUESTS`` changes the count (default 2000).
The elapsed time is printed for information and never asserted on.
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

from hf_paged import LLM
from tiny_models import EOS, VOCAB, make_model

DEFAULT_SEED = 20240611
BLOCK_SIZE = 4
NUM_BLOCKS = 20              # 80 token slots for up to 16 sequences of up to 24 tokens each
MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 32      # prompts of several arrivals get chunked
COMPARE_GREEDY, COMPARE_SAMPLED, COMPARE_FORKED = 20, 8, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(model, prompt, seed=None, **settings) -> list[list[int]]:
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), **settings).tolist()


def random_requests(rng: random.Random, count: int) -> list[tuple[list[int], dict]]:
    systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 4, 8, 5)]
    requests = []
    for i in range(count):
        length = rng.randint(1, 12)
        if rng.random() < 0.4:
            system = rng.choice(systems)
            prompt = system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 4))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        settings = dict(max_new_tokens=rng.randint(1, 12))
        kind = rng.random()
        if kind < 0.45:
            settings["do_sample"] = False
        elif kind < 0.55:       # greedy as sampling (generate refuses greedy n > 1): n equal forked sequences
            settings.update(do_sample=True, top_k=1, seed=rng.randrange(2**31), num_return_sequences=rng.randint(2, 3))
        else:
            settings.update(do_sample=True, seed=rng.randrange(2**31), num_return_sequences=rng.randint(1, 3),
                            temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 5, 50]),
                            top_p=rng.choice([1.0, 0.9]))
        if rng.random() < 0.15:
            settings["eos_token_id"] = [EOS, rng.randrange(3, VOCAB)]
        requests.append((prompt, settings))
    return requests


def test_engine_soak():
    seed = int(os.environ.get("HF_PAGED_SEED") or DEFAULT_SEED)
    count = int(os.environ.get("HF_PAGED_SOAK_REQUESTS") or 2000)
    print(f"HF_PAGED_SEED={seed}")
    tag = f"(HF_PAGED_SEED={seed})"
    rng = random.Random(seed)
    model = make_model("qwen2", seed=seed % 1000)     # the smallest tiny model (hidden 128, head dim 32)
    llm = LLM(model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_BATCHED_TOKENS)
    engine = llm.engine
    requests = random_requests(rng, count)

    ids: list[int] = []                          # request id of requests[i]
    streamed: dict[tuple[int, int], list[int]] = {}
    started: dict[int, None] = {}                # request ids that streamed a token and are not finished
    cancelled: set[int] = set()                  # request ids cancelled before they finished
    cancelled_mid_flight = cancelled_waiting = 0
    pending = steps = idle_steps = max_waiting = 0
    rate, phase_left = 1.0, 0
    start = time.perf_counter()
    while pending < len(requests) or engine.has_work:
        if phase_left == 0:                      # bursts and lulls: the queue fills up and drains
            rate, phase_left = rng.choice([0.1, 0.4, 0.8, 2.0]), rng.randint(10, 80)
        phase_left -= 1
        arrivals = sum(rng.random() < rate / 4 for _ in range(4)) + (rate > 1 and rng.random() < rate - 1)
        for _ in range(arrivals):
            if pending < len(requests):
                prompt, settings = requests[pending]
                ids.append(engine.add_request(prompt, **settings))
                pending += 1
        if ids and rng.random() < 0.1:           # a cancellation: mid-flight, a recent one, or a finished one
            pick = rng.random()
            if pick < 0.5 and started:
                rid = rng.choice(list(started))
            elif pick < 0.8:
                rid = ids[rng.randrange(max(0, len(ids) - 20), len(ids))]
            else:
                rid = rng.choice(ids)
            if not engine.output(rid).finished:
                cancelled.add(rid)
                if rid in started:
                    cancelled_mid_flight += 1
                else:
                    cancelled_waiting += 1
            engine.cancel(rid)
            started.pop(rid, None)
            assert engine.output(rid).finished, f"request {rid} still running after cancel {tag}"
            engine.check_invariants()
        max_waiting = max(max_waiting, llm.stats()["requests_waiting"])
        if not engine.has_work:
            idle_steps += 1
            continue
        for event in engine.step():
            streamed.setdefault((event.request_id, event.index), []).append(event.token)
            if engine.output(event.request_id).finished:
                started.pop(event.request_id, None)
            else:
                started[event.request_id] = None
        steps += 1
        engine.check_invariants()
    elapsed = time.perf_counter() - start

    stats = llm.stats()
    print(f"{len(requests)} requests, {steps} steps in {elapsed:.1f}s ({idle_steps} idle, up to {max_waiting} "
          f"waiting), {cancelled_mid_flight} cancelled mid-flight, {cancelled_waiting} while waiting; "
          f"preemptions={stats['preemptions']} prefix_evictions={stats['prefix_evictions']} "
          f"prefix_hit_tokens={stats['prefix_hit_tokens']}")
    engine.check_invariants()
    assert stats["blocks_used"] == 0, f"blocks leaked: {stats} {tag}"
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, f"{stats} {tag}"
    assert stats["requests_finished"] == len(requests) and stats["requests_failed"] == 0, f"{stats} {tag}"
    assert stats["requests_cancelled"] == len(cancelled), f"{stats} {tag}"
    assert min(cancelled_mid_flight, cancelled_waiting) >= len(requests) // 100, (
        f"too few cancellations: {cancelled_mid_flight} mid-flight, {cancelled_waiting} waiting {tag}")
    assert idle_steps > 0 and max_waiting > MAX_NUM_SEQS, f"arrivals never drained or never queued {tag}"
    assert stats["preemptions"] > 0, f"the soak never preempted: {stats} {tag}"
    assert stats["prefix_evictions"] > 0, f"the soak never evicted a cached block: {stats} {tag}"
    assert stats["prefix_hit_tokens"] > 0, f"the soak never hit the prefix cache: {stats} {tag}"

    finished_greedy, finished_forked, finished_sampled = [], [], []
    for i, ((prompt, settings), rid) in enumerate(zip(requests, ids)):
        out = engine.output(rid)
        n = settings.get("num_return_sequences", 1)
        where = f"request {i} (id {rid}, prompt {prompt}, {settings}) {tag}"
        assert out.error is None and out.finished, where
        assert [o.index for o in out.outputs] == list(range(n)), where
        eos = set(settings.get("eos_token_id", [EOS]))
        for o in out.outputs:
            assert o.token_ids == streamed.get((rid, o.index), []), f"streamed tokens differ from the output: {where}"
            assert len(o.token_ids) <= settings["max_new_tokens"], where
            if rid in cancelled and o.finish_reason == "cancelled":
                continue
            assert o.finish_reason in ("stop", "length"), f"{o.finish_reason}: {where}"
            if o.finish_reason == "stop":
                assert o.token_ids and o.token_ids[-1] in eos and not eos & set(o.token_ids[:-1]), where
            else:
                assert len(o.token_ids) == settings["max_new_tokens"] and not eos & set(o.token_ids), where
        if rid in cancelled:
            assert any(o.finish_reason == "cancelled" for o in out.outputs), where
        elif not settings["do_sample"]:
            finished_greedy.append(i)
        elif settings.get("top_k") == 1:
            finished_forked.append(i)
        elif n == 1:
            finished_sampled.append(i)

    pick = random.Random(seed + 1)
    sample = [(i, "greedy") for i in pick.sample(finished_greedy, min(COMPARE_GREEDY, len(finished_greedy)))]
    sample += [(i, "sampled") for i in pick.sample(finished_sampled, min(COMPARE_SAMPLED, len(finished_sampled)))]
    sample += [(i, "forked") for i in pick.sample(finished_forked, min(COMPARE_FORKED, len(finished_forked)))]
    assert len(sample) == COMPARE_GREEDY + COMPARE_SAMPLED + COMPARE_FORKED, f"too few requests to compare {tag}"
    for i, kind in sample:
        prompt, settings = requests[i]
        settings = dict(settings)
        rng_seed = settings.pop("seed", None)
        if kind == "forked":        # top_k=1 sampling is greedy: every one of the n sequences is generate's
            n = settings.pop("num_return_sequences")
            del settings["top_k"]
            settings["do_sample"] = False
            expected = reference(model, prompt, **settings) * n
        else:
            expected = reference(model, prompt, seed=rng_seed, **settings)
        got = engine.output(ids[i]).sequences.tolist()
        assert got == expected, f"{kind} request {i} ({settings}, seed {rng_seed}) differs from generate {tag}"
