"""PagedCache memory accounting, sharing, release of finished rows, exhaustion and bad input."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import hf_paged
import hf_paged.blocks
from tiny_models import PAD, make_batch, make_model, patched
from hf_paged.backends import torch_backend as torch_attention
from hf_paged.families import UnsupportedModelError

LENGTHS = [7, 1, 12, 4]


def dynamic_kv_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def test_pads_are_never_stored():
    model = make_model("llama")
    ids, mask = make_batch(LENGTHS, seed=1)
    new = 6
    with patched(model):
        cache = hf_paged.PagedCache(model.config, block_size=4)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                       eos_token_id=None, past_key_values=cache)
    stats = cache.stats()
    # the last generated token is never fed back, so each row stores prompt + new - 1 tokens
    assert stats["tokens_stored"] == sum(LENGTHS) + len(LENGTHS) * (new - 1)
    assert stats["blocks_used"] == sum(-(-(n + new - 1) // 4) for n in LENGTHS)
    assert stats["kv_bytes_used"] == stats["tokens_stored"] * stats["bytes_per_token"]
    assert stats["kv_bytes_reserved"] == stats["blocks_used"] * 4 * stats["bytes_per_token"]
    cache.check_invariants()


def beam_search_both(model, lengths, seed, beams, new_tokens):
    """(DynamicCache bytes, the PagedCache) of the same beam search, whose tokens must be equal."""
    ids, mask = make_batch(lengths, seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              num_beams=beams, do_sample=False, return_dict_in_generate=True)
    reference = model.generate(**kw)
    with patched(model):
        cache = hf_paged.PagedCache(model.config)
        paged = model.generate(past_key_values=cache, **kw)
    assert torch.equal(reference.sequences, paged.sequences)
    return dynamic_kv_bytes(reference.past_key_values), cache


def test_beam_search_peak_kv_at_most_half_of_dynamic_cache():
    dynamic, cache = beam_search_both(make_model("qwen2"), [200, 230], seed=2, beams=4, new_tokens=32)
    peak = cache.stats()["peak_kv_bytes_reserved"]
    allocated = cache.stats()["kv_bytes_allocated"]
    print(f"beam-4 peak KV: paged {peak} B (allocated {allocated} B), DynamicCache {dynamic} B ({peak / dynamic:.1%})")
    assert peak <= 0.5 * dynamic
    assert allocated <= dynamic


def test_num_return_sequences_stores_prompt_once():
    model = make_model("glm")
    ids, mask = make_batch([40, 21], seed=3)
    with patched(model):
        cache = hf_paged.PagedCache(model.config, block_size=16)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=True,
                       num_return_sequences=4, past_key_values=cache)
    # only the prefill ran: each prompt's blocks are held once, shared by its 4 rows
    assert cache.stats()["blocks_used"] == -(-40 // 16) + -(-21 // 16)
    assert cache.stats()["tokens_stored"] == 40 + 21
    assert max(cache.pool.refcounts) == 4


class RecordBlocks(StoppingCriteria):
    def __init__(self, cache):
        self.cache, self.used = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.used.append(self.cache.stats()["blocks_used"])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_finished_rows_release_blocks():
    model = make_model("llama", seed=4)
    ids, mask = make_batch([9, 3, 14, 6], seed=5)
    probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    generated = probe[:, ids.shape[1]:]
    eos = sorted({generated[0, 2].item(), generated[2, 8].item()})   # rows 0 and 2 stop early
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               eos_token_id=eos, pad_token_id=PAD)
    with patched(model):
        cache = hf_paged.PagedCache(model.config, block_size=2)
        recorder = RecordBlocks(cache)
        paged = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               eos_token_id=eos, pad_token_id=PAD, past_key_values=cache,
                               stopping_criteria=StoppingCriteriaList([recorder]))
    assert torch.equal(reference, paged)
    drops = [b for a, b in zip(recorder.used, recorder.used[1:]) if b < a]
    assert drops, f"blocks in use never fell as rows finished: {recorder.used}"
    cache.check_invariants()
    with patched(model):
        keep_all = hf_paged.PagedCache(model.config, block_size=2, release_finished_rows=False)
        kept = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              eos_token_id=eos, pad_token_id=PAD, past_key_values=keep_all)
    assert torch.equal(kept, paged)
    assert cache.stats()["blocks_used"] < keep_all.stats()["blocks_used"]
    assert cache.stats()["peak_blocks_used"] < keep_all.stats()["peak_blocks_used"]


def test_pool_exhaustion_is_clear_and_leaves_no_leak():
    model = make_model("llama")
    ids, mask = make_batch(LENGTHS, seed=6)
    with patched(model):
        cache = hf_paged.PagedCache(model.config, block_size=4, num_blocks=8)
        with pytest.raises(hf_paged.PoolExhaustedError, match=r"needs \d+ more blocks.*free.*num_blocks"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                           eos_token_id=None, past_key_values=cache)
        cache.check_invariants()
        held = sum(len(t.blocks) for t in cache.rows.tables)
        assert cache.pool.num_used <= held
        cache.reset()
        assert cache.stats()["blocks_used"] == 0
        ids, mask = make_batch([6, 2, 9], seed=13)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             eos_token_id=None, past_key_values=cache)
        again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               eos_token_id=None, cache_implementation="paged")
    assert torch.equal(out, again)
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                           do_sample=False, eos_token_id=None))


def test_budget_too_small_for_one_sequence():
    model = make_model("llama")
    ids, mask = make_batch([40], seed=7)
    per_block = hf_paged.PagedCache(model.config, block_size=4).bytes_per_token * 4
    with patched(model):
        cache = hf_paged.PagedCache(model.config, block_size=4, max_memory_bytes=3 * per_block)
        with pytest.raises(hf_paged.PoolExhaustedError, match="one sequence needs 10 blocks of 4 tokens but the whole "
                           "pool holds 3.*One sequence of 40 tokens"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
        cache.check_invariants()
        assert cache.stats()["blocks_used"] == 0


def test_growable_pool_grows_and_matches():
    model = make_model("qwen3")
    ids, mask = make_batch([100, 90, 80], seed=8)
    with patched(model):
        # starts at the prefill's need + 2 blocks per row (276 blocks of 1 token): decoding must grow it
        cache = hf_paged.PagedCache(model.config, block_size=1)
        paged = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                               past_key_values=cache)
    assert cache.stats()["blocks_total"] > 270 + 2 * 3
    assert torch.equal(paged, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size must be an int in 1..1024"),
    (dict(block_size=2048), "block_size must be an int in 1..1024"),
    (dict(block_size="16"), "block_size must be an int"),
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(max_memory_bytes=-5), "max_memory_bytes must be positive"),
    (dict(max_memory_bytes=100, dtype=torch.float32), "holds no block.*Raise max_memory_bytes"),
    (dict(num_blocks=4, max_memory_bytes=10**6), "not both"),
])
def test_invalid_cache_options(kwargs, message):
    model = make_model("llama")
    with pytest.raises(ValueError, match=message):
        hf_paged.PagedCache(model.config, **kwargs)


def test_unsupported_model_type_is_named():
    from transformers import Phi3Config, Phi3ForCausalLM

    model = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, pad_token_id=0))
    with pytest.raises(UnsupportedModelError, match="model_type='phi3'.*glm, glm4, granite, llama, mistral"):
        hf_paged.patch(model)
    with pytest.raises(UnsupportedModelError):
        hf_paged.PagedCache(model.config)
    assert not hf_paged.is_patched(model)


def test_dtype_and_device_mixes_are_refused():
    model = make_model("llama")
    ids, mask = make_batch([5], seed=9)
    with patched(model):
        with pytest.raises(TypeError, match="float32 keys.*pool is torch.float16"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                           past_key_values=hf_paged.PagedCache(model.config, dtype=torch.float16))
        with pytest.raises(TypeError, match="on cpu but the KV pool is .* on meta"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                           past_key_values=hf_paged.PagedCache(model.config, device="meta"))


def test_paged_cache_without_patch_is_explained():
    model = make_model("llama")
    ids, mask = make_batch([5], seed=10)
    with pytest.raises(RuntimeError, match=r"hf_paged.patch\(model\)"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                       past_key_values=hf_paged.PagedCache(model.config))


class BidirectionalPrefill(torch_attention.TorchBackend):
    """A deliberately wrong backend: prompt tokens see the whole prompt (no causal mask), as a
    paged path that forgot per-sequence causality would."""

    @staticmethod
    def extend_attention(query, k_pool, v_pool, block_tables, context_lens, query_pos, *args, **kwargs):
        last = (context_lens.long() - 1).unsqueeze(1).to(query_pos.dtype)
        wrong_pos = torch.where(query_pos >= 0, last.expand_as(query_pos), query_pos)
        return torch_attention.extend_attention(query, k_pool, v_pool, block_tables, context_lens, wrong_pos,
                                                *args, **kwargs)


def test_negative_control_wrong_backend_fails_the_comparison():
    model = make_model("llama", seed=11)
    ids, mask = make_batch(LENGTHS, seed=12)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               return_dict_in_generate=True, output_logits=True)
    with patched(model):
        right = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               return_dict_in_generate=True, output_logits=True,
                               past_key_values=hf_paged.PagedCache(model.config))
        wrong = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               return_dict_in_generate=True, output_logits=True,
                               past_key_values=hf_paged.PagedCache(model.config, backend=BidirectionalPrefill()))
    assert torch.equal(right.sequences, reference.sequences)
    assert (wrong.logits[0] - reference.logits[0]).abs().max() > 1e-3
    assert not torch.equal(wrong.sequences, reference.sequences)


# ---------------------------------------------------------------- issue 10: continuation after finished rows
def _eos_for_rows_0_and_2(model, ids, mask):
    """EOS ids that make rows 0 and 2 stop early (their 3rd and 5th greedy tokens)."""
    probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    new = probe[:, ids.shape[1]:]
    eos = sorted({new[0, 2].item(), new[2, 4].item()})
    assert not any(t in eos for t in new[1].tolist() + new[3].tolist()), "pick another seed: rows 1/3 would stop"
    return eos


@pytest.mark.parametrize("chunk", [1, 2, None])
def test_an_eos_inside_the_prompt_finishes_nothing(chunk):
    """Only an EOS generate sampled ends a row: EOS tokens inside prompts (1-token prefill chunks, a prompt's
    last token fed alone by generate's loop, pad == EOS) are computed and stored like any other token."""
    model = make_model("llama", seed=31)
    ids, mask = make_batch([9, 6, 12], seed=32)
    eos = int(ids[0, -4])
    ids[1, -1] = eos                                    # a prompt that ends with EOS
    ids[2, -7] = eos                                    # and one with EOS inside
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos,
              pad_token_id=PAD if chunk != 2 else eos, prefill_chunk_size=chunk, return_dict_in_generate=True,
              output_logits=True)
    reference = model.generate(**kw)
    with patched(model):
        paged = model.generate(cache_implementation="paged", **kw)
    assert torch.equal(paged.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(reference.logits, paged.logits)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=f"logits differ at step {step}")


@pytest.mark.parametrize("rope", [
    dict(rope_type="dynamic", rope_theta=10000.0, factor=8.0),
    dict(rope_type="longrope", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
         short_factor=[1.0] * 32, long_factor=[2.0 + 0.1 * i for i in range(32)])], ids=["dynamic", "longrope"])
def test_length_dependent_rope_keeps_finished_rows_in_the_forward(rope):
    """Dynamic-NTK and longrope frequencies follow each forward's longest position; the default path's finished
    rows keep theirs growing. The longest row finishing first (its first token is EOS) must not switch the
    other rows back to the short-context frequencies: tokens and logits equal the default path's."""
    overrides = dict(max_position_embeddings=32 if rope["rope_type"] == "dynamic" else 64, rope_parameters=rope)
    ids, mask = make_batch([6, 14, 48], seed=42)

    def fresh(eos=None):                 # dynamic NTK keeps grown frequencies between calls: a new model each time
        model = make_model("llama", seed=41, **overrides)
        model.generation_config.eos_token_id = eos
        return model

    eos = int(fresh().generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)[2, -1])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    reference = fresh(eos).generate(**kw)
    assert reference.sequences[2, ids.shape[1]] == eos and (reference.sequences[:2, ids.shape[1]:] != eos).all()
    model = fresh(eos)
    with patched(model):
        paged = model.generate(cache_implementation="paged", **kw)
    assert torch.equal(paged.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(reference.logits, paged.logits)):
        torch.testing.assert_close(b[:2], a[:2], atol=1e-5, rtol=0, msg=f"logits differ at step {step}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm"])
def test_continuation_after_finished_rows_equals_dynamic_cache(family):
    model = make_model(family, seed=21)
    ids, mask = make_batch([9, 5, 12, 7], seed=22)
    eos = _eos_for_rows_0_and_2(model, ids, mask)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True)
    turn2 = torch.randint(3, 200, (4, 3), generator=torch.Generator().manual_seed(23))
    first_ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert (first_ref.sequences[[0, 2], -1] == PAD).all() and (first_ref.sequences[[1, 3], -1] != PAD).all()
    second_ref = model.generate(input_ids=torch.cat([first_ref.sequences, turn2], 1),
                                past_key_values=first_ref.past_key_values, **kw)
    with patched(model):
        first = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", **kw)
        assert torch.equal(first.sequences, first_ref.sequences)
        cache = first.past_key_values
        assert isinstance(cache, hf_paged.PagedCache) and any(cache.rows.finished)
        second = model.generate(input_ids=torch.cat([first.sequences, turn2], 1), past_key_values=cache, **kw)
        cache.check_invariants()
    assert torch.equal(second.sequences, second_ref.sequences)


def test_continuation_that_cannot_be_served_names_the_row():
    model = make_model("llama", seed=21)
    ids, mask = make_batch([9, 5, 12, 7], seed=22)
    eos = _eos_for_rows_0_and_2(model, ids, mask)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True)
    turn2 = torch.randint(3, 200, (4, 3), generator=torch.Generator().manual_seed(23))
    with patched(model):
        # The mask marks the columns a finished row never computed as real: refused, naming row 0.
        first = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", **kw)
        full = torch.cat([first.sequences, turn2], 1)
        ones = torch.cat([mask, torch.ones(4, full.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        with pytest.raises(ValueError, match=r"row 0 ended with EOS.*release_finished_rows=False"):
            model.generate(input_ids=full, attention_mask=ones, past_key_values=first.past_key_values, **kw)
        # The same continuation from a cache that kept finished rows equals DynamicCache's.
        keep = model.generate(input_ids=ids, attention_mask=mask, **kw,
                              past_key_values=hf_paged.PagedCache(model.config, release_finished_rows=False))
        got = model.generate(input_ids=full, attention_mask=ones, past_key_values=keep.past_key_values, **kw)
        # That cache stored the pads after row 0's EOS as real (the first call's mask marked them); a
        # continuation whose mask now masks them (generate infers it) drops them, as DynamicCache's mask hides them.
        kept = model.generate(input_ids=ids, attention_mask=mask, **kw,
                              past_key_values=hf_paged.PagedCache(model.config, release_finished_rows=False))
        inferred = model.generate(input_ids=full, past_key_values=kept.past_key_values, **kw)
        # A stored token masked in the middle of a row (real columns after it) cannot be dropped: refused.
        kept = model.generate(input_ids=ids, attention_mask=mask, **kw,
                              past_key_values=hf_paged.PagedCache(model.config, release_finished_rows=False))
        holed = ones.clone()
        holed[1, -8] = 0
        with pytest.raises(ValueError, match=r"row 1: column \d+ was stored as a real token.*release_finished_rows="
                                             r"True \(the default\)"):
            model.generate(input_ids=full, attention_mask=holed, past_key_values=kept.past_key_values, **kw)
        # Blocks reclaimed by the pool before the continuation: refused, naming the row.
        first = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", **kw)
        cache = first.past_key_values
        hog = hf_paged.blocks.BlockTable()
        hog.append(cache.pool, cache.pool.num_free * cache.block_size, [])
        with pytest.raises(ValueError, match=r"row 0 ended with EOS.*reused by other rows"):
            model.generate(input_ids=full, past_key_values=cache, **kw)
    ref_first = model.generate(input_ids=ids, attention_mask=mask, **kw)
    ref = model.generate(input_ids=full, attention_mask=ones, past_key_values=ref_first.past_key_values, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    ref_first = model.generate(input_ids=ids, attention_mask=mask, **kw)
    ref = model.generate(input_ids=full, past_key_values=ref_first.past_key_values, **kw)
    assert torch.equal(inferred.sequences, ref.sequences)


# ---------------------------------------------------------------- issue 10: growable pool under beam search
@pytest.mark.parametrize("beams", [4, 8])
def test_growable_pool_allocates_less_than_dynamic_cache_under_beam_search(beams):
    dynamic, cache = beam_search_both(make_model("llama", seed=24), [32, 32], seed=25, beams=beams, new_tokens=12)
    allocated = cache.stats()["kv_bytes_allocated"]
    print(f"beam-{beams}: paged allocated {allocated} B, DynamicCache {dynamic} B ({allocated / dynamic:.1%})")
    assert allocated < dynamic        # 149% before the pool was sized from what is stored (issue 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_device_without_a_gpu_fails_at_construction():
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"device='cuda'.*no CUDA device.*device='cpu'"):
        hf_paged.PagedCache(model.config, device="cuda")


def _chat_turns(model, cache, mask_kind, ids, mask, turn2, pad):
    """Two turns over one cache; the second's mask built as a user would (``gen != pad``), or none in both."""
    first = model.generate(input_ids=ids, attention_mask=None if mask_kind == "none" else mask, past_key_values=cache,
                           max_new_tokens=6, do_sample=False)
    gen = first[:, ids.shape[1]:]
    full = torch.cat([first, turn2], 1)
    if mask_kind == "none":
        return model.generate(input_ids=full, past_key_values=cache, max_new_tokens=5, do_sample=False)
    full_mask = torch.cat([mask, (gen != pad).long(), torch.ones_like(turn2)], 1)
    return model.generate(input_ids=full, attention_mask=full_mask, past_key_values=cache, max_new_tokens=5,
                          do_sample=False)


@pytest.mark.parametrize("mask_kind", ["gen != pad", "none"])
def test_continuation_when_pad_is_eos(mask_kind):
    """pad == EOS (SmolLM2, Llama 3): the obvious continuation mask ``gen != pad`` also masks the EOS a finished
    row stored; the row drops it, as DynamicCache's mask hides it (it was refused, advising the default)."""
    model = make_model("llama", seed=3)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 166    # row 2's 2nd token
    ids, mask = make_batch([5, 9, 2], seed=4)
    turn2 = torch.randint(3, 150, (3, 3), generator=torch.Generator().manual_seed(1))
    ref = _chat_turns(model, DynamicCache(config=model.config), mask_kind, ids, mask, turn2, 166)
    with patched(model):
        cache = hf_paged.PagedCache(model.config)
        got = _chat_turns(model, cache, mask_kind, ids, mask, turn2, 166)
        cache.check_invariants()
    if mask_kind != "none":
        assert (ref[2, ids.shape[1]:ids.shape[1] + 6] == 166).sum() > 1      # row 2 finished early, padded
    assert torch.equal(got, ref)


def test_crop_into_a_finished_row_regenerates():
    """'Regenerate the answer': crop back into the prompt of a batch whose row 2 finished early, generate again:
    the finished row's stored prefix is kept (crop refused it, saying its blocks were reused)."""
    model = make_model("llama", seed=3)
    ids, mask = make_batch([5, 9, 2], seed=4)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=[166])

    def regenerate(cache):
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **settings)
        cache.crop(ids.shape[1] - 1 - cache.get_seq_length())
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **settings)

    ref = regenerate(DynamicCache(config=model.config))
    with patched(model):
        cache = hf_paged.PagedCache(model.config, num_blocks=64)
        got = regenerate(cache)
        cache.check_invariants()
    assert torch.equal(got, ref)


def test_misuses_are_named():
    """Right padding, a DynamicCache beside cache_implementation='paged' and a cache built for another model:
    each a ValueError naming it (a pad token first, an AttributeError, an IndexError before); nothing left broken."""
    model = make_model("llama", seed=3)
    ids, mask = make_batch([5, 9], seed=4)
    right_ids, right_mask = ids.flip(1), mask.flip(1)
    with patched(model):
        with pytest.raises(ValueError, match="row 0 of the batch is right-padded.*padding_side"):
            model.generate(input_ids=right_ids, attention_mask=right_mask, max_new_tokens=2,
                           cache_implementation="paged")
        with pytest.raises(ValueError, match="row 0 of the batch is right-padded"):
            model.generate(input_ids=right_ids, max_new_tokens=2, pad_token_id=PAD, eos_token_id=1,
                           cache_implementation="paged")
        with pytest.raises(ValueError, match="cache_implementation='paged' and a DynamicCache were both passed"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation="paged",
                           past_key_values=DynamicCache(config=model.config))
        other = make_model("llama", seed=3, num_hidden_layers=3)
        with pytest.raises(ValueError, match="built for 3 layers .* this model has 2 x"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                           past_key_values=hf_paged.PagedCache(other.config, block_size=4).__class__(
                               other.config, block_size=4, geometry=hf_paged.model_geometry(other)))
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             cache_implementation="paged")
    assert torch.equal(got, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False))


def test_batch_selection_repetition_and_crop_as_dynamic_cache():
    """batch_select_indices / batch_repeat_interleave (rows kept or repeated by block-table forks) and crop past the
    length (empties, as DynamicCache; it went negative) or of an unused cache (a no-op; an AttributeError), then a
    continuation on each: the same tokens as DynamicCache (before, selection and repetition did nothing)."""
    model = make_model("llama", seed=31)
    ids, mask = make_batch([6, 9, 4], seed=32)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD, eos_token_id=[], return_dict_in_generate=True)
    operations = [("batch_select_indices", torch.tensor([2, 0])),
                  ("batch_select_indices", torch.tensor([True, False, True])), ("batch_repeat_interleave", 2)]
    with patched(model):
        for name, argument in operations:
            results = []
            for cache in (DynamicCache(config=model.config), hf_paged.PagedCache(model.config, num_blocks=64)):
                first = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
                getattr(cache, name)(argument)
                rows = torch.arange(3).repeat_interleave(2) if name == "batch_repeat_interleave" else \
                    torch.as_tensor(argument).nonzero().flatten() if argument.dtype == torch.bool else argument
                more = torch.randint(3, 200, (len(rows), 2), generator=torch.Generator().manual_seed(33))
                sequences = torch.cat([first.sequences[rows], more], 1)
                mask2 = torch.cat([mask[rows], torch.ones(len(rows), sequences.shape[1] - mask.shape[1],
                                                          dtype=mask.dtype)], 1)
                results.append(model.generate(input_ids=sequences, attention_mask=mask2, past_key_values=cache,
                                              **kw).sequences)
                if isinstance(cache, hf_paged.PagedCache):
                    cache.check_invariants()
            assert torch.equal(results[0], results[1]), name
        cache = hf_paged.PagedCache(model.config, num_blocks=64)
        cache.crop(-1)                                        # unused: nothing to drop
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
        cache.crop(-100)
        assert cache.get_seq_length() == 0
        cache.check_invariants()


def test_a_cache_deep_copies_but_refuses_pickling_clearly():
    import copy
    import pickle
    model = make_model("llama")
    ids, mask = make_batch([9, 6], seed=4)
    with patched(model):
        cache = hf_paged.PagedCache(model.config, block_size=4)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, past_key_values=cache)
        clone = copy.deepcopy(cache)
    assert clone.stats() == cache.stats()
    assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b)
               for a, b in zip(clone.pool_tensors(), cache.pool_tensors()))
    with pytest.raises(TypeError, match="a PagedCache cannot be pickled.*copy.deepcopy"):
        pickle.dumps(cache)
