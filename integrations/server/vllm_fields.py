"""vLLM's extension fields, shared by /v1/completions and /v1/chat/completions, and what this server
does with each field of a request: implements it, ignores it (no effect on the answer), or accepts it
only with its neutral value (refused with a 400 naming it otherwise, since serving the request without
what it asked for would answer something else).

The field list follows vLLM's ``CompletionRequest`` / ``ChatCompletionRequest`` (vllm/entrypoints/openai
/completion/protocol.py, chat_completion/protocol.py) plus the older ``guided_*`` fields of
vllm/entrypoints/openai/protocol.py, which clients still send.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from .request_parts import Body, RepetitionDetection, ResponseFormat, StructuredOutputsParams

BEAM = "beam search is not implemented by this engine"
TOOLS = ("tool calling is answered on /v1/chat/completions (with --enable-auto-tool-choice --tool-call-parser), "
         "not on this API")
TEXT_ONLY = "this server serves text-only models"

# name -> why only its neutral value (None, the default, empty) is accepted
NEUTRAL_ONLY = {
    "use_beam_search": BEAM, "length_penalty": "length_penalty applies to beam search; " + BEAM,
    "early_stopping": "early_stopping applies to beam search; " + BEAM,
    "best_of": "best_of other than n is not supported (vLLM's current engine dropped it too)",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "watermarking": "watermarking is not implemented",
    "spaces_between_special_tokens": "only spaces_between_special_tokens=true is implemented",
    "logprob_token_ids": "logprob_token_ids is not implemented; ask for the top k with logprobs",
    "prompt_embeds": "prompt embeddings are not accepted; send text or token ids",
    "priority": "priority scheduling is not implemented (requests are served first come, first served)",
    "return_prompt_text": "return_prompt_text is not implemented",
    "routed_experts_prompt_start": "routed-expert data is not returned by this server",
    "cache_salt": ("prefix-cache salting is not implemented; a salted request is refused rather than "
                   "served with blocks other requests share"),
    "kv_transfer_params": "disaggregated serving (KV transfer) is not implemented",
    "ec_transfer_params": "disaggregated serving (encoder-cache transfer) is not implemented",
    "vllm_xargs": "vLLM's custom-extension arguments have no counterpart in this server",
    "repetition_detection": "repetition detection is not implemented",
    "logits_processors": "custom logits processors cannot be loaded by this server",
    "structural_tag": "structural tags are not implemented; use structured_outputs json, regex, choice or grammar",
    "guided_whitespace_pattern": "a custom JSON whitespace pattern is not implemented",
    "chat_template": ("a request's own chat template is not trusted (vLLM too refuses it unless started "
                      "with --trust-request-chat-template); the tokenizer's template is used"),
    "mm_processor_kwargs": TEXT_ONLY, "media_io_kwargs": TEXT_ONLY,
}
# name -> why any value is accepted and has no effect
IGNORED = {
    "user": "OpenAI's end-user id", "service_tier": "an OpenAI account feature",
    "store": "an OpenAI account feature", "metadata": "an OpenAI account feature",
    "request_id": "a tracing id; the answer's id is the server's own", "session_id": "a tracing id",
    "return_token_offsets": "vLLM reads it on its /render endpoints only",
    "return_mm_kwargs": "vLLM reads it on its /render endpoints only",
    "stream_interval": "a batching hint for streamed chunks; each token is sent as it comes",
    "guided_decoding_backend": "one grammar backend here; the constraint is the same",
}
# implemented fields (the rest of each schema), for the record and the test that every field is placed
IMPLEMENTED = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "stream",
    "stream_options", "temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "prompt_logprobs",
    "echo", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "truncation_side",
    "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "return_tokens_as_token_ids", "return_token_ids", "add_generation_prompt",
    "continue_final_message", "documents", "chat_template_kwargs", "reasoning_effort", "tools", "tool_choice",
    "parallel_tool_calls", "include_reasoning", "thinking_token_budget",
}


def is_neutral(req, name: str) -> bool:
    """``name``'s value leaves the answer as if it were absent: None, the field's default, empty, false
    for a flag whose default is unset; for
    best_of, n."""
    value = getattr(req, name)
    if value is None or (isinstance(value, (str, list, dict)) and not value):
        return True
    if name == "best_of":
        return value == req.n
    if name == "repetition_detection":
        return value.max_pattern_size == 0
    default = type(req).model_fields[name].get_default(call_default_factory=True)
    return value == default or (default is None and value is False)       # an unset flag, sent as false


def refused_field(req) -> Optional[tuple[str, str]]:
    """(param, message) for the first field that asks for what this server does not implement."""
    fields = type(req).model_fields
    for name, why in NEUTRAL_ONLY.items():
        if name in fields and not is_neutral(req, name):
            return name, f"{name}={getattr(req, name)!r:.80} is not supported: {why}"
    return None


class VllmSampling(Body):
    """vLLM's extension fields of both endpoints (its ``--8<-- sampling-params`` and ``extra-params``)."""
    use_beam_search: bool = False
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    watermarking: Optional[bool] = None
    length_penalty: float = 1.0
    early_stopping: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    allowed_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = Field(None, ge=-1)
    logprob_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_embeds: Optional[Union[str, list[str]]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structural_tag: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    priority: int = 0
    request_id: Optional[str] = None
    session_id: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: Optional[bool] = None
    return_mm_kwargs: bool = True
    cache_salt: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    ec_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None
    repetition_detection: Optional[RepetitionDetection] = None
    thinking_token_budget: Optional[Any] = None     # checked in intake (vLLM's words)
    stream_interval: Optional[int] = Field(None, ge=1)
    logits_processors: Optional[list[Any]] = None
