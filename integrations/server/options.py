"""How one API call's answer is rendered, beside the engine's settings (which ``intake`` resolves)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallOptions:
    """n: sequences per prompt. stops: OpenAI's ``stop`` strings (the text is cut before the first).
    include_stop_str_in_output: keep the stop string (vLLM's extension). skip_special_tokens: leave
    special tokens out of the text. logprobs: top-k log-probabilities per generated token (completions'
    ``logprobs``; chat's ``top_logprobs`` when ``logprobs`` is true), None for none. echo: completions
    answer the prompt's text (and, with ``logprobs``, its log-probabilities) before the completion; chat
    answers the last message's text first (vLLM's chat echo: ``intake.chat_echo``).
    max_tokens_zero: ``max_tokens`` was 0 (echo only): the one token the engine makes is dropped.
    prompt_logprobs: vLLM's ``prompt_logprobs`` extension (top-k per prompt token). chat: the call is a
    chat completion. return_tokens_as_token_ids: tokens written "token_id:N" (vLLM's extension).
    min_tokens: vLLM's (a stop string must end after the first min_tokens tokens' text).
    continuous_usage: vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's usage.
    role: a chat answer's role (``intake.answer_role``). return_token_ids: vLLM's, each choice carries its
    token ids (all of them: an EOS or stop token too) and the prompt's ids. tools: a chat answer's tool
    calling (``tool_choice.ToolUse``), None without it: its text is read for calls. reasoning: a chat answer's
    reasoning parser (``reasoning.Reasoner``), None without one; include_reasoning: vLLM's (false: the thinking,
    its log-probabilities and token ids are left out)."""
    n: int = 1
    stops: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    echo: bool = False
    max_tokens_zero: bool = False
    prompt_logprobs: int | None = None
    chat: bool = False
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    min_tokens: int = 0
    continuous_usage: bool = False
    role: str = ""
    tools: object = None
    reasoning: object = None
    include_reasoning: bool = True
