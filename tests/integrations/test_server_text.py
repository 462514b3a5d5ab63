"""The text a client reads, as vLLM writes it: the new tokens' text continues the prompt's (a SentencePiece
tokenizer's first new token keeps its space), ``min_tokens`` holds stop strings back, the EOS / stop token
that ended a sequence leaves its text out, ``text_offset`` follows the tokens when a stop string holds
text back, an echo answers the prompt as sent; and the endpoints clients probe (``/v1/models/{name}``,
``/ping``, ``HEAD /health``) and the refusals that name the knob.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from hf_paged.engine.continuation import continuation  # noqa: E402
from hf_paged.engine.stop_strings import StopStrings  # noqa: E402
from hf_paged.integrations.server import create_app  # noqa: E402
from hf_paged.integrations.server.detokenize import TextStream  # noqa: E402
from tiny_models import EOS, VOCAB, chat_word_tokenizer, make_model, word_tokenizer  # noqa: E402

MODEL = "tiny"
KNOBS = dict(num_blocks=64, max_num_seqs=6, max_num_batched_tokens=64, block_size=16)


def metaspace_tokenizer():
    """A SentencePiece-style (Metaspace) word tokenizer over the tiny vocabulary that adds BOS, as Llama 2's:
    decoded alone, a token loses the space that begins it ("▁w5" -> "w5")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": EOS, "<s>": 2, **{f"▁w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def streamed(stream: TextStream, ids, last_stop: bool = False) -> str:
    out = [stream.add(t, last_stop and k == len(ids) - 1) for k, t in enumerate(ids)]
    return "".join(out) + stream.finish()


# -- the rules, without a server ------------------------------------------------------------------------
@pytest.mark.parametrize("make", [metaspace_tokenizer, word_tokenizer], ids=["metaspace", "word-level"])
def test_new_text_continues_the_prompt(make):
    tok = make()
    prompt, new = tok("w5 w6", add_special_tokens=True).input_ids, [7, 8, 9]
    whole, ahead = tok.decode(prompt + new, skip_special_tokens=True), tok.decode(prompt, skip_special_tokens=True)
    assert whole == ahead + " w7 w8 w9" and tok.decode(new) == "w7 w8 w9"         # alone: the space is lost
    assert continuation(tok, prompt[-5:], new, skip_special_tokens=True) == " w7 w8 w9"
    assert streamed(TextStream(tok, context=prompt), new) == " w7 w8 w9"
    assert streamed(TextStream(tok), new) == "w7 w8 w9"                            # no context: as decoded alone
    assert streamed(TextStream(tok, stop=(" w7",), context=prompt), new) == ""     # a stop string at the start


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: one token per byte, so an emoji is 4 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_a_character_cut_by_max_tokens_is_left_out():
    """Cut after 2 of an emoji's 4 byte tokens, the text ends before it, as vLLM's detokenizer leaves it (the
    full decode's U+FFFD is no character of the answer), streamed or whole; all 4 give the emoji."""
    from hf_paged.engine.continuation import complete_characters
    tok = byte_tokenizer()
    ids = tok("a\U0001F31Fb").input_ids
    assert len(ids) == 6 and tok.decode(ids[:3]) == "a\ufffd"
    assert streamed(TextStream(tok, context=ids[:1]), ids[1:3]) == ""
    assert streamed(TextStream(tok, context=ids[:1]), ids[1:5]) == "\U0001F31F"
    assert complete_characters(continuation(tok, ids[:1], ids[1:3])) == ""
    assert complete_characters("x\ufffd") == "x" and complete_characters("x") == "x"


def test_engine_stop_strings_see_the_first_token_s_space():
    tok = metaspace_tokenizer()
    stops = StopStrings((" w7",))
    assert stops.in_tail(tok, [2, 5, 6, 7], num_output=1)          # " w7" begins the continuation
    assert not StopStrings(("w5 w6",)).in_tail(tok, [2, 5, 6, 7], num_output=1)     # the prompt's text is not searched


def test_min_tokens_holds_stop_strings_back():
    """vLLM's rule: a stop string counts only where it ends after the first min_tokens tokens' text."""
    tok = word_tokenizer()
    ids = [7, 8, 7, 9]                                              # " w7 w8 w7 w9" after the prompt
    prompt = [5, 6]
    assert streamed(TextStream(tok, stop=("w7",), context=prompt), ids) == " "
    assert streamed(TextStream(tok, stop=("w7",), context=prompt, min_tokens=1), ids) == " w7 w8 "
    assert streamed(TextStream(tok, stop=("w7",), context=prompt, min_tokens=3), ids) == " w7 w8 w7 w9"
    assert streamed(TextStream(tok, stop=("w8 w7",), context=prompt, min_tokens=2), ids) == " w7 "   # straddles it
    stops = StopStrings(("w7",))
    seq = prompt + ids
    assert stops.in_tail(tok, seq[:3], 1) and not stops.in_tail(tok, seq[:3], 1, min_tokens=1)
    assert not stops.in_tail(tok, seq[:4], 2, min_tokens=1) and stops.in_tail(tok, seq[:5], 3, min_tokens=1)
    assert not stops.in_tail(tok, seq, 4, min_tokens=3)
    assert StopStrings(("w8 w7",)).in_tail(tok, seq[:5], 3, min_tokens=2)


def test_a_stop_string_kept_in_the_text_holds_nothing_back():
    """With include_stop_str_in_output nothing needs retracting: each token's text goes out as it comes (vLLM's
    detokenizer holds nothing back then); without it, len(stop) - 1 characters wait."""
    tok = word_tokenizer()
    kept = TextStream(tok, stop=("w9 zzz",), context=[5, 6], include_stop=True)
    assert [kept.add(t) for t in (7, 8)] == [" w7", " w8"]
    held = TextStream(tok, stop=("w9 zzz",), context=[5, 6])
    assert "".join(held.add(t) for t in (7, 8)) == " w7 w8"[:-5]
    assert held.finish() == " w7 w8"[-5:]


def test_the_token_that_stopped_a_sequence_leaves_its_text_out():
    tok = word_tokenizer()
    assert streamed(TextStream(tok, skip_special_tokens=False, context=[5]), [7, EOS], last_stop=True) == " w7"
    assert streamed(TextStream(tok, skip_special_tokens=False, context=[5]), [7, EOS]) == " w7 </s>"
    assert streamed(TextStream(tok, context=[5]), [7, 8], last_stop=True) == " w7"          # a stop_token_ids one
    kept = TextStream(tok, context=[5], include_stop=True)
    assert streamed(kept, [7, 8], last_stop=True) == " w7 w8"


# -- through the server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    app = create_app(make_model("llama", seed=4), chat_word_tokenizer(), served_model_name=MODEL, **KNOBS)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_completion_continues_the_prompt_text(client):
    prompt = "w5 w6 w7"
    text = complete(client, prompt=prompt, max_tokens=4, ignore_eos=True)["text"]
    assert text.startswith(" w") and len(text.split()) == 4
    echoed = complete(client, prompt=prompt, max_tokens=4, ignore_eos=True, echo=True)["text"]
    assert echoed == prompt + text                              # the prompt as sent, then the new text


def test_text_offsets_follow_the_tokens_when_a_stop_string_holds_text_back(client):
    body = dict(prompt="w5 w6 w7", max_tokens=8, ignore_eos=True, logprobs=1)
    plain = complete(client, **body)
    held = complete(client, **body, stop=["zzzzzzzzzz"])        # never matches, holds 9 characters back
    assert held["text"] == plain["text"]
    offsets = plain["logprobs"]["text_offset"]
    assert held["logprobs"]["text_offset"] == offsets
    tokens = plain["logprobs"]["tokens"]
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]     # vLLM's rule
    chunks = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, "stream": True, **body,
                                                   "stop": ["zzzzzzzzzz"]}).text
    parts = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    streamed_offsets = [o for p in parts for c in p["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert streamed_offsets == offsets


def test_text_offsets_run_on_past_a_stop_string_whole_and_streamed(client):
    """The tokens of a stop string cut off keep the rule (the previous token's offset plus its text's length),
    past the text's end, as vLLM's and as the stream's offsets were (the whole answer clipped them at the end)."""
    body = dict(prompt="w5 w6 w7", max_tokens=8, ignore_eos=True, logprobs=1)
    words = complete(client, **body)["text"].split()
    k = next(k for k in range(1, len(words) - 1) if words[k] not in words[:k])     # a word not seen before it
    stop = f" {words[k]} "                                   # (spaces round it: no other word holds it)
    cut = complete(client, **body, stop=[stop])
    assert cut["text"] == " " + " ".join(words[:k])
    tokens, offsets = cut["logprobs"]["tokens"], cut["logprobs"]["text_offset"]
    assert len(tokens) == k + 2 and offsets == [sum(len(t) for t in tokens[:j]) for j in range(k + 2)]
    assert len(cut["text"]) < offsets[-1]                    # the stop string's last token starts past the text
    chunks = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, "stream": True, **body,
                                                   "stop": [stop]}).text
    parts = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    assert [o for p in parts for c in p["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets


def test_min_tokens_reaches_past_a_stop_string(client):
    free = complete(client, prompt="w5 w6 w7", max_tokens=10, ignore_eos=True)["text"]
    words = free.split()
    stop = words[1]
    cut = complete(client, prompt="w5 w6 w7", max_tokens=10, ignore_eos=True, stop=["zzz", stop])
    assert cut["text"] == free[:free.index(stop)] and cut["stop_reason"] == stop        # vLLM's stop_reason
    last = events(client, "/v1/completions", dict(prompt="w5 w6 w7", max_tokens=10, ignore_eos=True, stop=[stop]))
    assert [c["stop_reason"] for e in last for c in e["choices"]][-1] == stop
    waited = complete(client, prompt="w5 w6 w7", max_tokens=10, ignore_eos=True, stop=[stop], min_tokens=2)
    after = free.index(stop, free.index(stop) + 1) if free.count(stop) > 1 else len(free)
    assert waited["text"] == free[:after]                       # the first one was inside the min_tokens' text


def test_stop_token_ids_leave_the_token_s_text_out(client):
    free = complete(client, prompt="w5 w6 w7", max_tokens=6, ignore_eos=True, logprobs=0)
    tokens = free["logprobs"]["tokens"]
    stop_id = int(tokens[2][1:])                                # "w<id>"
    first = tokens.index(tokens[2])
    got = complete(client, prompt="w5 w6 w7", max_tokens=6, ignore_eos=True, stop_token_ids=[stop_id])
    assert got["finish_reason"] == "stop" and got["text"] == "".join(" " + t for t in tokens[:first])
    assert got["stop_reason"] == stop_id and free["stop_reason"] is None
    kept = complete(client, prompt="w5 w6 w7", max_tokens=6, ignore_eos=True, stop_token_ids=[stop_id],
                    include_stop_str_in_output=True)
    assert kept["text"] == "".join(" " + t for t in tokens[:first + 1])


def test_return_token_ids_gives_every_token_and_the_prompt_s(client):
    """vLLM's return_token_ids (RL and agent frameworks read it): each choice's generated ids, a stop token
    included though its text is left out, and the prompt's ids; streamed, each chunk's own ids."""
    free = complete(client, prompt="w5 w6 w7", max_tokens=6, ignore_eos=True, logprobs=0)
    ids = [int(t[1:]) for t in free["logprobs"]["tokens"]]
    got = complete(client, prompt="w5 w6 w7", max_tokens=6, ignore_eos=True, stop_token_ids=[ids[2]],
                   return_token_ids=True)
    first = ids.index(ids[2])
    assert got["token_ids"] == ids[:first + 1] and got["prompt_token_ids"] == [5, 6, 7]
    assert "token_ids" not in free
    parts = events(client, "/v1/completions", dict(prompt="w5 w6 w7", max_tokens=6, ignore_eos=True,
                                                   return_token_ids=True))
    assert [t for p in parts for c in p["choices"] for t in c["token_ids"]] == ids
    assert parts[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "w5"}],
                                                  "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"] and body["prompt_token_ids"]
    chat = events(client, "/v1/chat/completions", {"max_tokens": 3, "messages": [{"role": "user", "content": "w5"}],
                                                   "return_token_ids": True})
    assert chat[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert [t for p in chat for c in p["choices"] for t in c.get("token_ids", [])] == body["choices"][0]["token_ids"]


def events(client, path: str, body: dict) -> list[dict]:
    r = client.post(path, json={"model": MODEL, "temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_echo_and_continuous_usage(client):
    """vLLM's chat ``echo`` (the answer begins with the last message when it has the answer's role) and
    ``continuous_usage_stats`` (every chunk carries its choice's usage so far)."""
    turn = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w7 w8"}]
    plain = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turn, "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True}).json()
    echoed = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turn, "max_tokens": 3,
                                                       "temperature": 0, "ignore_eos": True, "echo": True}).json()
    content = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "w7 w8" + content
    assert echoed["usage"] == plain["usage"]
    assert "prompt_logprobs" not in plain and len(echoed["prompt_logprobs"]) == plain["usage"]["prompt_tokens"]
    user = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turn[:1], "max_tokens": 2,
                                                     "temperature": 0, "echo": True,
                                                     "add_generation_prompt": False}).json()["choices"][0]
    assert user["message"]["role"] == "user" and user["message"]["content"].startswith("w5")
    chunks = events(client, "/v1/chat/completions", {"messages": turn, "max_tokens": 3, "ignore_eos": True,
                                                     "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "w7 w8" + content
    chunks = events(client, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True, "n": 1,
                                                "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4 and all(c["usage"]["prompt_tokens"] == 2 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    quiet = events(client, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True,
                                               "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in quiet[:-1]) and quiet[-1]["usage"]["completion_tokens"] == 4


def test_probes_and_refusals(client):
    card = client.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert client.head("/health").status_code == 200 and client.get("/ping").status_code == 200
    nowhere = client.post("/v1/embeddings", json={"model": MODEL, "input": "w5"})
    assert nowhere.status_code == 404 and "/v1/completions" in nowhere.json()["error"]["message"]
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    full = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": " ".join(["w5"] * (limit - 1))}]})           # + the template's w9: the context
    assert full.status_code == 400 and "no room for a new token" in full.json()["error"]["message"]
    assert full.json()["error"]["param"] == "prompt"
    tool = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "w5"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]})
    assert tool.status_code == 400 and tool.json()["error"]["param"] == "messages.1.tool_calls.0"   # no function
    assert "tool_calls are" in tool.json()["error"]["message"]
    many = client.post("/v1/completions", json={"model": MODEL, "prompt": "w5", "n": 2, "max_tokens": 2,
                                                "temperature": 0})
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    assert "temperature > 0" in many.json()["error"]["message"]
