"""``hf_paged.LLM``: the engine's offline API (``hf_paged.engine.LLM``), also built the way vLLM's is, from a
checkpoint: ``LLM("path/to/checkpoint", dtype="float32")``, a hub id already in the local cache, or
``"smollm2"`` (the embedded SmolLM2-135M-Instruct); loaded by the server's loader
(``integrations.server.loading.load_model``: ChatGLM directories and ``quantization`` schemes included)."""
from __future__ import annotations

import os

from collections.abc import Mapping

from hf_paged.engine import LLM as EngineLLM
from hf_paged.engine.llm import prompt_list

from .vllm_params import SamplingParams, as_vllm_output


class LLM(EngineLLM):
    """``hf_paged.engine.LLM`` on a loaded model, or on the checkpoint ``model`` names (a path or hub id).

    Loading options (a path only): ``dtype`` ("auto": the checkpoint's; "float32", "bfloat16", ... or a
    torch.dtype), ``device`` (default: "cuda" when there is a GPU), ``quantization`` (as ``hf-paged serve
    --quantization``), ``trust_remote_code`` (a ChatGLM directory's tokenizer), ``tokenizer`` (a path / hub id
    or a tokenizer object; default: the checkpoint's). Every other keyword is an engine knob (EngineConfig).
    ``generate`` / ``chat`` also take vLLM's ``SamplingParams`` (``integrations.vllm_params``).
    """

    def __init__(self, model, tokenizer=None, *, dtype="auto", device: str | None = None,
                 quantization: str | None = None, trust_remote_code: bool = False, **knobs):
        if isinstance(model, (str, os.PathLike)):
            from .server.loading import load_model

            model, tokenizer = load_model(os.fspath(model), dtype, device, trust_remote_code, tokenizer, quantization)
        else:
            given = [name for name, value, unset in (("dtype", dtype, "auto"), ("device", device, None),
                                                     ("quantization", quantization, None),
                                                     ("trust_remote_code", trust_remote_code, False))
                     if value != unset]
            if given:
                raise ValueError(f"{', '.join(given)} apply when LLM loads the model from a path; for a model already "
                                 "loaded, convert or move it first (model.to(...)) and pass it as it is")
        super().__init__(model, tokenizer, **knobs)

    def generate(self, prompts, settings=None, *, sampling_params=None, on_token=None, use_tqdm=None, **common):
        """The engine's ``generate``; with vLLM's SamplingParams (``settings`` or ``sampling_params``: one, or
        one per prompt; ours or vLLM's own object) the settings, text and finish reasons are vLLM's."""
        if sampling_params is not None:
            if settings is not None:
                raise ValueError("pass settings or sampling_params (vLLM's name), not both")
            settings = sampling_params
        prompts = prompt_list(prompts)         # once: a generator is read here, not again by the engine
        vllm = _vllm_params(settings, len(prompts))
        if vllm is None:
            return super().generate(prompts, settings, on_token=on_token, use_tqdm=use_tqdm, **common)
        if common:
            raise ValueError(f"{sorted(common)} given beside SamplingParams: set them in the SamplingParams")
        engine = self.engine
        vocab = engine.model.get_input_embeddings().weight.shape[0]
        outs = super().generate(prompts, [p.settings(engine.tokenizer, vocab) for p in vllm], on_token=on_token,
                                use_tqdm=use_tqdm)
        eos = _eos_ids(engine)
        return [as_vllm_output(out, p, engine.tokenizer, eos) for out, p in zip(outs, vllm)]

    def stream(self, prompts, settings=None, *, on_token=None, use_tqdm=None, **common):
        """The engine's ``stream``; vLLM's SamplingParams (one, or one per prompt) give its settings (the
        events carry tokens: vLLM's text rules apply to ``generate``'s outputs)."""
        prompts = prompt_list(prompts)
        vllm = _vllm_params(settings, len(prompts))
        if vllm is not None:
            if common:
                raise ValueError(f"{sorted(common)} given beside SamplingParams: set them in the SamplingParams")
            vocab = self.engine.model.get_input_embeddings().weight.shape[0]
            settings = [p.settings(self.engine.tokenizer, vocab) for p in vllm]
        return super().stream(prompts, settings, on_token=on_token, use_tqdm=use_tqdm, **common)

    def chat(self, messages, sampling_params=None, *, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, use_tqdm=None, **settings):
        """vLLM's ``LLM.chat``: one conversation (a list of {"role", "content"} messages) or a list of them,
        through the tokenizer's chat template (its text tokenized without special tokens: the template writes
        them), then ``generate``; ``RequestOutput.prompt`` is the templated text."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template: hf_paged.LLM(model, tokenizer)")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        texts = [tokenizer.apply_chat_template(list(c), tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **(chat_template_kwargs or {})) for c in conversations]
        prompts = [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        outs = self.generate(prompts, sampling_params=sampling_params, use_tqdm=use_tqdm, **settings)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's name)."""
        return self.engine.tokenizer


def _vllm_params(settings, count: int) -> list[SamplingParams] | None:
    """One SamplingParams per prompt when ``settings`` is vLLM's (one, or a list of them), else None."""
    def is_vllm(s):
        return isinstance(s, SamplingParams) or (not isinstance(s, Mapping) and hasattr(s, "max_tokens"))
    if settings is None or isinstance(settings, Mapping):
        return None
    if is_vllm(settings):
        return [SamplingParams.read(settings)] * count
    if isinstance(settings, (list, tuple)) and settings and all(is_vllm(s) for s in settings):
        if len(settings) != count:
            raise ValueError(f"{len(settings)} SamplingParams for {count} prompts")
        return [SamplingParams.read(s) for s in settings]
    return None


def _eos_ids(engine) -> frozenset:
    """The ids the engine ends a sequence on as EOS: the model's generation config's, and the tokenizer's."""
    found = set()
    for eos in (getattr(engine.model.generation_config, "eos_token_id", None),
                getattr(engine.tokenizer, "eos_token_id", None)):
        found |= set([] if eos is None else [eos] if isinstance(eos, int) else eos)
    return frozenset(found)
