"""Log-probabilities from the engine: each entry equals ``log_softmax`` of the default path's raw logits
(``generate(output_logits=True)`` for new tokens, a plain forward for prompt tokens) within 1e-4, for
greedy and sampled requests, chunked prefill, preemption, forks and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from tiny_models import VOCAB, make_model
from hf_paged.engine import LLM
from hf_paged.engine.logprobs import Logprob

TOL = 1e-4


def generate_logprobs(model, prompt, seed=None, **settings):
    """(new tokens of each sequence, log_softmax of each step's raw logits [n, V] per step) from generate."""
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True,
                         **settings)
    return out.sequences[:, len(prompt):].tolist(), [torch.log_softmax(step.float(), -1) for step in out.logits]


def prompt_reference(model, prompt):
    """log_softmax [T, V] of a plain forward over the prompt alone (row p scores token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def check_entry(entry: dict, token: int, reference: torch.Tensor, k: int) -> None:
    """``entry`` = {token: Logprob, then the top k} against the reference distribution ``reference`` [V]."""
    assert next(iter(entry)) == token, "the chosen token comes first"
    for t, lp in entry.items():
        assert isinstance(lp, Logprob) and abs(lp.logprob - reference[t].item()) < TOL, (t, lp, reference[t])
    own = reference[token].item()
    rank = entry[token].rank
    assert int((reference > own + TOL).sum()) + 1 <= rank <= int((reference > own - TOL).sum()) + 1
    top = [lp for t, lp in entry.items() if t != token or lp.rank <= k]
    assert len(top) == k and len(entry) in (k, k + 1)
    if k:
        kth = reference.topk(k).values[-1].item()
        assert all(lp.logprob >= kth - TOL for lp in top)


def requests(count: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 30, (), generator=gen)),), generator=gen).tolist()
        settings = dict(max_new_tokens=int(torch.randint(4, 13, (), generator=gen)), logprobs=i % 4,
                        prompt_logprobs=(i + 1) % 3, do_sample=i % 2 == 1, seed=1000 + i)
        if settings["do_sample"]:
            settings.update(temperature=0.7, top_k=30)      # logprobs stay the raw distribution's
        out.append((prompt, settings))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm4"])
def test_logprobs_equal_log_softmax_of_generates_logits(family):
    model = make_model(family, seed=4)
    seed = int(torch.randint(0, 10**6, ()))
    reqs = requests(12, seed=seed)
    # small chunks and pool: chunked prefill and preemption both happen
    llm = LLM(model, block_size=4, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=10)
    outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs])
    assert llm.stats()["preemptions"] > 0, f"seed {seed}"
    for (prompt, settings), out in zip(reqs, outs):
        settings = dict(settings)
        k, pk, seed = settings.pop("logprobs"), settings.pop("prompt_logprobs"), settings.pop("seed")
        tokens, steps = generate_logprobs(model, prompt, seed=seed if settings["do_sample"] else None, **settings)
        got = out.outputs[0]
        assert got.token_ids == tokens[0]
        assert len(got.logprobs) == len(tokens[0])
        for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            check_entry(entry, token, steps[step][0], k)
        assert abs(got.cumulative_logprob - sum(e[t].logprob for t, e in zip(got.token_ids, got.logprobs))) < 1e-6
        ref = prompt_reference(model, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[p], prompt[p], ref[p - 1], pk)


def test_prompt_logprobs_are_not_served_from_the_prefix_cache():
    model = make_model("qwen3", seed=5)
    prompt = torch.randint(3, VOCAB, (37,)).tolist()
    llm = LLM(model, block_size=4, enable_prefix_caching=True)
    llm.generate([prompt], max_new_tokens=2, do_sample=False)                   # fills the prefix cache
    plain, asked = llm.generate([prompt, prompt], [dict(logprobs=2), dict(prompt_logprobs=1)], max_new_tokens=3,
                                do_sample=False)
    assert plain.num_cached_tokens >= 32, "a request without prompt_logprobs hits the cache"
    assert asked.num_cached_tokens == 0, "prompt_logprobs need every prompt position's logits"
    ref = prompt_reference(model, prompt)
    for p in range(1, len(prompt)):
        check_entry(asked.prompt_logprobs[p], prompt[p], ref[p - 1], 1)
    tokens, steps = generate_logprobs(model, prompt, max_new_tokens=3, do_sample=False)
    for step, (token, entry) in enumerate(zip(plain.outputs[0].token_ids, plain.outputs[0].logprobs)):
        check_entry(entry, token, steps[step][0], 2)
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == tokens[0]


def test_forked_sequences_each_carry_their_logprobs():
    model = make_model("llama", seed=6)
    prompt = torch.randint(3, VOCAB, (9,)).tolist()
    out = LLM(model).generate([prompt], num_return_sequences=3, do_sample=True, seed=7, max_new_tokens=5,
                              logprobs=1)[0]
    for seq in out.outputs:
        assert len(seq.logprobs) == len(seq.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq.token_ids])).logits[0, len(prompt) - 1:-1].float()
        for step, (token, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
            check_entry(entry, token, torch.log_softmax(logits[step], -1), 1)


def test_logprob_limits_and_absence():
    model = make_model("llama", seed=8)
    llm = LLM(model, max_logprobs=3)
    with pytest.raises(ValueError, match="max_logprobs=3"):
        llm.generate([[5, 6, 7]], logprobs=4, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([[5, 6, 7]], prompt_logprobs=-1, max_new_tokens=2)
    out = llm.generate([[5, 6, 7]], max_new_tokens=2)[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    one = llm.generate([[5]], prompt_logprobs=2, max_new_tokens=1)[0]
    assert one.prompt_logprobs == [None]


def test_token_texts_join_into_the_text_as_vllms(smollm2_tokenizer):
    """A byte-level token that ends inside a UTF-8 character shows "" and the token completing it the whole
    character (vLLM's correction, read after the tokens before it), so a client joining the tokens (or the
    chat API's bytes) gets the text back; a SentencePiece token keeps the leading space its decode drops."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_paged.engine.logprobs import TokenTexts
    texts = TokenTexts(smollm2_tokenizer)
    text = "日本語で東京について🚀 ok"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    parts = [texts.in_context(token, ids[max(0, i - TokenTexts.CONTEXT):i]) for i, token in enumerate(ids)]
    assert "".join(parts) == text and "" in parts and "\ufffd" not in "".join(parts)
    assert texts(ids[0]).endswith("\ufffd") and texts.in_context(ids[0], []) == ""
    from hf_paged.engine.logprobs import logprob_entries     # a sequence's first new token: no context, ""
    entry = logprob_entries(torch.zeros(1, len(smollm2_tokenizer)), [ids[0]], [0], texts, [[]])[0]
    assert entry[ids[0]].decoded_token == ""
    backend = Tokenizer(models.WordLevel({"\u2581the": 0, "\u2581cat": 1, "[UNK]": 2, "s": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spaced = TokenTexts(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert (spaced(1), spaced(3)) == (" cat", "s")
