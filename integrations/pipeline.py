"""``pipeline("text-generation")`` over lists of prompts through the hf_paged engine.

The seam: a ``TextGenerationPipeline`` subclass, handed to transformers' own ``pipeline()`` through
its public ``pipeline_class`` argument (``hf_paged.pipeline(...)`` does that for you). A pipeline
gives ``model.generate`` one batch at a time, so a patched model's ``generate`` never sees the whole
list; continuous batching needs the list up front (finished requests leave, waiting ones join across
what would have been batch boundaries). Reaching the pipeline object from the model would take a
process-wide patch of transformers, which hf_paged only does on explicit opt-in. So the subclass
keeps the pipeline's own preprocessing (tokenizer, chat template, prefix) and postprocessing
(``return_full_text``, ``return_tensors``, decoding) and replaces only the batched generate calls with
one engine run over the whole list. Single prompts, and lists asking for what the engine does not do
(beam search, scores, no_repeat_ngram_size, ...: whatever ``resolve_generation`` refuses), take the stock
path unchanged, which also raises transformers' own errors for bad values. ``batch_size`` is accepted and
ignored for lists: the engine's ``max_num_seqs`` / ``max_num_batched_tokens`` schedule instead.

    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, max_num_seqs=32)
    pipe(list_of_prompts, max_new_tokens=64)          # the stock pipeline's records, per prompt (greedy; sampled
                                                      # ones draw with the engine's own per-request seeds)
    pipe.engine_stats()
"""
from __future__ import annotations

from transformers import TextGenerationPipeline
from transformers.utils.chat_template_utils import Chat, is_valid_message

from hf_paged.engine import LLM
from hf_paged.engine.llm import split_options
from hf_paged.engine.settings import resolve_generation

_STOCK_ONLY = ("num_beams", "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
               "output_hidden_states", "assistant_model", "streamer", "stopping_criteria", "logits_processor",
               "prefix_allowed_tokens_fn")


class PagedTextGenerationPipeline(TextGenerationPipeline):
    """TextGenerationPipeline whose lists of prompts run through one continuous-batching engine (kept
    across calls, so its prefix cache is too). ``engine_options``: EngineConfig knobs."""

    def __init__(self, *args, engine_options: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_options = dict(engine_options or {})
        self._llm: LLM | None = None

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = LLM(self.model, self.tokenizer, **self.engine_options)
        return self._llm

    def engine_stats(self) -> dict:
        return self.llm.stats() if self._llm is not None else {}

    def __call__(self, text_inputs, **kwargs):
        records = run_list_through_engine(self, self.llm, text_inputs, kwargs)
        return records if records is not None else super().__call__(text_inputs, **kwargs)


def run_list_through_engine(pipe: TextGenerationPipeline, llm: LLM, text_inputs, kwargs: dict):
    """The records ``pipe(text_inputs, **kwargs)`` returns, computed by one engine run over the list;
    None when the call is not a list the engine serves (the caller then takes the stock path)."""
    items = _as_list(text_inputs)
    if items is None or any(k in kwargs or k in kwargs.get("generate_kwargs", {}) for k in _STOCK_ONLY):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("batch_size", "num_workers")}
    pre, fwd, post = pipe._sanitize_parameters(**kwargs)
    pre = {**pipe._preprocess_params, **pre}
    fwd = {**pipe._forward_params, **fwd}
    post = {**pipe._postprocess_params, **post}
    inputs = [pipe.preprocess(item, **pre) for item in items]
    if any(x["input_ids"].shape[1] == 0 for x in inputs):
        return None                                          # empty prompts: generate starts from BOS
    params = []
    for x in inputs:
        generate_kwargs = _pipeline_generate_kwargs(pipe, dict(fwd))
        generate_kwargs.pop("tokenizer", None)        # stop strings: the engine decodes with the pipeline's own
        knobs, settings = split_options(generate_kwargs)
        if knobs:
            raise ValueError(f"engine knob(s) {sorted(knobs)} are set when the pipeline is built "
                             "(hf_paged.pipeline(..., block_size=...) or engine_options={...}), not per call")
        try:
            params.append(resolve_generation(pipe.model.generation_config, **settings))   # as generate resolves them
        except ValueError:
            return None        # a setting the engine does not do (or a bad value): the stock path, its own errors
    engine, ids = llm.engine, []
    try:
        for i, (x, p) in enumerate(zip(inputs, params)):
            ids.append(engine.add_request(x["input_ids"][0], prompt_index=i, params=p))
        engine.run()
    except BaseException:      # an error or Ctrl-C: nothing of this call runs on, and no record of it stays
        for rid in ids:
            if rid in engine.requests:
                engine.cancel(rid)
                engine.forget(rid)
        raise
    records = []
    outputs = [engine.forget(rid) for rid in ids]          # the engine keeps no record of them
    for out, x in zip(outputs, inputs):
        if out.error is not None:
            raise ValueError(f"prompt {out.prompt_index}: {out.error}")
        model_outputs = {"generated_sequence": out.sequences.unsqueeze(0), "input_ids": x["input_ids"],
                         "prompt_text": x["prompt_text"]}
        records.append(pipe.postprocess(model_outputs, **post))
    return records


def _pipeline_generate_kwargs(pipe: TextGenerationPipeline, generate_kwargs: dict) -> dict:
    """The keyword arguments ``pipe._forward`` would give ``model.generate`` (both ends of the range)."""
    prefix_length = generate_kwargs.pop("prefix_length", 0)
    if hasattr(pipe, "_prepare_generate_kwargs"):           # transformers >= 5.2x
        generate_kwargs = pipe._prepare_generate_kwargs(generate_kwargs)
        if prefix_length:
            set_params = pipe._get_set_generation_params(generate_kwargs)
            for length, new in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
                if length in set_params and new not in set_params:
                    generate_kwargs[length] = set_params[length] + prefix_length
        return generate_kwargs
    config = generate_kwargs.get("generation_config")       # transformers 5.17: TextGenerationPipeline._forward
    if prefix_length > 0:
        if "max_new_tokens" not in generate_kwargs and (config is None or config.max_new_tokens is None):
            generate_kwargs["max_length"] = (generate_kwargs.get("max_length") or pipe.generation_config.max_length
                                             ) + prefix_length
        if ("min_new_tokens" not in generate_kwargs and (config is None or config.min_new_tokens is None)
                and "min_length" in generate_kwargs):
            generate_kwargs["min_length"] += prefix_length
    generate_kwargs.setdefault("generation_config", pipe.generation_config)
    return generate_kwargs


def stock_pipeline_call(original, is_patched, engine_knobs):
    """For ``hf_paged.enable()``: ``TextGenerationPipeline.__call__`` that sends lists of prompts to the
    engine when the pipeline's model is patched (``is_patched(model)``); every other call goes to
    ``original`` untouched. The engine (and its prefix cache) lives on the pipeline object, built with the
    knobs the patch's options mean (``engine_knobs(model)``: block size, KV format, pool, prefix caching)
    and built anew when they change (the model patched again with other options)."""

    def __call__(self, text_inputs, *args, **kwargs):
        if args or isinstance(self, PagedTextGenerationPipeline) or not is_patched(self.model):
            return original(self, text_inputs, *args, **kwargs)
        knobs = engine_knobs(self.model)
        built = self.__dict__.get("_hf_paged_llm")
        if built is None or built[0] != knobs:
            built = self.__dict__["_hf_paged_llm"] = (knobs, LLM(self.model, self.tokenizer, **knobs))
        llm = built[1]
        records = run_list_through_engine(self, llm, text_inputs, kwargs)
        return records if records is not None else original(self, text_inputs, **kwargs)

    __call__.__hf_paged_original__ = original
    return __call__


def _as_list(text_inputs):
    """The prompts of a list call (str or chats), or None for a single prompt / other input types."""
    if not isinstance(text_inputs, (list, tuple)) or not text_inputs or is_valid_message(text_inputs[0]):
        return None
    if all(isinstance(x, str) for x in text_inputs):
        return list(text_inputs)
    if all(isinstance(x, (list, tuple)) and x and is_valid_message(x[0]) for x in text_inputs):
        return [Chat(x) for x in text_inputs]
    return None


def pipeline(task: str = "text-generation", model=None, *, engine_options: dict | None = None, **kwargs):
    """``transformers.pipeline(task, model, ...)`` whose lists of prompts run through the engine.

    Only ``"text-generation"``. Engine knobs (EngineConfig fields: block_size, max_num_seqs, ...) may be
    passed as keywords or in ``engine_options``; every other keyword goes to ``transformers.pipeline``."""
    from transformers import pipeline as hf_pipeline

    if task != "text-generation":
        raise ValueError(f"hf_paged.pipeline supports task='text-generation', got {task!r}")
    knobs, kwargs = split_options(kwargs)
    options = dict(engine_options or {})
    both = sorted(set(knobs) & set(options))
    if both:
        raise ValueError(f"engine option(s) {both} given both as keywords and in engine_options; pass each once")
    options.update(knobs)
    return hf_pipeline(task, model=model, pipeline_class=PagedTextGenerationPipeline,
                       engine_options=options, **kwargs)
