"""``hf_paged.LLM``: the engine's offline API (``hf_paged.engine.LLM``), also built the way vLLM's is, from a
checkpoint: ``LLM("path/to/checkpoint", dtype="float32")``, a hub id already in the local cache, or
``"smollm2"`` (the embedded SmolLM2-135M-Instruct); loaded by the server's loader
(``integrations.server.loading.load_model``: ChatGLM directories and ``quantization`` schemes included)."""
from __future__ import annotations

import os

from hf_paged.engine import LLM as EngineLLM


class LLM(EngineLLM):
    """``hf_paged.engine.LLM`` on a loaded model, or on the checkpoint ``model`` names (a path or hub id).

    Loading options (a path only): ``dtype`` ("auto": the checkpoint's; "float32", "bfloat16", ... or a
    torch.dtype), ``device`` (default: "cuda" when there is a GPU), ``quantization`` (as ``hf-paged serve
    --quantization``), ``trust_remote_code`` (a ChatGLM directory's tokenizer), ``tokenizer`` (a path / hub id
    or a tokenizer object; default: the checkpoint's). Every other keyword is an engine knob (EngineConfig).
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
