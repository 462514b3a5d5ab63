"""patch / unpatch / the global opt-in, pipelines, and what importing hf_paged does (nothing)."""
from __future__ import annotations

import subprocess
import sys

import contextlib

import pytest
import torch
from transformers import DynamicCache, pipeline
from transformers.generation.utils import GenerationMixin

import hf_paged
from tiny_models import VOCAB, make_batch, make_model, patched, word_tokenizer


def test_import_changes_nothing_in_transformers():
    code = (
        "import transformers\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "from transformers.generation.utils import GenerationMixin\n"
        "before = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping), GenerationMixin.generate)\n"
        "import hf_paged, hf_paged.integrations.generate, hf_paged.families\n"
        "after = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping), GenerationMixin.generate)\n"
        "assert before == after, 'import hf_paged changed transformers'\n"
        "import sys; assert 'cupy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unpatch_restores_the_model_exactly():
    model = make_model("qwen2")
    decoder = model.get_decoder()
    before = (model.config._attn_implementation, "generate" in model.__dict__, dict(decoder._forward_pre_hooks), dict(decoder._forward_hooks),
              model.generation_config.to_dict())
    hf_paged.patch(model, default=True)
    assert hf_paged.is_patched(model) and model.generation_config.cache_implementation == "paged"
    assert model.config._attn_implementation == before[0]      # switched only during paged calls
    hf_paged.unpatch(model)
    after = (model.config._attn_implementation, "generate" in model.__dict__, dict(decoder._forward_pre_hooks), dict(decoder._forward_hooks),
             model.generation_config.to_dict())
    assert after == before
    assert not hf_paged.is_patched(model)
    hf_paged.patch(model, default=True)
    model.generation_config.cache_implementation = "static"     # the user's own choice while patched
    hf_paged.unpatch(model)
    assert model.generation_config.cache_implementation == "static"


def test_patched_model_keeps_its_own_path_for_other_calls():
    model = make_model("llama")
    ids, mask = make_batch([5, 3], seed=1)
    reference_logits = model(input_ids=ids, attention_mask=mask).logits
    with patched(model):
        plain = model(input_ids=ids, attention_mask=mask).logits      # plain forward, no cache
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)               # no "paged": DynamicCache
    torch.testing.assert_close(plain, reference_logits)
    assert isinstance(out.past_key_values, DynamicCache)


def test_plain_forwards_while_a_paged_call_runs_take_the_model_s_own_attention():
    """While a paged call has the model switched, forwards without a PagedCache (another thread's plain
    forward; generate's own extra forwards: guidance_scale's unconditional pass, an assistant that is the
    model itself, early-exit drafts) run the attention the switch replaced, with its mask: the default
    path's results. use_cache=False is refused by name."""
    from transformers import StoppingCriteriaList
    model = make_model("llama", seed=14)
    ids, mask = make_batch([9, 4, 13], seed=16)
    reference = model(input_ids=ids, attention_mask=mask).logits
    gate = _Gate()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with patched(model):
        thread, box = _in_thread(lambda: model.generate(cache_implementation="paged",
                                                        stopping_criteria=StoppingCriteriaList([gate]), **kw))
        assert gate.entered.wait(60)
        assert model.config._attn_implementation == hf_paged.ATTENTION_NAME      # switched, mid-call
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask).logits
        gate.release.set()
        thread.join(60)
    assert "error" not in box, box.get("error")
    torch.testing.assert_close(plain, reference, atol=1e-6, rtol=0)
    one, one_mask = make_batch([9], seed=16)
    single = dict(input_ids=one, attention_mask=one_mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cases = [(kw, dict(guidance_scale=1.5)), (single, dict(assistant_model=model)),
             (single, dict(assistant_early_exit=1))]
    expected = [model.generate(**base, **extra) for base, extra in cases]
    with patched(model):
        for (base, extra), want in zip(cases, expected):
            assert torch.equal(model.generate(cache_implementation="paged", **base, **extra), want), extra
        with pytest.raises(ValueError, match="use_cache=False .* no KV cache to page"):
            model.generate(cache_implementation="paged", use_cache=False, **kw)
        # a generation config's use_cache false (a checkpoint saved while training) asks nothing of the call
        model.generation_config.use_cache = False
        try:
            got = model.generate(cache_implementation="paged", **single)
            assert torch.equal(got, model.generate(**single)) and hf_paged.last_stats(model)
        finally:
            model.generation_config.use_cache = True
    assert model.config.num_hidden_layers == 2
    assert not any("_hf_paged_replaced_attention" in m.__dict__ for m in model.modules())


def test_kivi_s_block_size_is_refused_when_asked():
    model = make_model("llama")
    for make in (lambda: hf_paged.PagedCache(model.config, kv_cache_dtype="kivi", block_size=16),
                 lambda: hf_paged.patch(model, kv_cache_dtype="kivi", block_size=16)):
        with pytest.raises(ValueError, match="kivi.*blocks of 32 tokens.*set block_size=32"):
            make()
    assert not hf_paged.is_patched(model)


def test_a_patch_made_during_a_global_opt_in_call_outlives_it():
    """enable()'s per-call patch, patched explicitly meanwhile (the advice for concurrent use), stays patched."""
    from transformers import StoppingCriteriaList
    model = make_model("llama", seed=3)
    ids, mask = make_batch([5, 3], seed=1)
    gate = _Gate()
    with hf_paged.enabled():
        thread, box = _in_thread(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                                        do_sample=False, cache_implementation="paged",
                                                        stopping_criteria=StoppingCriteriaList([gate])))
        assert gate.entered.wait(60)
        hf_paged.patch(model, default=True)
        gate.release.set()
        thread.join(60)
    assert "error" not in box, box.get("error")
    try:
        assert hf_paged.is_patched(model) and model.generation_config.cache_implementation == "paged"
        assert hf_paged.last_stats(model)["blocks_used"] >= 0
    finally:
        hf_paged.unpatch(model)


def test_direct_forward_with_paged_cache_needs_the_scope():
    model = make_model("llama")
    ids, mask = make_batch([5, 3], seed=2)
    reference = model(input_ids=ids, attention_mask=mask).logits
    with patched(model):
        cache = hf_paged.PagedCache(model.config)
        with pytest.raises(RuntimeError, match="use_paged_attention"):
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        cache.reset()
        with hf_paged.use_paged_attention(model):
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], reference[real], atol=1e-5, rtol=0)


def test_direct_forwards_continue_at_the_right_positions(family):
    """Prefill then decode steps by direct forwards (no cache_position, as research code writes them):
    each step's logits equal DynamicCache's. The model derives positions from get_seq_length() inside
    the forward, after the plan hook has planned the step."""
    from transformers import DynamicCache
    model = make_model(family)
    ids, mask = make_batch([7, 4], seed=5)
    more = torch.randint(3, 200, (2, 4), generator=torch.Generator().manual_seed(6))

    def run(cache, paged_scope):
        logits = []
        with torch.no_grad(), paged_scope:
            logits.append(model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits[:, -1])
            for t in range(more.shape[1]):
                step_mask = torch.cat([mask, torch.ones(2, t + 1, dtype=mask.dtype)], 1)
                logits.append(model(input_ids=more[:, t:t + 1], attention_mask=step_mask,
                                    past_key_values=cache).logits[:, -1])
        return torch.stack(logits)

    reference = run(DynamicCache(config=model.config), contextlib.nullcontext())
    with patched(model):
        cache = hf_paged.PagedCache(model.config)
        got = run(cache, hf_paged.use_paged_attention(model))
        assert cache.get_seq_length() == ids.shape[1] + more.shape[1]
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


def test_global_opt_in_is_explicit_and_reversible():
    model = make_model("glm")
    ids, mask = make_batch([6, 2, 9], seed=3)
    original = GenerationMixin.generate
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert not hf_paged.is_enabled()
    with hf_paged.enabled():
        assert GenerationMixin.generate is not original
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             cache_implementation="paged", return_dict_in_generate=True)
        assert isinstance(out.past_key_values, hf_paged.PagedCache)
        assert not hf_paged.is_patched(model)                  # patched for the call only
        passthrough = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                     return_dict_in_generate=True)
        assert isinstance(passthrough.past_key_values, DynamicCache)
    assert GenerationMixin.generate is original
    assert torch.equal(out.sequences, reference) and torch.equal(passthrough.sequences, reference)
    hf_paged.enable()
    hf_paged.enable()                                           # idempotent
    hf_paged.disable()
    assert GenerationMixin.generate is original


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pipeline_batched_prompts(family):
    model = make_model(family, seed=4)
    tok = word_tokenizer()
    gen = torch.Generator().manual_seed(5)
    prompts = [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=gen))
               for n in (3, 9, 1, 6, 12, 4, 7)]
    kw = dict(max_new_tokens=6, do_sample=False, batch_size=3)
    reference = pipeline("text-generation", model=model, tokenizer=tok)(prompts, **kw)
    with patched(model, default=True):
        paged = pipeline("text-generation", model=model, tokenizer=tok)(prompts, **kw)
        assert hf_paged.last_stats(model)["tokens_stored"] > 0
    with patched(model):
        keyword = pipeline("text-generation", model=model, tokenizer=tok)(prompts, cache_implementation="paged", **kw)
    assert paged == reference
    assert keyword == reference


def test_patching_again_applies_the_new_options():
    model = make_model("llama", seed=3)
    ids, mask = make_batch([5, 3], seed=4)
    default = model.generation_config.cache_implementation
    hf_paged.patch(model, block_size=4)
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, cache_implementation="paged")
        assert hf_paged.last_stats(model)["block_size"] == 4
        hf_paged.patch(model, block_size=8, default=True)
        assert model.generation_config.cache_implementation == "paged"
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
        assert hf_paged.last_stats(model)["block_size"] == 8
        with pytest.raises(ValueError, match="block_size must be an int"):
            hf_paged.patch(model, block_size=0)
        hf_paged.patch(model, block_size=8)           # default=False: back to the model's own default
        assert model.generation_config.cache_implementation == default
    finally:
        hf_paged.unpatch(model)
    assert model.generation_config.cache_implementation == default


def test_paged_pipeline_takes_engine_knobs_as_keywords():
    model = make_model("llama", seed=3)
    tok = word_tokenizer()
    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, max_num_seqs=3, block_size=8)
    assert pipe.llm.engine.config.max_num_seqs == 3 and pipe.llm.engine.config.block_size == 8
    with pytest.raises(ValueError, match=r"\['max_num_seqs'\] given both"):
        hf_paged.pipeline("text-generation", model=model, tokenizer=tok, max_num_seqs=3,
                          engine_options={"max_num_seqs": 4})


class _Gate:
    """A stopping criterion that, at its first call, signals ``entered`` and waits for ``release``."""

    def __init__(self):
        import threading
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60), "the other thread never released the gate"
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _in_thread(fn):
    import threading
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:       # noqa: BLE001  (handed to the test)
            box["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_concurrent_global_opt_in_calls_are_refused_clearly():
    from transformers import StoppingCriteriaList
    model = make_model("qwen2", seed=5)
    ids, mask = make_batch([6, 4], seed=6)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    reference = model.generate(**kw)
    gate = _Gate()
    with hf_paged.enabled():
        thread, box = _in_thread(lambda: model.generate(cache_implementation="paged",
                                                        stopping_criteria=StoppingCriteriaList([gate]), **kw))
        assert gate.entered.wait(60)
        with pytest.raises(RuntimeError, match=r"two threads.*hf_paged.patch\(model\) once"):
            model.generate(cache_implementation="paged", **kw)
        gate.release.set()
        thread.join(60)
    assert "error" not in box, box.get("error")
    assert torch.equal(box["value"], reference) and not hf_paged.is_patched(model)


def test_a_patched_model_serves_concurrent_paged_calls():
    from transformers import StoppingCriteriaList
    model = make_model("glm", seed=7)
    ids, mask = make_batch([7, 2, 5], seed=8)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    reference = model.generate(**kw)
    gate = _Gate()
    with patched(model):
        thread, box = _in_thread(lambda: model.generate(cache_implementation="paged",
                                                        stopping_criteria=StoppingCriteriaList([gate]), **kw))
        assert gate.entered.wait(60)
        other = model.generate(cache_implementation="paged", **kw)    # runs while the first is mid-generate
        gate.release.set()
        thread.join(60)
        assert model.config._attn_implementation != hf_paged.ATTENTION_NAME
    assert "error" not in box, box.get("error")
    assert torch.equal(box["value"], reference) and torch.equal(other, reference)


def test_the_global_opt_in_pages_a_passed_paged_cache():
    """Under enabled(), a PagedCache passed without cache_implementation pages the call (the error told the user
    to use enabled(), which they were)."""
    model = make_model("llama", seed=3)
    ids, mask = make_batch([5, 9, 2], seed=4)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with hf_paged.enabled():
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             past_key_values=hf_paged.PagedCache(model.config))
    assert torch.equal(got, ref) and not hf_paged.is_patched(model)


def test_inference_tensor_weights_with_prefix_caching_and_the_engine():
    """Weights made under torch.inference_mode have no version counter: the weights key reads their storage
    (it raised 'Inference tensors do not track version counter' in prefix caching and LLM)."""
    with torch.inference_mode():
        model = make_model("llama", seed=3)
    assert next(model.parameters()).is_inference()
    ids, mask = make_batch([5, 9], seed=4)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with patched(model, enable_prefix_caching=True):
        for _ in range(2):
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 cache_implementation="paged")
            assert torch.equal(got, ref)
    outs = hf_paged.LLM(model, block_size=4, num_blocks=32).generate([[5, 6, 7]], max_new_tokens=3, do_sample=False)
    alone = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert outs[0].outputs[0].token_ids == alone[0, 3:].tolist()


def test_a_restore_waits_for_other_threads_forwards_begun_while_switched():
    """A plain forward of another thread that built its mask while a paged call had the model switched runs
    its attention switched too: the call's end waits for it (before, the restored attention got a DeferredMask:
    a TypeError, or a RuntimeError, in 1 of 8 plain generates racing paged ones). Nothing stays on the model."""
    import threading
    import time
    model = make_model("llama", seed=21)
    ids, mask = make_batch([5, 9, 1, 7], seed=1)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    at_layer, go, box = threading.Event(), threading.Event(), {}
    switch = hf_paged.use_paged_attention(model)             # stands for another thread's paged call
    switch.__enter__()

    def pause(*_):
        at_layer.set()
        go.wait(30)

    hook = model.model.layers[0].register_forward_pre_hook(pause)

    def plain():
        with torch.no_grad():
            box["logits"] = model(input_ids=ids, attention_mask=mask).logits

    thread = threading.Thread(target=plain)
    thread.start()
    assert at_layer.wait(30)              # its mask is built (deferred), its attention not run yet
    hook.remove()
    threading.Timer(0.3, go.set).start()
    start = time.perf_counter()
    switch.__exit__(None, None, None)     # the paged call ends: waits for the plain forward
    assert time.perf_counter() - start >= 0.25
    thread.join(30)
    assert torch.equal(box["logits"], want)
    assert model.config._attn_implementation == "sdpa"
    assert not any(k.startswith("_hf_paged") for m in model.modules() for k in m.__dict__)
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks


def test_a_patched_model_copies_and_pickles_as_itself():
    """deepcopy / pickle of a patched model (before or after a paged call) give a patched model of the copy's own
    weights (before, the copy's generate ran the original model; pickling failed on the generate closure, and
    after any paged call on the switch's lock)."""
    import copy
    import pickle
    model = make_model("llama", seed=22)
    ids, mask = make_batch([6, 3], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    hf_paged.patch(model)
    first = model.generate(cache_implementation="paged", **kw)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.lm_head.weight.mul_(-1)
    want = hf_paged.unpatch(copy.deepcopy(clone)).generate(**kw)
    assert not torch.equal(want, first)
    assert torch.equal(clone.generate(cache_implementation="paged", **kw), want)
    assert torch.equal(model.generate(cache_implementation="paged", **kw), first)
    hf_paged.unpatch(clone)
    assert hf_paged.is_patched(model) and not hf_paged.is_patched(clone)
    revived = pickle.loads(pickle.dumps(model))
    assert hf_paged.is_patched(revived)
    assert torch.equal(revived.generate(cache_implementation="paged", **kw), first)
    hf_paged.unpatch(model)
    assert not any(k.startswith("_hf_paged") for k in model.__dict__)
    copy.deepcopy(model)


def test_unpatch_leaves_the_user_s_own_cache_implementation():
    model = make_model("llama", seed=23)
    hf_paged.patch(model)
    model.generation_config.cache_implementation = "static"
    hf_paged.patch(model, block_size=8)                       # patching again: not patch's to reset
    assert model.generation_config.cache_implementation == "static"
    hf_paged.unpatch(model)
    assert model.generation_config.cache_implementation == "static"
    hf_paged.patch(model, default=True)
    assert model.generation_config.cache_implementation == "paged"
    hf_paged.patch(model)                                     # default=False again: back to the user's value
    assert model.generation_config.cache_implementation == "static"
    hf_paged.unpatch(model)
    assert model.generation_config.cache_implementation == "static"


def test_an_interrupted_forward_of_another_thread_does_not_hold_the_switch():
    """A KeyboardInterrupt inside a plain forward begun while switched (torch's always-called hooks miss it):
    the paged call's end does not wait for it (it waited the 300 s limit)."""
    import threading
    import time
    model = make_model("llama", seed=24)
    ids, mask = make_batch([5, 9], seed=3)
    switch = hf_paged.use_paged_attention(model)
    switch.__enter__()

    def interrupt(*_):
        raise KeyboardInterrupt

    hook = model.model.layers[0].register_forward_pre_hook(interrupt)
    box = {}

    def plain():
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
        except KeyboardInterrupt:
            box["interrupted"] = True

    thread = threading.Thread(target=plain)
    thread.start()
    thread.join(30)
    hook.remove()
    start = time.perf_counter()
    switch.__exit__(None, None, None)
    assert box == {"interrupted": True} and time.perf_counter() - start < 5
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.model.__dict__


def test_unpatch_is_refused_while_paged_calls_run():
    """Unpatching under a running paged call (another thread's, or from inside it) removed the hooks its next
    forwards needed: the call went on with a stale step plan and 2 of 3 such calls gave wrong tokens silently."""
    from transformers import StoppingCriteriaList
    model = make_model("llama", seed=25)
    ids, mask = make_batch([6, 3], seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(**kw)
    refused = []

    def try_unpatch(input_ids, scores, **kwargs):
        with pytest.raises(RuntimeError, match="unpatch while 1 paged generate call"):
            hf_paged.unpatch(model)
        refused.append(True)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    hf_paged.patch(model)
    got = model.generate(cache_implementation="paged", stopping_criteria=StoppingCriteriaList([try_unpatch]), **kw)
    assert refused and torch.equal(got, want) and hf_paged.is_patched(model)
    hf_paged.unpatch(model)
    assert not hf_paged.is_patched(model)


def test_the_opt_in_lets_other_threads_plain_calls_through_and_its_blocks_overlap():
    """While one thread's enabled() call has the model patched for it, another thread's plain generate runs (it
    raised the two-threads error in 29 of 30 calls); overlapping blocks keep the opt-in until the last leaves."""
    from transformers import StoppingCriteriaList
    model = make_model("llama", seed=26)
    ids, mask = make_batch([6, 3], seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = model.generate(**kw)
    gate = _Gate()
    with hf_paged.enabled():
        thread, box = _in_thread(lambda: model.generate(cache_implementation="paged",
                                                        stopping_criteria=StoppingCriteriaList([gate]), **kw))
        assert gate.entered.wait(60)
        try:
            assert torch.equal(model.generate(**kw), want)          # another thread's plain call
        finally:
            gate.release.set()
            thread.join(60)
    assert "error" not in box and torch.equal(box["value"], want)
    first, second = hf_paged.enabled(), hf_paged.enabled()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)                                # another thread's block leaves first
    assert hf_paged.is_enabled()
    second.__exit__(None, None, None)
    assert not hf_paged.is_enabled()
    with hf_paged.enabled():
        hf_paged.enable()                                           # asked for good: the block leaves it on
    assert hf_paged.is_enabled()
    hf_paged.disable()
    assert not hf_paged.is_enabled()


def test_an_llm_serves_one_thread_at_a_time():
    """Another thread's call while a stream is open raises, naming what to do (it failed inside the engine
    with internal errors: 'EngineCache.update ran outside ModelRunner.execute', a plan of other tokens)."""
    model = make_model("llama", seed=27)
    llm = hf_paged.LLM(model, max_num_seqs=4)
    stream = llm.stream([[5, 6, 7], [8, 9]], max_new_tokens=6)
    next(stream)
    thread, box = _in_thread(lambda: llm.generate([[4, 5]], max_new_tokens=2))
    thread.join(60)
    assert isinstance(box.get("error"), RuntimeError) and "one thread at a time" in str(box["error"])
    stream.close()
    thread, box = _in_thread(lambda: llm.generate([[4, 5]], max_new_tokens=2))
    thread.join(60)
    assert "error" not in box and len(box["value"][0].completions[0].token_ids) == 2


def test_a_model_patched_with_prefix_caching_copies_after_a_call():
    import copy
    import pickle
    model = make_model("qwen2", seed=28)
    ids, mask = make_batch([9, 9], seed=6)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    hf_paged.patch(model, enable_prefix_caching=True)
    first = model.generate(cache_implementation="paged", **kw)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(clone.generate(cache_implementation="paged", **kw), first)
    hf_paged.unpatch(model)


def test_paged_from_a_passed_config_is_turned_off_in_a_copy_of_it_not_by_a_keyword():
    """transformers warns (deprecation) when keywords come next to a passed GenerationConfig: the hook's own
    override (cache_implementation None: it builds the cache) goes into a copy of that config, unless the
    model's config holds a value that would refill the copy's default; the caller's config is left as it was."""
    from transformers import GenerationConfig

    from hf_paged.integrations.generate import paged_generate
    model = make_model("llama", seed=3)
    seen = []

    def generate(*args, **kwargs):
        seen.append((args, kwargs))

    ids = torch.tensor([[5, 6, 7]])
    for positional in (False, True):
        config = GenerationConfig(max_new_tokens=2, cache_implementation="paged")
        args, kwargs = ((ids, config), {}) if positional else ((ids,), {"generation_config": config})
        paged_generate(model, generate, args, kwargs, {})
        got_args, got_kwargs = seen[-1]
        passed = got_args[1] if positional else got_kwargs["generation_config"]
        assert "cache_implementation" not in got_kwargs and passed.cache_implementation is None
        assert passed is not config and config.cache_implementation == "paged"
        assert isinstance(got_kwargs.get("past_key_values", got_kwargs.get("cache")), hf_paged.PagedCache)
    config = GenerationConfig(max_new_tokens=2)                   # "paged" as a keyword beside a config: it goes
    paged_generate(model, generate, (ids,), {"generation_config": config, "cache_implementation": "paged"}, {})
    assert "cache_implementation" not in seen[-1][1] and seen[-1][1]["generation_config"].cache_implementation is None
    model.generation_config.cache_implementation = "static"      # would refill a copy's None: the keyword stays
    config = GenerationConfig(max_new_tokens=2, cache_implementation="paged")
    paged_generate(model, generate, (ids,), {"generation_config": config}, {})
    assert seen[-1][1]["cache_implementation"] is None and seen[-1][1]["generation_config"] is config


def test_continuing_in_a_mode_that_refeeds_the_prompt_says_so():
    """generate continuing from a returned cache with prompt lookup feeds the whole sequence again in its first
    forward (the default path then attends over it twice); with a padded row the mask cannot say where: the
    refusal names the mode and what to do, not only the column counts."""
    model = make_model("llama", seed=1)
    ids = torch.tensor([[0, 0, 0, 164, 122, 142, 131, 189]])
    mask = (ids != 0).long()
    with patched(model):
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None,
                               return_dict_in_generate=True, cache_implementation="paged")
        full = torch.cat([first.sequences, torch.tensor([[92, 37, 136]])], 1)
        with pytest.raises(ValueError, match=r"(?s)cache has seen 11 .*prompt_lookup_num_tokens.*fresh cache"):
            model.generate(input_ids=full, attention_mask=torch.cat([mask, torch.ones(1, 7, dtype=torch.long)], 1),
                           past_key_values=first.past_key_values, max_new_tokens=6, eos_token_id=None,
                           prompt_lookup_num_tokens=2)
