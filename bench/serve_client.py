"""The client of ``python -m bench serve`` (bench/serve_load.py): the workload, Poisson arrival times,
one streamed ``/v1/completions`` request, one bounded run against one server, and its summary.

Per request: TTFT (send -> first non-empty text chunk), ITL (gaps between non-empty chunks), end-to-end
latency, output tokens (the server's ``usage`` when it sends one). Per run: output tokens/s over the run's
wall time, TTFT / ITL / E2E p50 and p99.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .workloads import sharegpt_pick

if TYPE_CHECKING:
    from .serve_servers import Server


@dataclass
class Item:
    prompt: str
    prompt_tokens: int
    max_tokens: int


def workload(tokenizer, n: int, seed: int, max_prompt: int, max_output: int, min_output: int = 4) -> list[Item]:
    """``n`` ShareGPT (prompt, output) length pairs with 4 <= prompt <= max_prompt and min_output <= output <=
    max_output; prompts are text decoded from random plain token ids (the servers take text), re-encoded
    to count their tokens."""
    rng = np.random.default_rng(seed)
    prompts, outputs = sharegpt_pick(rng, n, max_prompt, min_output, max_output, min_prompt=4)
    special = set(tokenizer.all_special_ids)
    lo, hi = min(100, len(tokenizer) - 1), len(tokenizer)
    items = []
    for target, out in zip(prompts.tolist(), outputs.tolist()):
        ids = [t for t in rng.integers(lo, hi, size=target).tolist() if t not in special]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(4):  # bounded: trim until the re-encoded prompt fits the target length
            enc = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(enc) <= target:
                break
            text = tokenizer.decode(enc[:target], skip_special_tokens=True)
        items.append(Item(text, len(tokenizer(text, add_special_tokens=False)["input_ids"]), out))
    return items


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps of mean 1/rate, the first request at 0; rate inf: every
    request at 0 (a saturated run, as ``vllm bench serve --request-rate inf``)."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------------------------------------- client

async def one_request(client, srv: Server, item: Item, timeout_s: float) -> dict:
    """Stream one completion; times relative to the send."""
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage_tokens = None
    error = None
    text_parts = []
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", srv.url + "/v1/completions", json=srv.body(item)) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            error = str(obj["error"])[:200]
                            break
                        text = "".join(c.get("text") or "" for c in obj.get("choices") or [])
                        if text:
                            chunks.append(time.perf_counter() - t0)
                            text_parts.append(text)
                        if obj.get("usage"):
                            usage_tokens = obj["usage"].get("completion_tokens")
    except TimeoutError:
        error = f"timed out after {timeout_s:.0f} s"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"[:200]
    e2e = time.perf_counter() - t0
    return {"ok": error is None and bool(chunks), "error": error or (None if chunks else "no text"),
            "ttft": chunks[0] if chunks else None, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "e2e": e2e, "chunks": len(chunks), "output_tokens": usage_tokens if usage_tokens is not None else len(chunks),
            "usage_reported": usage_tokens is not None, "max_tokens": item.max_tokens}


async def run_load(srv: Server, items: list[Item], times: list[float], timeout_s: float, deadline_s: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(items) + 4, max_keepalive_connections=len(items) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t_start = time.perf_counter()

        async def fire(item, at):
            await asyncio.sleep(max(0.0, t_start + at - time.perf_counter()))
            out = await one_request(client, srv, item, timeout_s)
            out["sent_at"] = at
            return out

        tasks = [asyncio.create_task(fire(it, at)) for it, at in zip(items, times)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t_start
    results = [t.result() for t in tasks if t in done and not t.cancelled() and t.exception() is None]
    return summarize(results, wall, len(items) - len(results))


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[dict], wall: float, cut: int) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    tokens = sum(r["output_tokens"] for r in ok)
    errors = [r["error"] for r in results if not r["ok"]] + ["cut by the run deadline"] * cut
    return {"requests_ok": len(ok), "requests_failed": len(errors), "errors": errors[:5], "wall_s": wall,
            "output_tokens": tokens, "expected_tokens": sum(r["max_tokens"] for r in ok),
            "output_tokens_per_s": tokens / wall if wall > 0 and ok else 0.0,
            "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
            "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in ok)),
            "usage_reported": all(r["usage_reported"] for r in ok) if ok else None}
