"""Prefix caching across generate calls (``hf_paged.patch(model, enable_prefix_caching=True)``): every
call's tokens equal transformers' default path on the same call, hits or not, in fp32 on the tiny models
— greedy, sampling, beams, num_return_sequences, chunked prefill, continuation — over random shared
prefixes that end on block boundaries and one token either side, with evictions forced by a small
budget; the store never holds more than its budget and its bookkeeping stays consistent."""
from __future__ import annotations

import os
import random

import pytest
import torch

import hf_paged
from hf_paged.integrations.generate import chunked_prefill_continues
from tiny_models import VOCAB, left_padded, make_batch, make_model, patched

BLOCK = 8


def prompts_with_prefix(prefix: list[int], tails: list[int], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows ``prefix + random tail`` (tail lengths ``tails``): (input_ids, attention_mask)."""
    return left_padded([prefix + [rng.randrange(3, VOCAB) for _ in range(n)] for n in tails])


def reference_and_cached(model, calls, **kw):
    """Each call's default-path output, and the patched model's with prefix caching on (calls run in order
    on one store); returns (references, outputs, stats of each call)."""
    options = kw.pop("patch", {})
    refs = []
    for ids, mask in calls:
        torch.manual_seed(11)
        refs.append(model.generate(input_ids=ids, attention_mask=mask, **kw))
    outs, stats = [], []
    with patched(model, block_size=BLOCK, enable_prefix_caching=True, **options):
        for ids, mask in calls:
            torch.manual_seed(11)
            outs.append(model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", **kw))
            stats.append(hf_paged.last_stats(model))
        model._hf_paged.prefix_store.check_invariants()
    return refs, outs, stats


def seq(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_greedy_hits_give_the_default_paths_tokens(family, offset):
    seed = int(os.environ.get("HF_PAGED_SEED", 20261202))
    rng = random.Random(seed + offset)
    model = make_model(family, seed=3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(3 * BLOCK + offset)]
    calls = [prompts_with_prefix(prefix, [rng.randint(1, 9) for _ in range(3)], rng) for _ in range(3)]
    refs, outs, stats = reference_and_cached(model, calls, max_new_tokens=6, do_sample=False,
                                             return_dict_in_generate=True, output_logits=True)
    for i, (ref, out) in enumerate(zip(refs, outs)):
        assert torch.equal(ref.sequences, out.sequences), f"call {i} (HF_PAGED_SEED={seed})"
        for a, b in zip(ref.logits, out.logits):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert stats[0]["prefix_hit_tokens"] == 0
    whole_blocks = (len(prefix) // BLOCK) * BLOCK
    for s in stats[1:]:            # later calls reuse every whole block of the shared prefix, in each row
        assert s["prefix_hits"] == 3 and s["prefix_hit_tokens"] >= 3 * whole_blocks - 3 * BLOCK
        assert s["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("mode", [dict(do_sample=True, temperature=0.9, top_p=0.9),
                                  dict(do_sample=False, num_beams=3, num_return_sequences=2),
                                  dict(do_sample=True, num_return_sequences=3),
                                  dict(do_sample=False, prefill_chunk_size=5)],
                         ids=["sample", "beams", "num_return_sequences", "chunked_prefill"])
def test_other_modes_with_hits(mode):
    rng = random.Random(7)
    model = make_model("llama", seed=4)
    prefix = [rng.randrange(3, VOCAB) for _ in range(2 * BLOCK + 3)]
    calls = [prompts_with_prefix(prefix, [rng.randint(1, 6) for _ in range(2)], rng) for _ in range(2)]
    refs, outs, stats = reference_and_cached(model, calls, max_new_tokens=5, **mode)
    for ref, out in zip(refs, outs):
        assert torch.equal(seq(ref), seq(out))
    if "prefill_chunk_size" in mode and not chunked_prefill_continues():     # transformers 5.17: no hits
        assert stats[1]["prefix_hit_tokens"] == 0
    else:
        assert stats[1]["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_assisted_and_prompt_lookup_decoding_keep_working(mode):
    """Candidate generators feed their first forward the whole prompt whatever the cache holds, so these
    calls take no hits (nor do they lose any token); other calls still commit and hit."""
    rng = random.Random(9)
    model = make_model("qwen3", seed=14)
    prefix = [rng.randrange(3, VOCAB) for _ in range(2 * BLOCK + 1)] + [5, 6, 7, 8, 5, 6, 7]
    if mode == "assistant":
        assistant = make_model("qwen3", seed=15, num_hidden_layers=1)
        assistant.generation_config.num_assistant_tokens_schedule = "constant"    # no state across calls
        extra = dict(assistant_model=assistant)
    else:
        extra = dict(prompt_lookup_num_tokens=3)
    for call in [prompts_with_prefix(prefix, [n], rng) for n in (2, 3)]:                  # one reference each, with a fresh assistant state
        torch.manual_seed(0)
        ref = model.generate(input_ids=call[0], attention_mask=call[1], max_new_tokens=10, do_sample=False, **extra)
        with patched(model, block_size=BLOCK, enable_prefix_caching=True):
            model.generate(input_ids=call[0], attention_mask=call[1], max_new_tokens=2, cache_implementation="paged")
            torch.manual_seed(0)
            out = model.generate(input_ids=call[0], attention_mask=call[1], max_new_tokens=10, do_sample=False,
                                 cache_implementation="paged", **extra)
            assert hf_paged.last_stats(model)["prefix_hit_tokens"] == 0
        assert torch.equal(ref, out)


def test_evictions_under_a_small_budget_keep_tokens_and_the_budget():
    """A budget of 4 blocks: each new prefix evicts the last one's blocks; tokens never change."""
    rng = random.Random(3)
    model = make_model("qwen2", seed=5)
    per_block = hf_paged.PagedCache(model.config, block_size=BLOCK).bytes_per_token * BLOCK
    budget = 4 * per_block
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(3 * BLOCK)] for _ in range(3)]
    calls = [prompts_with_prefix(prefixes[i % 3], [2, 5], rng) for i in range(6)]
    refs, outs, stats = reference_and_cached(model, calls, max_new_tokens=4, do_sample=False,
                                             patch=dict(prefix_cache_bytes=budget))
    for ref, out in zip(refs, outs):
        assert torch.equal(ref, out)
    with patched(model, block_size=BLOCK, enable_prefix_caching=True, prefix_cache_bytes=budget):
        model.generate(input_ids=calls[0][0], attention_mask=calls[0][1], cache_implementation="paged",
                       max_new_tokens=2, do_sample=False)
        store = model._hf_paged.prefix_store
        assert store.pool_bytes <= budget and store.pool.num_blocks == 4
        assert store.pool.evictions == 0 and store.index.num_hashed == 3
    assert all(s["prefix_hit_tokens"] == 0 for s in stats)       # 3 prefixes x 3 blocks never fit in 4


def test_off_by_default():
    model = make_model("glm", seed=6)
    ids, mask = prompts_with_prefix([5] * (2 * BLOCK), [3, 4], random.Random(0))
    with patched(model, block_size=BLOCK):
        for _ in range(2):
            model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", max_new_tokens=2)
        assert model._hf_paged.prefix_store is None
        assert hf_paged.last_stats(model)["prefix_query_tokens"] == 0


def test_continuation_from_a_cache_that_started_with_hits():
    """A call that started from cached columns returns a cache that continues like DynamicCache (new
    left-padded text appended after the first answer: pads in the middle)."""
    from transformers import DynamicCache

    rng = random.Random(5)
    model = make_model("glm", seed=6)
    ids, mask = prompts_with_prefix([rng.randrange(3, VOCAB) for _ in range(2 * BLOCK)], [3, 4], rng)
    turn2, mask2 = make_batch([3, 1], seed=25)
    kw = dict(do_sample=False, eos_token_id=None)

    def two_turns(**first_kw):
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True,
                               **first_kw, **kw)
        full_ids = torch.cat([first.sequences, turn2], dim=1)
        full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype), mask2], dim=1)
        second = model.generate(input_ids=full_ids, attention_mask=full_mask, max_new_tokens=6,
                                past_key_values=first.past_key_values, **kw)
        return first.past_key_values, second

    _, reference = two_turns(past_key_values=DynamicCache(config=model.config))
    with patched(model, block_size=BLOCK, enable_prefix_caching=True):
        model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", max_new_tokens=1)
        cache, second = two_turns(cache_implementation="paged")
        # the common cached columns C = 16: row 0 (1 pad) reuses 15 tokens, row 1 all 16
        assert cache.stats()["prefix_hit_tokens"] == 31
    assert torch.equal(reference, second)


def test_prefix_cache_options_are_checked():
    model = make_model("llama")
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        hf_paged.patch(model, prefix_cache_bytes=2**20)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        hf_paged.patch(model, enable_prefix_caching=True, prefix_cache_bytes=10)


LONGROPE = dict(max_position_embeddings=64, rope_parameters=dict(
    rope_type="longrope", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
    short_factor=[1.0] * 32, long_factor=[2.0 + 0.1 * i for i in range(32)]))


def test_length_dependent_rope_reuses_no_block_across_frequency_sets():
    """Longrope switches every position's frequencies once a forward's longest position passes 16: blocks
    computed in a call whose prompts pass it are neither stored nor reused; calls within it hit as usual.
    Each call equals the default path on the same call."""
    rng = random.Random(5)
    model = make_model("llama", seed=1, **LONGROPE)
    prefix = [rng.randrange(3, VOCAB) for _ in range(BLOCK)]
    long_call = prompts_with_prefix(prefix, [2, 14], rng)               # 22 columns: the long factors
    short_calls = [prompts_with_prefix(prefix, [3, 1], rng) for _ in range(2)]     # 11 and 9: the short ones
    refs, outs, stats = reference_and_cached(model, [long_call, *short_calls], max_new_tokens=4, do_sample=False,
                                             return_dict_in_generate=True, output_logits=True)
    for ref, out in zip(refs, outs):
        assert torch.equal(ref.sequences, out.sequences)
        for a, b in zip(ref.logits, out.logits):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert stats[0]["prefix_hit_tokens"] == 0 and stats[1]["prefix_hit_tokens"] == 0   # nothing stored by call 0
    assert stats[2]["prefix_hit_tokens"] > 0                                          # call 1's blocks serve call 2


def two_rows_with_a_prefix(seed: int):
    """A tiny Llama and greedy generate kwargs for two rows that share a 3-block prefix: (model, prefix, kwargs)."""
    rng = random.Random(seed)
    model = make_model("llama", seed=3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(3 * BLOCK)]
    ids, mask = prompts_with_prefix(prefix, [2, 5], rng)
    return model, prefix, dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True, output_logits=True)


def test_new_weights_empty_the_store():
    """Blocks stored under other weights (load_state_dict, a dtype round trip) are never served."""
    model, _, kw = two_rows_with_a_prefix(9)
    other = make_model("llama", seed=4)
    with patched(model, block_size=BLOCK, enable_prefix_caching=True):
        model.generate(cache_implementation="paged", **kw)
        model.generate(cache_implementation="paged", **kw)
        assert hf_paged.last_stats(model)["prefix_hit_tokens"] > 0          # same weights: hits
        for change in (lambda: model.load_state_dict(other.state_dict()),
                       lambda: model.to(torch.bfloat16).to(torch.float32)):
            change()
            got = model.generate(cache_implementation="paged", **kw)
            assert hf_paged.last_stats(model)["prefix_hit_tokens"] == 0
            ref = model.generate(**kw)                                      # the default path
            assert torch.equal(got.sequences, ref.sequences)
            for a, b in zip(ref.logits, got.logits):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", ["data_write", "told"])
def test_weights_changed_without_a_version_bump_empty_the_store(change):
    """A write through ``p.data`` (EMA, PEFT's merge) bumps no version counter: the sampled values see it; a
    change too sparse for them is told with ``hf_paged.weights_changed(model)``. No stale hit either way."""
    model, prefix, kw = two_rows_with_a_prefix(9)
    with patched(model, block_size=BLOCK, enable_prefix_caching=True):
        model.generate(cache_implementation="paged", **kw)
        if change == "data_write":
            for p in model.parameters():
                p.data.mul_(-1.5)
        else:
            model.get_input_embeddings().weight.data[prefix[:4]] *= -3
            hf_paged.weights_changed(model)
        got = model.generate(cache_implementation="paged", **kw)
        assert hf_paged.last_stats(model)["prefix_hit_tokens"] == 0
        ref = model.generate(**kw)
        assert torch.equal(got.sequences, ref.sequences)
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_a_commit_that_fails_loses_only_the_caching(monkeypatch):
    """A failure while the store copies a prefill's blocks in (an out-of-memory error, Ctrl-C) must not leave
    their hashes published: later calls would hit blocks never filled and generate from garbage K/V."""
    from hf_paged.cache import prefix_store
    model, _, kw = two_rows_with_a_prefix(5)
    ref = model.generate(**kw)
    real_copy, failures = prefix_store.copy_blocks_between, [RuntimeError("out of memory (simulated)")]

    def copy_failing_once(src, dst, src_blocks, dst_blocks):
        if isinstance(dst, prefix_store.PrefixStore) and src_blocks and failures:
            raise failures.pop()
        return real_copy(src, dst, src_blocks, dst_blocks)

    monkeypatch.setattr(prefix_store, "copy_blocks_between", copy_failing_once)
    with patched(model, block_size=BLOCK, enable_prefix_caching=True):
        with pytest.raises(RuntimeError, match="simulated"):
            model.generate(cache_implementation="paged", **kw)
        store = model._hf_paged.prefix_store
        store.check_invariants()
        assert store.pool.num_used == 0 and store.index.num_hashed == 0
        for call in range(2):           # the first stores the blocks again, the second hits them
            got = model.generate(cache_implementation="paged", **kw)
            assert torch.equal(got.sequences, ref.sequences), call
            for a, b in zip(ref.logits, got.logits):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
            assert (hf_paged.last_stats(model)["prefix_hit_tokens"] > 0) == (call == 1)
        store.check_invariants()


def test_a_call_with_its_own_position_ids_takes_no_prefix():
    """The store matches tokens only; its blocks hold keys rotated at the positions of the call that wrote them.
    A call that gives position_ids (here 37..56, the same tokens) is served without it: the default path's tokens."""
    model = make_model("qwen3", seed=1, initializer_range=0.2)
    prompt = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    mask, positions = torch.ones_like(prompt), torch.arange(20).expand(2, 20) + 37
    kw = dict(input_ids=prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
    reference = model.generate(position_ids=positions, **kw)
    with patched(model, enable_prefix_caching=True, block_size=4):
        model.generate(cache_implementation="paged", **kw)                  # fills the store at positions 0..19
        out = model.generate(position_ids=positions, cache_implementation="paged", **kw)
        assert hf_paged.last_stats(model)["prefix_hit_tokens"] == 0
        model.generate(cache_implementation="paged", **kw)
        assert hf_paged.last_stats(model)["prefix_hit_tokens"] > 0           # the store is still used otherwise
    assert torch.equal(out, reference)
