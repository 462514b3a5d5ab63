"""The generate hook: turns ``cache_implementation="paged"`` into a PagedCache before transformers sees it.

transformers routes the keyword ``cache_implementation="paged"`` to its own continuous batching and
silently gives a DynamicCache when "paged" comes in a GenerationConfig. The hook looks in all three
places (keyword, passed config, ``model.generation_config``), builds a PagedCache, and turns transformers'
own route off: ``cache_implementation=None`` in a copy of a passed config (a keyword beside one makes
transformers log a deprecation), or as a keyword where there is no passed config or ``model.generation_config``
holds a value that would refill the copy's None. Pipelines call ``model.generate``, so they go through the
same hook.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_paged.attention_interface import cache_keyword
from hf_paged.cache import PagedCache
from hf_paged.families import config_geometry
from hf_paged.introspect import length_dependent_rope, model_geometry

PAGED = "paged"


def _setting(name, kwargs, generation_config, model):
    """A generation setting as generate resolves it: keyword, then passed config, then the model's."""
    if name in kwargs:
        return kwargs[name]
    for config in (generation_config, model.generation_config):
        value = getattr(config, name, None) if config is not None else None
        if value is not None:
            return value
    return None


def wants_paged(kwargs: dict, generation_config, model) -> bool:
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"] == PAGED
    for config in (generation_config, model.generation_config):
        if config is not None and getattr(config, "cache_implementation", None) is not None:
            return config.cache_implementation == PAGED
    return False


def paged_generate(model, generate, args: tuple, kwargs: dict, cache_options: dict, on_cache=None,
                   scope=contextlib.nullcontext, prefix_store=None):
    """Run ``generate(*args, **kwargs)`` with a PagedCache when asked for one; pass through otherwise.

    generate: the model's bound generate; args: its positional arguments (inputs, generation_config, ...).

    cache_options: keyword arguments for PagedCache built here (block_size, num_blocks, ...).
    on_cache: called with the cache once generate returns (to record its stats).
    scope: context manager factory wrapped around the paged call (switches the attention implementation).
    prefix_store: called with a cache built here, returns the model's PrefixStore (prefix caching across
        calls) or None.
    """
    generation_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    asked = wants_paged(kwargs, generation_config, model)
    if not asked and not isinstance(cache, PagedCache):
        return generate(*args, **kwargs)
    if kwargs.get("use_cache") is False:
        raise ValueError("use_cache=False recomputes the whole sequence at every step: there is no KV cache to "
                         "page. Drop use_cache=False, or generate without cache_implementation='paged' / a PagedCache.")
    if cache is not None and not isinstance(cache, PagedCache):
        raise ValueError(f"cache_implementation='paged' and a {type(cache).__name__} were both passed; pass one: "
                         "drop the cache to page this call, or cache_implementation to use your cache")
    _refuse_right_padding(args, kwargs, generation_config, model)
    kwargs = dict(kwargs)
    overrides = {"cache_implementation": None} if asked else {}     # this hook builds the cache, not generate
    if _setting("use_cache", kwargs, generation_config, model) is False:
        # a generation config's use_cache false (a checkpoint saved while training with gradient checkpointing,
        # or the pipeline's copy of it) asks nothing of this call: paging was asked, and a cache changes no token
        overrides["use_cache"] = True
    if generation_config is not None and all(getattr(model.generation_config, k, None) in (None, v)
                                             for k, v in overrides.items()):
        # Into a copy of the passed config: next to one, keywords make transformers warn that mixing them is
        # deprecated. Only where the model's config holds nothing else for them: a copy's default value would be
        # refilled from it.
        generation_config = copy.deepcopy(generation_config)
        for key, value in overrides.items():
            setattr(generation_config, key, value)
            kwargs.pop(key, None)        # the caller's own keyword for it ("paged") goes too
        if "generation_config" in kwargs:
            kwargs["generation_config"] = generation_config
        else:
            args = (args[0], generation_config, *args[2:])
    else:
        kwargs.update(overrides)     # as keywords: a passed config's values lose to the model's where they are defaults
    if cache is None:
        options = dict(cache_options)
        options.setdefault("dtype", model.dtype)
        options.setdefault("device", model.device)
        cache = PagedCache(model.config, geometry=model_geometry(model), **options)
        kwargs[cache_keyword(model)] = cache
        store = prefix_store(cache) if prefix_store is not None else None
        if store is not None:
            _attach_prefix(store, cache, args, kwargs, generation_config, model)
    elif cache.pool is None and cache.geometry == config_geometry(model.config):
        # Built from this model's config and not used yet: take the heads this process holds (a
        # tensor-parallel rank holds a share of them) and where each layer runs.
        cache.geometry = model_geometry(model)
    else:
        _check_cache_fits(cache, model)
    eos = _setting("eos_token_id", kwargs, generation_config, model)
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    num_beams = _setting("num_beams", kwargs, generation_config, model) or 1
    # Beam search may keep a beam whose last token is EOS among the running ones: keep its blocks.
    cache.begin_generate(eos_ids if num_beams == 1 else frozenset())
    # A finished row leaves the decode forwards. Not on a length-dependent RoPE: its frequencies follow each
    # forward's longest position, and the default path's finished rows keep theirs growing, so without the
    # longest row the others would take other frequencies (``introspect.length_dependent_rope``).
    if num_beams == 1 and eos_ids and cache.release_finished_rows and len(args) < 4 \
            and length_dependent_rope(model) is None:       # args[3]: stopping_criteria
        _report_sampled_tokens(cache, kwargs)
    try:
        with scope():
            return generate(*args, **kwargs)
    finally:
        if on_cache is not None:
            on_cache(cache)


def _check_cache_fits(cache: PagedCache, model) -> None:
    """A passed PagedCache holds this model's KV geometry (layers, KV heads, head size, windows), else a
    ValueError naming both (a cache built for another model failed deep inside a layer)."""
    have, want = cache.geometry, model_geometry(model)
    mine = (have.num_layers, have.num_kv_heads, have.head_dim, have.sliding_windows)
    theirs = (want.num_layers, want.num_kv_heads, want.head_dim, want.sliding_windows)
    if mine != theirs:
        raise ValueError(f"this PagedCache was built for {have.num_layers} layers of {have.num_kv_heads} KV heads of "
                         f"size {have.head_dim} (windows {set(have.sliding_windows)}); this model has "
                         f"{want.num_layers} x {want.num_kv_heads} x {want.head_dim} (windows "
                         f"{set(want.sliding_windows)}). Build the cache from this model: "
                         "PagedCache(model.config, ...)")


def _refuse_right_padding(args: tuple, kwargs: dict, generation_config, model) -> None:
    """Refuse a batch whose rows end in padding (an attention mask whose last column masks a row that has
    real tokens; without a mask, rows ending in the pad token): decoder-only generation continues each row
    from its last column. transformers warns and generates from the pad; the paged path would sample from
    zero logits (a pad token first). A ValueError naming the row and the fix."""
    mask = kwargs.get("attention_mask")
    input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 0:
        ends = (mask[:, -1] == 0) & (mask != 0).any(-1)
    elif mask is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] > 0:
        pad = _setting("pad_token_id", kwargs, generation_config, model)
        eos = _setting("eos_token_id", kwargs, generation_config, model)
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        if not isinstance(pad, int) or pad in eos:        # generate infers no mask from such a pad
            return
        ends = (input_ids[:, -1] == pad) & (input_ids != pad).any(-1)
    else:
        return
    if bool(ends.any()):
        row = int(ends.nonzero()[0, 0])
        raise ValueError(f"row {row} of the batch is right-padded (its last column is padding): a decoder-only "
                         "model continues each row from its last column, so pad on the left (tokenizer.padding_side "
                         "= 'left'; transformers warns that right padding gives wrong results)")


class _SampledTokens(StoppingCriteria):
    """Stops nothing; tells the cache each step's sampled tokens (``PagedCache.note_generated``), so that
    only an EOS generate sampled finishes a row, never one in the prompt."""

    def __init__(self, cache):
        self.cache = cache

    def __call__(self, input_ids, scores, **kwargs):
        self.cache.note_generated(input_ids[:, -1])     # no host sync here (generate makes a new input_ids per step)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _report_sampled_tokens(cache, kwargs: dict) -> None:
    """Add ``_SampledTokens`` to the call's stopping criteria (a copy of the user's list, theirs kept)."""
    given = kwargs.get("stopping_criteria")
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(given or []), _SampledTokens(cache)])


def chunked_prefill_continues() -> bool:
    """Whether this transformers' chunked prefill starts after the columns a cache already holds (5.24
    does; 5.17 chunks the whole prompt from column 0)."""
    import transformers  # noqa: PLC0415
    from packaging.version import Version  # noqa: PLC0415  (a dependency of transformers)
    return Version(transformers.__version__) >= Version("5.24")


_NO_PREFIX_SETTINGS = ("output_hidden_states", "output_attentions", "assistant_model", "prompt_lookup_num_tokens",
                       "assistant_early_exit", "candidate_generator")


def _attach_prefix(store, cache, args: tuple, kwargs: dict, generation_config, model) -> None:
    """Give a fresh cache the prompt columns the model's prefix store holds (see cache.prefix_store).
    Not for calls whose outputs would show the skipped columns (per-layer outputs of the prefill), that
    start from embeddings or give their own position_ids (the blocks hold keys rotated at the positions of the
    call that wrote them; the store matches tokens only), whose padding generate would infer from pad tokens,
    that decode with a candidate generator (assisted, prompt-lookup: their first forward feeds the whole prompt whatever
    the cache holds), that chunk their prefill on a transformers whose chunks start at column 0, or whose
    prompts reach past where a length-dependent RoPE changes its frequencies (blocks computed under other
    frequencies than this call's would be reused; ``introspect.length_dependent_rope``)."""
    if kwargs.get("inputs_embeds") is not None or kwargs.get("position_ids") is not None or any(
            _setting(name, kwargs, generation_config, model) for name in _NO_PREFIX_SETTINGS):
        return
    if _setting("prefill_chunk_size", kwargs, generation_config, model) and not chunked_prefill_continues():
        return
    input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    mask = kwargs.get("attention_mask")
    pad = _setting("pad_token_id", kwargs, generation_config, model)
    if not isinstance(input_ids, torch.Tensor) or (mask is None and pad is not None and bool((input_ids == pad).any())):
        return
    rope = length_dependent_rope(model)     # its prefill's frequencies follow the batch's longest prompt
    if rope is not None and input_ids.shape[-1] > rope[1]:
        return
    num_beams = _setting("num_beams", kwargs, generation_config, model) or 1
    expand = num_beams if num_beams > 1 else _setting("num_return_sequences", kwargs, generation_config, model) or 1
    store.attach(cache, input_ids, mask, expand)
