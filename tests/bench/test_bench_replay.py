"""bench/replay.py drives PagedCache on the meta device with the calls generate makes. These tests prove
the replay faithful: a real ``generate`` on a tiny model with the same lengths gives the same
``stats()`` after every forward (padded greedy batch, rows ending at different steps) and the same
per-event stats for a recorded beam search."""
from __future__ import annotations

import warnings

import torch
from transformers import LogitsProcessorList, StoppingCriteria

import hf_paged
from bench import replay
from bench.engines import ForceLengths
from tiny_models import EOS, PAD, make_batch, make_model, patched

KEYS = ("blocks_used", "tokens_stored", "blocks_total")


class StatsProbe(StoppingCriteria):
    def __init__(self, cache):
        self.cache, self.samples = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        s = self.cache.stats()
        self.samples.append({k: s[k] for k in KEYS})
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _generate(model, cache, ids, mask, **kwargs):
    with patched(model), torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                              pad_token_id=PAD, eos_token_id=EOS, **kwargs)


def test_padded_replay_equals_real_generate():
    model = make_model("llama")
    prompts, outputs = [5, 17, 1, 23, 12], [3, 12, 7, 1, 12]
    ids, mask = make_batch(prompts, seed=3)
    for block_size in (4,):     # small blocks: many block boundaries in few tokens
        cache = hf_paged.PagedCache(model.config, block_size=block_size)
        probe = StatsProbe(cache)
        out = _generate(model, cache, ids, mask, max_new_tokens=max(outputs), stopping_criteria=[probe],
                        logits_processor=LogitsProcessorList([ForceLengths(outputs, ids.shape[1], EOS)]))
        new = out[:, ids.shape[1]:]
        for row, n in enumerate(outputs):                 # lengths were enforced: EOS exactly at n
            assert (new[row, :n - 1] != EOS).all() and new[row, n - 1] == EOS
        rep = replay.replay_padded(model.config, prompts, outputs, block_size, eos=EOS, pad=PAD)
        assert rep["samples"] == probe.samples
        assert rep["stats"] == cache.stats()
        assert rep["stats"]["peak_blocks_used"] == cache.stats()["peak_blocks_used"] > 0
        # DynamicCache's columns after the last forward: max prompt + max new - 1
        assert rep["columns"] == cache.get_seq_length() == max(prompts) + max(outputs) - 1


def test_beam_replay_equals_real_beam_search():
    model = make_model("llama")
    ids, mask = make_batch([21], seed=5)
    for num_beams in (4,):
        cache = hf_paged.PagedCache(model.config, block_size=4)
        events = replay.record_events(cache)
        stats_after = []
        plan, reorder = cache.plan_step, cache.reorder_cache

        def plan_and_sample(*a, _plan=plan, **k):
            res = _plan(*a, **k)
            stats_after.append({key: cache.stats()[key] for key in KEYS})
            return res

        def reorder_and_sample(idx, _reorder=reorder):
            _reorder(idx)
            stats_after.append({key: cache.stats()[key] for key in KEYS})
        cache.plan_step, cache.reorder_cache = plan_and_sample, reorder_and_sample
        _generate(model, cache, ids, mask, num_beams=num_beams, max_new_tokens=8, min_new_tokens=8,
                  early_stopping=True)
        assert any(ev[0] == "reorder" and ev[1] != list(range(num_beams)) for ev in events)
        rep = replay.replay_events(model.config, events, block_size=4)
        assert rep["samples"] == stats_after
        assert rep["stats"] == cache.stats()
