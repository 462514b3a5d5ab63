"""PagedCache memory accounting, sharing, release of finished rows, exhaustion and bad input."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import hf_paged
from tiny_models import PAD, make_batch, make_model, patched
from hf_paged import torch_attention
from hf_paged.integrations.families import UnsupportedModelError

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
    cache.allocator.check_invariants()


def test_beam_search_peak_kv_at_most_half_of_dynamic_cache():
    model = make_model("qwen2")
    ids, mask = make_batch([200, 230], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, num_beams=4,
              do_sample=False, return_dict_in_generate=True)
    reference = model.generate(**kw)
    with patched(model):
        cache = hf_paged.PagedCache(model.config)
        paged = model.generate(past_key_values=cache, **kw)
    assert torch.equal(reference.sequences, paged.sequences)
    dynamic = dynamic_kv_bytes(reference.past_key_values)
    peak = cache.stats()["peak_kv_bytes_reserved"]
    print(f"beam-4 peak KV: paged {peak} B, DynamicCache {dynamic} B ({peak / dynamic:.1%})")
    assert peak <= 0.5 * dynamic


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
    assert max(cache.allocator.refcounts) == 4


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
    cache.allocator.check_invariants()
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
        cache.allocator.check_invariants()
        held = sum(len(t.blocks) for t in cache.allocator.tables.values())
        assert cache.allocator.num_used <= held
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
        with pytest.raises(hf_paged.PoolExhaustedError, match="One sequence of 40 tokens"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
        cache.allocator.check_invariants()
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
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(UnsupportedModelError, match="model_type='mistral'.*glm, glm4, llama, qwen2, qwen3"):
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


class BidirectionalPrefill:
    """A deliberately wrong backend: prompt tokens see the whole prompt (no causal mask), as a
    paged path that forgot per-sequence causality would."""
    write_kv = staticmethod(torch_attention.write_kv)
    copy_blocks = staticmethod(torch_attention.copy_blocks)
    decode_attention = staticmethod(torch_attention.decode_attention)

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
                               past_key_values=hf_paged.PagedCache(model.config, backend=BidirectionalPrefill))
    assert torch.equal(right.sequences, reference.sequences)
    assert (wrong.logits[0] - reference.logits[0]).abs().max() > 1e-3
    assert not torch.equal(wrong.sequences, reference.sequences)
