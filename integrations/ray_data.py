"""Batch inference on Ray Data: one engine per actor, one actor per GPU or per CPU bundle.

    import ray
    from hf_paged.integrations import ray_data

    ray.init()                                                   # or ray.init(address="auto") on a cluster
    ds = ray.data.read_json("prompts.jsonl")                      # rows with a "prompt" column
    out = ray_data.generate(ds, "/models/SmolLM2-135M", concurrency=2, num_cpus=1, max_new_tokens=64)
    out.write_json("outputs/")                                    # or out.take_all()

Each actor loads the model once (with ``hf-paged serve``'s loader, ``integrations.server.loading``,
or a loader you give), keeps one ``hf_paged.LLM`` (continuous batching, prefix cache) for its life,
and runs each batch of prompts through it. Output rows are the input rows plus ``generated_text``
(with a tokenizer), ``generated_token_ids``, ``finish_reason``, ``error`` (a request that fails alone:
its message, else None) and ``actor`` (host:pid, for per-actor accounting: ``actor_summary``). Ray's
own fault tolerance applies: an actor that dies is restarted and its batch retried; rows are neither
lost nor duplicated. ``generate`` keeps the input order (``preserve_order``).
Nothing here imports ray until ``generate`` is called; the actor class needs only torch.
"""
from __future__ import annotations

import math
import os
import socket
from collections import Counter

from hf_paged.engine import LLM, EngineConfig
from hf_paged.engine.outputs import RequestOutput

from .server.config import partition
from .server.loading import default_device, load_model


class PagedGenerator:
    """The actor class for ``ds.map_batches`` (``generate`` wires it; usable on its own too).

    model: what ``hf-paged serve`` loads (a checkpoint directory or hub id, a ChatGLM directory,
        ``"smollm2"``: ``integrations.server.loading.load_model``), or a zero-argument callable returning
        ``(model, tokenizer)`` (it must be importable where the actors run).
    tokenizer: a path/id for ``AutoTokenizer`` or a tokenizer (default: the model's own); a callable's
        own tokenizer wins. Without a tokenizer, prompts must be token ids.
    threads: torch threads of this actor (default: the CPUs Ray gave it, else torch's default).
    device: where the model runs (default: "cuda" when this actor sees a GPU, else "cpu").
    row_settings: names of columns holding per-row generation settings (e.g. ``("max_new_tokens",)``);
        a row's values override ``options`` for that row.
    options: EngineConfig knobs (max_num_seqs, kv_cache_memory_bytes, ...) and generation settings
        (max_new_tokens, do_sample, seed, ...), as ``hf_paged.generate_many`` takes them.
    """

    def __init__(self, model, *, tokenizer=None, prompt_column: str = "prompt", threads: int | None = None,
                 device: str | None = None, dtype="auto", row_settings: tuple[str, ...] = (), **options):
        import torch

        if threads:
            torch.set_num_threads(threads)
        if callable(model):
            model, tokenizer = model()
            if getattr(model, "hf_device_map", None) is None:      # a dispatched model stays where it is
                model = model.to(device or default_device())
        else:
            model, tokenizer = load_model(model, dtype=dtype, device=device, tokenizer=tokenizer)
        knobs, self.settings = partition(options, EngineConfig)
        self.llm = LLM(model.eval(), tokenizer, **knobs)
        self.prompt_column, self.row_settings = prompt_column, tuple(row_settings)
        # Several sequences per prompt: list-valued output columns (the same type in every batch).
        self.nested = "num_return_sequences" in self.row_settings or 1 < int(
            self.settings.get("num_return_sequences") or model.generation_config.num_return_sequences or 1)
        self.actor = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        for column in (self.prompt_column, *self.row_settings):
            if column not in batch:
                raise KeyError(f"batch has no {column!r} column (columns: {sorted(batch)}); name the prompts' "
                               "column with prompt_column=..., per-row settings with row_settings=(...)")
        prompts = [p if isinstance(p, str) else list(p) for p in batch[self.prompt_column]]
        per_row = [row_values(batch, self.row_settings, i) for i in range(len(prompts))] if self.row_settings else None
        try:
            outputs = self.llm.generate(prompts, per_row, use_tqdm=False, **self.settings)   # keeps no record
        except ValueError:           # a row that cannot be a request: that row fails alone (all the others run)
            outputs = self._rows_alone(prompts, per_row)

        def per_request(value):
            return value if self.nested else (value[0] if value else None)

        columns = {
            "generated_token_ids": [per_request([c.token_ids for c in o.outputs]) for o in outputs],
            "finish_reason": [per_request([c.finish_reason for c in o.outputs] if o.error is None else ["error"])
                              for o in outputs],
            "error": [o.error for o in outputs],
            "actor": [self.actor] * len(outputs),
        }
        if self.llm.engine.tokenizer is not None:
            columns["generated_text"] = [per_request([c.text for c in o.outputs]) for o in outputs]
        out = dict(batch)
        for name, values in columns.items():
            column = np.empty(len(values), dtype=object)
            column[:] = values
            out[name] = column
        return out


    def _rows_alone(self, prompts: list, per_row: list[dict] | None) -> list[RequestOutput]:
        """The batch with every row checked alone (``Engine.prepare``): a row refused (an empty prompt, a token
        outside the vocabulary, a bad setting) is an error row, as an over-long one is; the others run together."""
        good, errors = [], {}
        for i, prompt in enumerate(prompts):
            try:
                self.llm.engine.prepare(prompt, **{**self.settings, **(per_row[i] if per_row else {})})
                good.append(i)
            except ValueError as exc:
                errors[i] = str(exc)
        ran = iter(self.llm.generate([prompts[i] for i in good], [per_row[i] for i in good] if per_row else None,
                                     use_tqdm=False, **self.settings) if good else [])
        return [RequestOutput(i, [], error=errors[i]) if i in errors else next(ran) for i in range(len(prompts))]


# Integer settings: a column of them with a null in it reaches the actor as floats (2.0, NaN).
INTEGER_SETTINGS = frozenset({"max_new_tokens", "min_new_tokens", "max_length", "min_length", "min_tokens", "top_k",
                              "num_return_sequences", "seed", "logprobs", "prompt_logprobs"})


def row_values(batch: dict, names: tuple[str, ...], i: int) -> dict:
    """Row ``i``'s settings from their columns, as Python values; a null (None, or NaN: how Ray Data holds a
    null of an int column, whose other values become floats) leaves the setting to the options."""
    out = {}
    for name in names:
        value = batch[name][i]
        value = value.item() if hasattr(value, "item") else value
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if name in INTEGER_SETTINGS and isinstance(value, float) and value.is_integer():
            value = int(value)
        out[name] = value
    return out


def generate(ds, model, *, concurrency: int = 1, batch_size: int = 32, num_cpus: float | None = 1,
             num_gpus: float = 0, max_restarts: int | None = None, max_task_retries: int | None = None,
             preserve_order: bool = True,
             actor_class: type = PagedGenerator, **options):
    """``ds.map_batches`` with ``concurrency`` PagedGenerator actors; returns the (lazy) output Dataset.

    One actor per GPU (``num_gpus=1``) or per CPU bundle (``num_cpus=k``, the actor's torch threads);
    ``options`` go to PagedGenerator (tokenizer, prompt_column, device, dtype, engine knobs, generation
    settings). An actor that dies is restarted and its batch retried, by Ray's own mechanisms: Ray Data's
    defaults (no limit on either) unless ``max_restarts`` / ``max_task_retries`` bound them (a batch that
    kills its actor every time would otherwise be retried forever). ``preserve_order``: output rows in
    input order.
    """
    if concurrency < 1 or batch_size < 1:
        raise ValueError(f"concurrency and batch_size must be >= 1, got {concurrency} and {batch_size}")
    if num_cpus and "threads" not in options:
        options["threads"] = max(1, int(num_cpus))
    retries = {k: v for k, v in (("max_restarts", max_restarts), ("max_task_retries", max_task_retries))
               if v is not None}
    out = ds.map_batches(actor_class, fn_constructor_args=(model,), fn_constructor_kwargs=options,
                         batch_size=batch_size, concurrency=concurrency, num_cpus=num_cpus, num_gpus=num_gpus,
                         batch_format="numpy", **retries)
    out.context.execution_options.preserve_order = preserve_order
    return out


def actor_summary(rows) -> dict[str, dict]:
    """Per actor: requests served and tokens generated, from output rows (``out.take_all()``)."""
    requests, tokens = Counter(), Counter()
    for row in rows:
        requests[row["actor"]] += 1
        ids = row["generated_token_ids"]
        if ids is not None and len(ids):
            nested = hasattr(ids[0], "__len__")          # num_return_sequences > 1: one list per sequence
            tokens[row["actor"]] += sum(len(x) for x in ids) if nested else len(ids)
    return {actor: {"requests": requests[actor], "generated_tokens": tokens[actor]} for actor in sorted(requests)}
