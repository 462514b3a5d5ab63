"""Prefix-cache hits give what ``model.generate`` gives on the prompt alone.

Every request here is compared with transformers' own ``generate`` on that one prompt (greedy), never
with the engine with caching off, so a hit that serves wrong or stale KV cannot hide behind a second
run of the same engine. Each case also asserts, through ``llm.stats()`` and the request's
``num_cached_tokens``, exactly how many tokens were served from the cache (and, where forced, that
blocks were evicted): a case whose hits silently stopped happening fails.

Cases (block size 4, families llama, qwen2 and glm):
- shared prefixes of exactly k full blocks;
- shared prefixes of k blocks - 1, k blocks and k blocks + 1 tokens, and prompts that are themselves
  such a prefix of a cached prompt (the last prompt token is always computed, never served);
- a prompt followed by its own previous output, three turns deep (hits on blocks written by decode);
- the two cases above also with a token budget of 6 per step, so the uncached rest is prefilled in chunks;
- a tiny pool: cached blocks evicted by a request that needs the whole pool, then prompts that re-use
  the fully evicted and the partly evicted prefixes.
"""
from __future__ import annotations

import pytest
import torch

from hf_paged import LLM
from tiny_models import VOCAB, make_model

BS = 4
FAMILIES = ["llama", "qwen2", "glm"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(model, prompt, **settings) -> list[list[int]]:
    """``model.generate`` on this prompt alone: [[prompt + new tokens]]."""
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **settings).tolist()


def tokens(gen: torch.Generator, n: int, avoid: int | None = None) -> list[int]:
    """n random ids (never PAD/EOS/BOS); the first one differs from ``avoid``."""
    out = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
    if n and avoid is not None and out[0] == avoid:
        out[0] = 3 + (avoid - 3 + 1) % (VOCAB - 3)
    return out


def run(llm: LLM, model, prompts, expected_hits, **settings):
    """One ``llm.generate`` call: every output equals generate's, each request was served exactly
    ``expected_hits[i]`` cached tokens, and the stats count exactly their sum. Returns the outputs."""
    before = llm.stats()
    outs = llm.generate(prompts, do_sample=False, **settings)
    after = llm.stats()
    llm.engine.check_invariants()
    assert after["blocks_used"] == 0, f"blocks still held after the call: {after}"
    assert after["preemptions"] == before["preemptions"], "no preemption expected here (it re-counts hits)"
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.error is None, out.error
        assert out.sequences.tolist() == reference(model, prompt, **settings), (
            f"prompt {i} (length {len(prompt)}, {out.num_cached_tokens} cached tokens) differs from generate")
    got = [o.num_cached_tokens for o in outs]
    assert got == list(expected_hits), f"cached tokens per request {got}, expected {list(expected_hits)}"
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hit == sum(expected_hits), f"stats counted {hit} hit tokens, expected {sum(expected_hits)}"
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_block_aligned_shared_prefixes(family):
    model = make_model(family, seed=21)
    gen = torch.Generator().manual_seed(22)
    llm = LLM(model, block_size=BS, num_blocks=128)
    systems = {k: tokens(gen, k * BS) for k in (1, 2, 3)}
    warm = [systems[k] + tokens(gen, 3) for k in systems]
    run(llm, model, warm, [0, 0, 0], max_new_tokens=4)
    follow = [systems[k] + tokens(gen, n, avoid=systems[k][0]) for k in systems for n in (1, 2, 7)]
    run(llm, model, follow, [k * BS for k in systems for _ in (1, 2, 7)], max_new_tokens=6)
    assert llm.stats()["prefix_hit_tokens"] == 3 * (1 + 2 + 3) * BS


@pytest.mark.parametrize("budget", [512, 6], ids=["whole", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefixes_one_token_around_block_boundaries(family, budget):
    """budget 6: the uncached rest of each prompt is prefilled in chunks of a few tokens."""
    model = make_model(family, seed=23)
    gen = torch.Generator().manual_seed(24)
    llm = LLM(model, block_size=BS, num_blocks=128, max_num_batched_tokens=budget)
    base = tokens(gen, 3 * BS + 2)
    run(llm, model, [base], [0], max_new_tokens=3)
    prompts, hits = [], []
    for k in (1, 2, 3):
        for shared in (k * BS - 1, k * BS, k * BS + 1):
            # diverges right after `shared` tokens: every full block inside the shared part is served
            prompts.append(base[:shared] + tokens(gen, 3, avoid=base[shared]))
            hits.append(shared // BS * BS)
            # the prompt is itself a prefix of the cached one: its last token is always computed
            prompts.append(base[:shared])
            hits.append((shared - 1) // BS * BS)
    assert sum(hits) > 0 and 0 in hits
    run(llm, model, prompts, hits, max_new_tokens=5)


@pytest.mark.parametrize("budget", [512, 6], ids=["whole", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_followed_by_its_own_output(family, budget):
    """Each turn's prompt is the previous prompt + its output (+ a new user turn): the hit covers the
    blocks the previous call's decode steps wrote, which generate recomputes from scratch."""
    model = make_model(family, seed=25)
    gen = torch.Generator().manual_seed(26)
    llm = LLM(model, block_size=BS, num_blocks=128, max_num_batched_tokens=budget)
    prompt = tokens(gen, 6)
    out = run(llm, model, [prompt], [0], max_new_tokens=9)[0]
    for turn in range(3):
        history = out.sequences[0].tolist()           # prompt + its own output
        new = len(history) - len(prompt)
        assert new >= 3, f"turn {turn}: the output ended after {new} tokens; pick another seed"
        stored = len(history) - 1                      # the last sampled token was never computed
        assert stored // BS > len(prompt) // BS, "the hit must reach into blocks written by decode"
        expected = stored // BS * BS
        follow_up = history + tokens(gen, 3)
        outs = run(llm, model, [history, follow_up], [expected, expected], max_new_tokens=9)
        prompt, out = follow_up, outs[1]


def _fill_whole_pool(llm, model, gen, num_blocks):
    """A request whose prompt alone needs every block of the pool: every cached block is evicted."""
    before = llm.stats()
    cached_before = before["blocks_cached"]
    big = tokens(gen, num_blocks * BS - 3)
    run(llm, model, [big], [0], max_new_tokens=3)
    after = llm.stats()
    assert cached_before > 0
    assert after["prefix_evictions"] - before["prefix_evictions"] >= cached_before, (before, after)
    return big


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_eviction_then_reuse_of_evicted_prefixes(family):
    num_blocks = 12
    model = make_model(family, seed=27)
    gen = torch.Generator().manual_seed(28)
    llm = LLM(model, block_size=BS, num_blocks=num_blocks, max_num_seqs=4)
    a = tokens(gen, 4 * BS)
    run(llm, model, [a + tokens(gen, 1)], [0], max_new_tokens=2)
    run(llm, model, [a + tokens(gen, 2, avoid=a[0])], [4 * BS], max_new_tokens=2)   # a is cached
    assert llm.stats()["prefix_evictions"] == 0

    # a request needing the whole pool evicts all of a's blocks: a's prefix must be recomputed, and
    # no stale hash may serve the blocks the big request overwrote
    big = _fill_whole_pool(llm, model, gen, num_blocks)
    run(llm, model, [a + tokens(gen, 3)], [0], max_new_tokens=2)

    # that request took big's cached blocks: the last blocks of big's prompt go first (LRU, a released
    # sequence's tail first), so a 10-block prefix of big's prompt still hits, but only in part
    partial = big[:10 * BS] + tokens(gen, 2, avoid=big[10 * BS])
    before = llm.stats()
    assert before["prefix_evictions"] > 0
    outs = llm.generate([partial], do_sample=False, max_new_tokens=2)
    after = llm.stats()
    llm.engine.check_invariants()
    assert outs[0].sequences.tolist() == reference(model, partial, max_new_tokens=2)
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hit == outs[0].num_cached_tokens and hit % BS == 0
    assert 0 < hit < 10 * BS, (f"{hit} cached tokens for a prefix of 10 blocks of which some were evicted: "
                               "expected a partial hit (the prefix's first blocks survive eviction)")

    # the blocks recomputed after the eviction are cached again and serve the whole prefix
    run(llm, model, [big[:10 * BS] + tokens(gen, 3, avoid=big[10 * BS])], [10 * BS], max_new_tokens=3)
    assert llm.stats()["blocks_used"] == 0
