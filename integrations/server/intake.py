"""From an HTTP request to the engine's inputs: the validated request (``body``), the prompts' token ids,
the engine's settings (``engine_settings``: keywords of ``resolve_generation`` / ``Engine.add_request``)
and how the answer is rendered (``call_options``). Every refusal is an ``ApiError`` (400, 404 or 413)
naming the field and the limit.

Settings keys: max_new_tokens, num_return_sequences, do_sample, temperature, top_p, top_k, seed,
stop_strings, ignore_eos, min_new_tokens, repetition_penalty, min_p, presence_penalty,
frequency_penalty, logit_bias, bad_words_ids, allowed_token_ids, stop_token_ids, logprobs,
prompt_logprobs, structured_output. Unset sampling fields take vLLM's defaults, or the model's generation
config's where it sets them (``defaults``); a neutral value leaves its key out.
"""
from __future__ import annotations

import logging

from fastapi import Request
from pydantic import ValidationError

from hf_paged.engine.settings import resolve_generation

from .body import read_json, validation_error
from .call import ApiCall, engine_parts
from .defaults import GREEDY_BELOW
from .errors import ApiError
from .guided import compile_structured, structured_spec
from .options import CallOptions
from .protocol import TEMPLATE_FLAGS, ChatCompletionRequest, CompletionRequest, template_tools
from .reasoning import Reasoner
from .state import ServerState
from .tool_choice import ToolUse, tool_use
from .token_settings import (asked_prompt_logprobs, bad_words_ids, generated_logprobs, in_vocab, logit_bias,
                             logprob_counts, token_list)

log = logging.getLogger("hf_paged.server")


async def read_request(request: Request, schema, state: ServerState):
    """The validated request, for this server's model, asking for nothing the engine does not do."""
    return checked(await read_json(request, schema, state.config.max_body_bytes), state)


def model_checked(state: ServerState, req):
    """``req`` when it names this server's model, or none (absent or "": the served model, as vLLM's
    ``_is_model_supported``), else 404."""
    if req.model and req.model != state.name:
        raise ApiError(404, f"the model {req.model!r} does not exist (this server serves {state.name!r})",
                       param="model", code="model_not_found")
    return req


def checked(req, state):
    """``req`` when it names this server's model (else 404, ``model_checked``) and asks for nothing this
    server does not do (``unsupported``) or that contradicts itself (``conflicts``), else 400."""
    model_checked(state, req)
    refused = req.unsupported()
    if refused:
        raise ApiError(400, refused[1], param=refused[0], code="unsupported")
    conflict = req.conflicts()
    if conflict:
        raise ApiError(400, conflict[1], param=conflict[0], code="invalid_request")
    return req


def tokenize(state: ServerState, text: str, special: bool = True) -> list[int]:
    return list(state.tokenizer(text, add_special_tokens=special)["input_ids"])


def check_ids(state: ServerState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise ApiError(400, "empty prompt", param=param)
    return in_vocab(state, ids, param)


def truncated(req, ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last k tokens, or the first k with truncation_side "right". -1 is the
    model's context less one token, the room for one new token, where the request asks for new tokens
    (max_tokens given and not 0), else the whole context (vLLM's ``max_truncation_tokens``)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len - 1 if requested_max_tokens(req) else max_model_len
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[-k:]


def check_fan_out(state: ServerState, prompts: int, n: int) -> None:
    """A request whose prompts x n sequences exceed what the server holds at once could never be
    admitted whole (it would be answered 503 forever): 400, naming the limit and the knobs."""
    capacity = state.worker.capacity
    if prompts * n > capacity:
        raise ApiError(400, f"{prompts} prompts x n={n} = {prompts * n} sequences: at most {capacity} per "
                            "request (max_num_seqs + max_queue; --max-num-seqs, --max-queue)",
                       param="prompt" if prompts > 1 else "n")


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """One token-id list per prompt: ``prompt`` is a text, texts, token ids or lists of token ids."""
    p = req.prompt
    if isinstance(p, str) or isinstance(p[0], int):
        p = [p]
    check_fan_out(state, len(p), req.n)              # before tokenizing a million texts
    prompts = [tokenize(state, x, req.add_special_tokens) if isinstance(x, str) else list(x) for x in p]
    return [check_ids(state, truncated(req, ids, state.max_model_len), "prompt") for ids in prompts]


def echo_texts(req: CompletionRequest) -> list[str | None]:
    """Per prompt, the text ``echo`` answers: the prompt as sent where it was a text (vLLM's; its tokens'
    decode may begin with a BOS the tokenizer added), else None: the ids are decoded (also for a text
    that ``truncate_prompt_tokens`` may have cut)."""
    p = req.prompt
    texts = [p] if isinstance(p, str) else [None] if isinstance(p[0], int) else list(p)
    return [t if isinstance(t, str) and req.truncate_prompt_tokens is None else None for t in texts]


def template_options(req) -> dict:
    """The chat template's options a request sets: its ``chat_template_kwargs`` and, as vLLM passes them, its
    ``reasoning_effort`` and ``enable_thinking`` (off for effort "none") where those leave them unset."""
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in TEMPLATE_FLAGS}
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def chat_text(state: ServerState, req) -> str:
    """``req.messages`` through the tokenizer's chat template, with the assistant's turn opened (or the
    last message continued) and vLLM's template options applied (``req``: a chat completion or a
    /tokenize chat request; the options it lacks stay off)."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    messages = developer_as_system([m.template_message() for m in req.messages], str(tokenizer.chat_template))
    kwargs = template_options(req)
    tools = template_tools(getattr(req, "tools", None))
    if tools:                          # whatever the tool_choice, the template sees them, as vLLM's
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             documents=getattr(req, "documents", None), **kwargs)
    except Exception as exc:              # jinja's TemplateError (e.g. roles must alternate), ValueError
        raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages")


def developer_as_system(messages: list[dict], template: str) -> list[dict]:
    """OpenAI's ``developer`` role (what its current clients send instead of ``system``) for a template that
    does not know it: as vLLM renders it, each developer message becomes a system message and, where then
    more than one system message or one not first, all of them are merged into one at the start (joined
    by a blank line: some templates take a system message only there)."""
    if not any(m["role"] == "developer" for m in messages) or '"developer"' in template or "'developer'" in template:
        return messages
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if systems == [0]:
        return messages
    merged = {"role": "system",
              "content": "\n\n".join(messages[i]["content"] for i in systems if messages[i]["content"])}
    return [merged] + [m for m in messages if m["role"] != "system"]


def answer_role(req: ChatCompletionRequest) -> str:
    """The role of a chat answer, as vLLM's ``get_chat_request_role``: the assistant's, or with
    add_generation_prompt=false (the answer continues the conversation as it is) the last message's."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content when it has the answer's role, else ""."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == answer_role(req) else ""


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The chat completion's prompt: ``chat_text`` tokenized (special tokens only with add_special_tokens:
    the template writes its own), truncated as asked."""
    text = chat_text(state, req)
    check_fan_out(state, 1, req.n)
    ids = truncated(req, tokenize(state, text, special=req.add_special_tokens), state.max_model_len)
    return check_ids(state, ids, "messages")


def requested_max_tokens(req) -> int | None:
    """The new tokens asked for: chat's max_completion_tokens (or max_tokens); completions' max_tokens
    (0: echo only, see ``sampling_params``)."""
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens or req.max_tokens
    return req.max_tokens


def context_checked(prompts: list[list[int]], max_tokens: int | None, max_model_len: int,
                    model_len: int | None = None) -> int:
    """``max_tokens`` as the engine gets it (chat without it: up to the context). Each sequence stops at the
    context's end, as vLLM's ``get_max_tokens`` trims max_tokens to the room a prompt leaves (finish_reason
    "length"; the engine applies it per prompt). Refused, as vLLM refuses them: max_tokens past the whole
    context, a prompt longer than it or filling it (but for an echo with max_tokens 0). ``model_len``: the
    model's own context where the KV pool lowered max_model_len (the messages then say so, and what raises it)."""
    longest = max(len(p) for p in prompts)
    lowered = (f", lowered from the model's {model_len} to what the KV pool holds: --kv-cache-memory-bytes, or "
               "--gpu-memory-utilization on a GPU, raises it") if model_len else ""
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(400, f"max_tokens={max_tokens} exceeds the model's context of {max_model_len} tokens "
                            f"(max_model_len{lowered})", param="max_tokens", code="context_too_long")
    if longest > max_model_len or (longest == max_model_len and max_tokens != 0):
        raise ApiError(400, f"the prompt ({longest} tokens) {'exceeds' if longest > max_model_len else 'fills'} "
                            f"the model's context of {max_model_len} tokens (max_model_len{lowered}): no room for a "
                            "new token", param="prompt", code="context_too_long")
    return max_model_len if max_tokens is None else max_tokens


def _off(value, neutral):
    """None for a neutral value (the key stays out)."""
    return None if value is None or value == neutral else value


def generation_settings(req, max_tokens: int, state) -> dict:
    """The request's settings as ``resolve_generation`` keywords, without structured output (see
    ``engine_settings``); unset sampling fields take the server's defaults (``defaults``: vLLM's rule),
    unset and neutral others stay out."""
    if req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
    defaults = state.defaults

    def given(value, default):
        return default if value is None else value

    settings = dict(max_new_tokens=max_tokens, num_return_sequences=req.n)
    temperature = given(req.temperature, defaults.temperature)
    settings["do_sample"] = temperature >= GREEDY_BELOW
    top_k = given(req.top_k, defaults.top_k)
    chat = isinstance(req, ChatCompletionRequest)
    logprobs, prompt_logprobs = logprob_counts(state, req, chat)
    optional = dict(
        seed=req.seed, stop_strings=list(req.stops()) or None, ignore_eos=req.ignore_eos or None,
        min_tokens=_off(req.min_tokens, 0), repetition_penalty=_off(given(req.repetition_penalty,
                                                                          defaults.repetition_penalty), 1.0),
        presence_penalty=_off(req.presence_penalty, 0.0),
        frequency_penalty=_off(req.frequency_penalty, 0.0), logit_bias=logit_bias(state, req.logit_bias),
        bad_words_ids=bad_words_ids(state, req.bad_words),
        allowed_token_ids=token_list(state, req.allowed_token_ids, "allowed_token_ids"),
        stop_token_ids=token_list(state, req.stop_token_ids, "stop_token_ids"),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    if settings["do_sample"]:        # greedy: these only filter what sampling draws from
        optional.update(temperature=temperature, top_p=given(req.top_p, defaults.top_p),
                        top_k=max(top_k, 0), min_p=_off(given(req.min_p, defaults.min_p), 0.0))
    settings.update({k: v for k, v in optional.items() if v is not None})
    return settings


async def engine_settings(state, req, max_tokens: int, tools: ToolUse | None = None, thinking=None) -> dict:
    """``generation_settings`` plus ``structured_output``: the request's grammar (or its tool calls'), compiled;
    ``thinking``: a ``reasoning.Reasoning`` whose end of thinking the grammar waits for."""
    settings = generation_settings(req, max_tokens, state)
    asked = structured_spec(req)
    calls = tools.grammar() if tools is not None else None
    if calls is not None and asked is not None:       # vLLM's rules for both
        if tools.mode != "auto":                      # a call is forced: the structured output is ignored
            log.warning("%s is ignored: tool_choice %r forces a tool call (as vLLM)", asked[0],
                        tools.name or tools.mode)
        elif any(t["function"].get("strict") is True for t in tools.tools):
            calls = tools.either(asked[1])             # calls, or the asked format (None: the format alone)
        else:                                          # auto, one call at most, no strict tool: the format alone
            calls = None
    if calls is not None:
        asked = ("tools", calls)
    if asked is not None:
        gate = {} if thinking is None else {"after_token": thinking.end,
                                            "from_token": thinking.tool if thinking.kind == "qwen3" else None}
        settings["structured_output"] = await compile_structured(state.engine, *asked, **gate)
    return settings


async def sampling_params(state: ServerState, req, prompts: list[list[int]], max_tokens: int | None,
                          tools: ToolUse | None = None, reasoner: Reasoner | None = None):
    """The engine's SamplingParams for every prompt of ``req`` (400 for what ``generate`` refuses); ``tools``:
    the chat request's tool calling (``chat_tools``); ``reasoner``: its reasoning parser (``chat_reasoner``). With a
    reasoning parser a grammar waits for the end of thinking, as vLLM's (completions' too), unless every prompt ended
    it or include_reasoning is false; qwen3's ``<tool_call>`` ends the wait too, and the grammar takes it."""
    given = max_tokens is not None
    max_tokens = context_checked(prompts, max_tokens, state.max_model_len, state.engine.model_len)
    if max_tokens == 0:        # echo only: counted as 0 (vLLM's check), the engine runs one token the answer drops
        max_tokens = 1
    if not given and state.defaults.max_tokens is not None:    # vLLM: the generation config's max_new_tokens
        max_tokens = min(max_tokens, state.defaults.max_tokens)   # where the request gives no max_tokens
    gate = reasoner or (state.reasoning.for_request({}) if state.reasoning is not None else None)
    waits = gate is not None and getattr(req, "include_reasoning", True) and not all(map(gate.ended, prompts))
    settings = await engine_settings(state, req, max_tokens, tools, gate.parser if waits else None)
    budget = getattr(req, "thinking_token_budget", None)
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < -1):
        raise ApiError(400, "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
                       param="thinking_token_budget")
    if budget is not None and budget != -1:          # vLLM's words where no reasoning parser marks the thinking
        if state.reasoning is None:
            raise ApiError(400, "thinking_token_budget is set but reasoning_config is not configured. Please set "
                                "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
                           param="thinking_token_budget")
        if state.reasoning.start is not None and state.reasoning.end is not None:   # (else ignored, as vLLM's)
            settings["thinking_budget"] = (state.reasoning.start, state.reasoning.end, budget)
    if req.n > 1 and not settings["do_sample"]:          # generate refuses it in its own words
        why = "temperature is 0" if req.temperature is not None else "no temperature was given and the model's " \
            "generation config sets temperature 0"
        raise ApiError(400, f"n={req.n} asks several sequences per prompt, but {why}: greedy decoding makes one; "
                            "set temperature > 0 (sampling) or n=1", param="n", code="invalid_sampling")
    try:
        params = resolve_generation(state.base, **settings)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_sampling")
    # n beyond max_num_seqs runs as several engine requests (ApiCall, engine_parts): checked as the largest
    part = engine_parts(params, state.engine.config.max_num_seqs)[0][1]
    for why in filter(None, (state.engine.never_fits(len(prompt), part) for prompt in prompts)):
        raise ApiError(400, why, param="max_tokens", code="context_too_long")     # before a stream's status line
    return params


def chat_tools(state: ServerState, req) -> ToolUse | None:
    """A chat request's tool calling (``tool_choice.tool_use``: None without it), with the server's flags."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    return tool_use(req, state.config.tool_call_parser, state.config.enable_auto_tool_choice)


def chat_reasoner(state: ServerState, req) -> Reasoner | None:
    """A chat request's reasoning parser (None without ``--reasoning-parser``), with its template's options."""
    if not isinstance(req, ChatCompletionRequest) or state.reasoning is None:
        return None
    return state.reasoning.for_request(template_options(req))


def call_options(req, tools: ToolUse | None = None, reasoner: Reasoner | None = None) -> CallOptions:
    """How ``req``'s answer is rendered (the engine's settings aside); ``tools``: its tool calling. hermes
    keeps special tokens in the text, as vLLM's parser asks (a model may mark ``<tool_call>`` special)."""
    chat = isinstance(req, ChatCompletionRequest)
    return CallOptions(n=req.n, stops=req.stops(), include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens and (tools is None or tools.parser != "hermes"),
                       tools=tools, reasoning=reasoner, include_reasoning=not chat or req.include_reasoning,
                       logprobs=generated_logprobs(req, chat)[0],
                       echo=bool(chat_echo(req) if chat else req.echo),
                       max_tokens_zero=not chat and req.max_tokens == 0,
                       prompt_logprobs=asked_prompt_logprobs(req, chat), chat=chat,
                       role=answer_role(req) if chat else "",
                       return_tokens_as_token_ids=bool(req.return_tokens_as_token_ids),
                       return_token_ids=bool(req.return_token_ids),
                       min_tokens=req.min_tokens or 0,
                       continuous_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage
                                             and req.stream_options.continuous_usage_stats))


def chat_request(fields: dict, state: ServerState) -> ChatCompletionRequest:
    """The chat completion another API's request converts to (``fields``; None values left out), validated and
    checked as the chat endpoint checks one."""
    try:
        req = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc) from None
    return checked(req, state)


async def api_call(state: ServerState, req, prompts: list[list[int]], texts=None) -> ApiCall:
    """The call that runs ``prompts`` with ``req``'s settings (not submitted yet); ``texts``: the prompts' texts
    an echo answers (None where the ids are decoded)."""
    tools, reasoner = chat_tools(state, req), chat_reasoner(state, req)
    params = await sampling_params(state, req, prompts, requested_max_tokens(req), tools, reasoner)
    return ApiCall(state.worker, state.tokenizer, prompts, params, call_options(req, tools, reasoner), texts)


async def start_chat_call(state: ServerState, req: ChatCompletionRequest) -> ApiCall:
    """A checked chat request's prompt tokenized, its settings resolved and its engine requests submitted
    (the APIs answered through chat completions: Anthropic's Messages, OpenAI's Responses)."""
    call = await api_call(state, req, [await state.off_loop(chat_prompt, state, req)])
    call.submit()
    return call
