"""``patch`` / ``unpatch`` one model, and the explicit global opt-in ``enable`` / ``disable``.

``patch(model)`` changes only that model instance: a forward pre-hook on its decoder (which plans
each step from the 2D padding mask, and only acts when the cache is a PagedCache) and an
instance-level ``generate``. The attention implementation is switched to ``"hf_paged"`` only for the
duration of a paged generate call, so plain forwards and other caches keep the model's own path.
Everything patch changed is recorded on ``model._hf_paged`` and put back by ``unpatch``. Importing
hf_paged changes nothing; the first ``patch`` registers the attention name ``"hf_paged"`` with
transformers (a new name; no existing entry changes).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field

import torch

from hf_paged.attention_interface import ATTENTION_NAME, register, use_paged_attention
from hf_paged.blocks import blocks_for_budget
from hf_paged.cache import PagedCache
from hf_paged.cache.prefix_store import DEFAULT_PREFIX_CACHE_BYTES, PrefixStore
from hf_paged.families import family_for
from hf_paged.weights_watch import WeightsWatch

from .generate import paged_generate, wants_paged

STATE_ATTR = "_hf_paged"


@dataclass
class PatchState:
    """What ``patch`` changed on one model, so that ``unpatch`` can restore it exactly."""
    instance_generate: object          # the model's own instance attribute 'generate', or None
    hooks: tuple[torch.utils.hooks.RemovableHandle, ...]
    cache_options: dict
    default_cache_implementation: object   # model.generation_config's value before patch(default=True)
    made_default: bool = False               # patch(default=True) set "paged" there (unpatch puts it back)
    last_stats: dict = field(default_factory=dict)
    temporary_owner: int | None = None      # thread of enable()'s per-call patch, None for patch()
    prefix_cache_bytes: int | None = None    # prefix caching across calls: its budget, None = off
    prefix_store: PrefixStore | None = None  # built on the first paged call that wants it
    prefix_weights: WeightsWatch | None = None   # the weights its K/V were computed with
    running: int = 0                         # paged generate calls in progress (unpatch refuses meanwhile)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) of a patched model: no calls running, a lock and prefix store of its own
        (the store's pools and lock are this model's; the copy's first paged call that wants one builds it)."""
        return {**self.__dict__, "running": 0, "lock": None, "prefix_store": None, "prefix_weights": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    @contextlib.contextmanager
    def paged_call(self):
        """One paged generate call, counted from its start to its end (see ``unpatch``)."""
        with self.lock:
            self.running += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1


def _plan_hook(decoder, args, kwargs):
    """Forward pre-hook on the decoder: the PagedCache plans the step once, before any layer runs, and
    says which inputs the forward runs with (finished rows left out)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, PagedCache):
        return None
    if decoder.config._attn_implementation != ATTENTION_NAME:
        raise RuntimeError(
            "a PagedCache was passed to a forward that does not use hf_paged attention "
            f"(attn_implementation={decoder.config._attn_implementation!r}). Generate through a patched "
            "model's generate, or wrap direct forwards in `with hf_paged.use_paged_attention(model):`.")
    if args:
        kwargs = {**kwargs, "input_ids": args[0]}
        args = args[1:]
    weight = decoder.get_input_embeddings().weight
    # Leaving finished rows out changes no token, but per-layer outputs would lose those rows.
    compact = not args and not kwargs.get("output_hidden_states") and not kwargs.get("output_attentions")
    return args, cache.begin_forward(kwargs, weight.dtype, weight.device, compact=compact)


def _expand_hook(decoder, args, kwargs, output):
    """Forward hook on the decoder: the PagedCache ends the step (a forward that skipped the pre-hook can
    never write through a stale plan) and gives back the full batch."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, PagedCache):
        return None
    return cache.end_forward(output)


def patch(model, *, default: bool = False, block_size: int | None = None, num_blocks: int | None = None,
          max_memory_bytes: int | None = None, release_finished_rows: bool = True, kv_cache_dtype: str = "auto",
          enable_prefix_caching: bool = False, prefix_cache_bytes: int | None = None):
    """Make ``model`` generate through a PagedCache when asked for ``cache_implementation="paged"``.

    default: also make "paged" the model's default (``model.generation_config``), so plain
        ``model.generate(...)`` and pipelines page without being asked; unpatch restores the old value.
    block_size, num_blocks, max_memory_bytes, release_finished_rows, kv_cache_dtype: options of the caches
        that generate builds (see PagedCache; kv_cache_dtype "fp8", "int8", "int4", ... quantises the blocks).
    enable_prefix_caching: keep the full blocks of prompts across this model's paged generate calls and
        compute only what a new call's batch does not share with them (few-shot prefixes, system prompts;
        ``hf_paged.cache.prefix_store``). Off by default: a hit reuses K/V computed in another batch, so in
        half precision a near-tie can flip a token. ``prefix_cache_bytes``: the store's K/V budget (default
        256 MiB), evicted least recently used; patching again with other options empties it.
    Patching a patched model applies the new options (the state to restore on unpatch is kept).
    Returns the model. Raises UnsupportedModelError for model types hf_paged.families does not declare
    (llama, qwen2, qwen3, glm, glm4 and their relatives: mistral, mixtral, smollm3, granite, qwen2_moe,
    qwen3_moe). The hook needs the decoder's ``get_input_embeddings`` (all supported families have it).
    """
    options = dict(block_size=block_size, num_blocks=num_blocks, max_memory_bytes=max_memory_bytes,
                   release_finished_rows=release_finished_rows, kv_cache_dtype=kv_cache_dtype)
    family_for(model.config)
    probe = PagedCache(model.config, dtype=model.dtype, **options)       # validates the options now
    budget = _prefix_budget(enable_prefix_caching, prefix_cache_bytes)
    if budget is not None:
        blocks_for_budget(budget, probe.bytes_per_token, probe.block_size, "prefix_cache_bytes")
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        if (options, budget) != (state.cache_options, state.prefix_cache_bytes):
            state.prefix_store = None
        state.cache_options, state.prefix_cache_bytes = options, budget
        state.temporary_owner = None      # enable()'s per-call patch, now asked for: it outlives that call
        _make_default(model, state, default)
        return model
    register()
    decoder = model.get_decoder()
    state = PatchState(
        instance_generate=model.__dict__.get("generate"),
        hooks=(decoder.register_forward_pre_hook(_plan_hook, with_kwargs=True),
               decoder.register_forward_hook(_expand_hook, with_kwargs=True)),
        cache_options=options,
        default_cache_implementation=model.generation_config.cache_implementation,
        prefix_cache_bytes=budget,
    )
    setattr(model, STATE_ATTR, state)
    _make_default(model, state, default)
    model.generate = PatchedGenerate(model)
    return model


def _make_default(model, state: PatchState, default: bool) -> None:
    """Make "paged" the generation config's cache_implementation (default), or put back what was there before
    patch made it so; a value the user set themselves is left alone."""
    config = model.generation_config
    if default:
        if not state.made_default:
            state.default_cache_implementation, state.made_default = config.cache_implementation, True
        config.cache_implementation = "paged"
    elif state.made_default:
        if config.cache_implementation == "paged":       # else the user set another since: theirs stays
            config.cache_implementation = state.default_cache_implementation
        state.made_default = False


class PatchedGenerate:
    """The ``generate`` that ``patch`` sets on a model instance: an object holding the model, not a closure, so
    that a deep copy (or pickle) of the patched model generates with the copy's weights, its own patch state
    and its own generate underneath."""

    def __init__(self, model):
        self.model = model
        self.__doc__ = type(model).generate.__doc__

    @property
    def __wrapped__(self):
        return self._underneath()

    def _underneath(self):
        """The generate the patch wraps: the instance's own from before the patch, else the class's."""
        own = getattr(self.model, STATE_ATTR).instance_generate
        return own if own is not None else type(self.model).generate.__get__(self.model)

    def __call__(self, *args, **kwargs):
        model = self.model
        state = getattr(model, STATE_ATTR, None)
        if state is None:                       # unpatched by another thread since this call looked generate up
            return type(model).generate.__get__(model)(*args, **kwargs)
        paged = _asks_paged(model, args, kwargs)
        if paged and state.temporary_owner not in (None, threading.get_ident()):
            raise RuntimeError(_CONCURRENT_OPT_IN)

        def record(cache):
            state.last_stats = cache.stats()
        with state.paged_call() if paged else contextlib.nullcontext():
            return paged_generate(model, self._underneath(), args, kwargs, state.cache_options, record,
                                  scope=lambda: use_paged_attention(model),
                                  prefix_store=lambda c: _prefix_store(state, c, model))


def _asks_paged(model, args: tuple, kwargs: dict) -> bool:
    """Whether a generate call asks for a paged cache ("paged" anywhere generate reads it, or a PagedCache)."""
    generation_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    passed = kwargs.get("cache", kwargs.get("past_key_values"))
    return wants_paged(kwargs, generation_config, model) or isinstance(passed, PagedCache)


def _prefix_budget(enabled: bool, budget_bytes: int | None) -> int | None:
    if budget_bytes is not None and not enabled:
        raise ValueError("prefix_cache_bytes is the budget of prefix caching: pass enable_prefix_caching=True too")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ValueError(f"prefix_cache_bytes must be a positive int (bytes of K/V), got {budget_bytes!r}")
    return (budget_bytes or DEFAULT_PREFIX_CACHE_BYTES) if enabled else None


def _prefix_store(state: PatchState, cache: PagedCache, model) -> PrefixStore | None:
    """The model's prefix store for a cache generate built, made on first use, and made anew when the
    model's weights changed since (``load_state_dict``, ``.to(dtype)``, an optimizer step: its K/V are
    another model's; ``hf_paged.weights_watch``); None when prefix caching is off. Thread-safe enough for
    concurrent calls: a second store made at once is dropped."""
    if state.prefix_cache_bytes is None:
        return None
    store, watch = state.prefix_store, state.prefix_weights
    if store is None or watch is None or watch.changed():
        store = PrefixStore(cache.config, cache.geometry, cache.kv_format, cache.block_size,
                            state.prefix_cache_bytes, cache._dtype)
        state.prefix_store, state.prefix_weights = store, WeightsWatch(model)
    return store if store.serves(cache) else None


def weights_changed(model) -> None:
    """Tell a patched model that its weights changed in a way ``hf_paged.weights_watch`` cannot see (a write
    through ``p.data`` to a few elements): its prefix store is emptied (the next call that wants one builds
    it anew). Nothing else of the patch depends on the weights. A model not patched is left as it is."""
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        state.prefix_store = state.prefix_weights = None


def unpatch(model):
    """Undo ``patch``: attention implementation, hook and generate are as before. Returns the model."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return model
    with state.lock:
        if state.running:
            raise RuntimeError(f"unpatch while {state.running} paged generate call(s) run on this model (here or in "
                               "other threads): their forwards need the patch's hooks. Unpatch after they return.")
    for hook in state.hooks:
        hook.remove()
    if state.instance_generate is None:
        del model.generate
    else:
        model.generate = state.instance_generate
    _make_default(model, state, False)
    delattr(model, STATE_ATTR)
    return model


def is_patched(model) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


def engine_knobs(model) -> dict:
    """The EngineConfig knobs a patched model's options mean for the engine (the stock pipeline's lists):
    block size, KV format, pool size, prefix caching."""
    state = getattr(model, STATE_ATTR)
    options = state.cache_options
    knobs = dict(block_size=options["block_size"], kv_cache_dtype=options["kv_cache_dtype"],
                 num_blocks=options["num_blocks"], kv_cache_memory_bytes=options["max_memory_bytes"],
                 enable_prefix_caching=state.prefix_cache_bytes is not None)
    return {k: v for k, v in knobs.items() if v is not None}


def last_stats(model) -> dict:
    """``PagedCache.stats()`` of the patched model's most recent generate call."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("model is not patched: call hf_paged.patch(model) first")
    return dict(state.last_stats)


# ---------------------------------------------------------------- global opt-in
_CONCURRENT_OPT_IN = (
    "two threads called generate(cache_implementation='paged') on the same model under hf_paged.enable(), "
    "which patches the model for one call at a time. Call hf_paged.patch(model) once before starting the "
    "threads (a patched model serves concurrent calls).")


def _global_generate(original):
    lock = threading.Lock()     # makes "is it patched? patch it" one step across threads

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not _asks_paged(self, args, kwargs):          # a PagedCache of the user's asks too
            return original(self, *args, **kwargs)
        with lock:
            state = getattr(self, STATE_ATTR, None)
            if state is not None and state.temporary_owner not in (None, threading.get_ident()):
                raise RuntimeError(_CONCURRENT_OPT_IN)
            temporary = state is None
            if temporary:
                patch(self)
                getattr(self, STATE_ATTR).temporary_owner = threading.get_ident()
        if not temporary:       # patched: its own generate wrapper already chose the path
            return original(self, *args, **kwargs)
        state = getattr(self, STATE_ATTR)
        try:
            return self.generate(*args, **kwargs)
        finally:
            with lock:
                if getattr(self, STATE_ATTR, None) is state and state.temporary_owner is not None:
                    unpatch(self)         # not if patch() made it permanent meanwhile
    generate.__hf_paged_original__ = original
    generate.__hf_paged_opt_in__ = _OptIn()
    return generate


class _OptIn:
    """The opt-in's own record, on the installed generate: ``enabled()`` blocks open (in any thread) and whether
    ``enable()`` was called outside them. The last block out disables only an opt-in no ``enable()`` asked for."""

    def __init__(self):
        self.lock = threading.Lock()
        self.blocks = 0
        self.explicit = False


def enable() -> None:
    """Opt in, process-wide, to two things; every other call passes through untouched:

    - ``model.generate(cache_implementation="paged")`` uses hf_paged on any supported model, patched
      or not (patched for the call, unpatched after);
    - ``pipeline("text-generation", model=patched_model)(list_of_prompts)`` runs the list through the
      continuous-batching engine (single prompts and beam search keep the stock path).
    Undo with ``disable()``. Idempotent."""
    from transformers.generation.utils import GenerationMixin

    _install()
    GenerationMixin.generate.__hf_paged_opt_in__.explicit = True


def _install() -> None:
    from transformers import TextGenerationPipeline
    from transformers.generation.utils import GenerationMixin

    from .pipeline import stock_pipeline_call

    if not hasattr(GenerationMixin.generate, "__hf_paged_original__"):
        GenerationMixin.generate = _global_generate(GenerationMixin.generate)
    if not hasattr(TextGenerationPipeline.__call__, "__hf_paged_original__"):
        TextGenerationPipeline.__call__ = stock_pipeline_call(TextGenerationPipeline.__call__, is_patched,
                                                              engine_knobs)


def disable() -> None:
    """Undo ``enable()``: ``GenerationMixin.generate`` and ``TextGenerationPipeline.__call__`` are the
    original functions again."""
    from transformers import TextGenerationPipeline
    from transformers.generation.utils import GenerationMixin

    for owner, name in ((GenerationMixin, "generate"), (TextGenerationPipeline, "__call__")):
        original = getattr(getattr(owner, name), "__hf_paged_original__", None)
        if original is not None:
            setattr(owner, name, original)


def is_enabled() -> bool:
    from transformers.generation.utils import GenerationMixin

    return hasattr(GenerationMixin.generate, "__hf_paged_original__")


@contextlib.contextmanager
def enabled():
    """``with hf_paged.enabled(): ...`` — the opt-in for the block; blocks may nest and overlap across threads: the
    last one out disables it, unless ``enable()`` turned it on for good."""
    from transformers.generation.utils import GenerationMixin

    _install()
    opt_in = GenerationMixin.generate.__hf_paged_opt_in__
    with opt_in.lock:
        opt_in.blocks += 1
    try:
        yield
    finally:
        with opt_in.lock:
            opt_in.blocks -= 1
            last = opt_in.blocks == 0 and not opt_in.explicit
        if last and GenerationMixin.generate.__dict__.get("__hf_paged_opt_in__") is opt_in:
            disable()
