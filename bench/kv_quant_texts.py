"""Held-out real text for the KV quantisation bench, read from the running interpreter (no download).

Three kinds, chosen so that none is the pydoc topics text the quality section reads (the fp8/int4
defaults were chosen on that) and so that every machine with CPython has the same passages:
- ``docstring``: long module docstrings of the standard library (prose about an API);
- ``comment``: the comment lines of standard-library sources (terse technical English, code words);
- ``license``: consecutive passages of the stdlib's LICENSE.txt (legal English, highly predictable).
Each passage is ``PROMPT + FORCED`` tokens; a source too short for one is skipped. ``LONG_KINDS``: the set of
long prompts (the KIVI study's 480-token prompts: 6 passages each of the license, comments and ``code``, the
middle of a standard-library module's source), for formats whose loss grows with the context.
"""
from __future__ import annotations

import importlib
import io
import sysconfig
import tokenize
from pathlib import Path

import torch

PROMPT, FORCED = 32, 128
DOCSTRING_MODULES = ("argparse", "doctest", "subprocess", "optparse", "typing", "inspect", "difflib", "sched",
                     "pickletools", "tarfile", "decimal", "zipfile")
COMMENT_MODULES = ("subprocess", "threading", "inspect", "tarfile", "zipfile", "argparse", "pickle", "typing",
                   "dataclasses", "functools", "collections", "enum")
CODE_MODULES = ("json.decoder", "heapq", "bisect", "shlex", "textwrap", "string", "queue", "glob")
LONG_KINDS = ("license", "comment", "code")
MIN_COMMENT_WORDS = 3          # comment lines shorter than this are mostly commented-out code or markers


def _comments(module: str) -> str:
    """The comment lines of a module's source, '#' stripped, one per line."""
    source = Path(importlib.import_module(module).__file__).read_text()
    lines = (t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT)
    return "\n".join(line for line in lines if len(line.split()) >= MIN_COMMENT_WORDS)


def _sources(kind: str) -> list[tuple[str, str]]:
    if kind == "docstring":
        return [(f"{m}.__doc__", importlib.import_module(m).__doc__ or "") for m in DOCSTRING_MODULES]
    if kind == "comment":
        return [(f"{m} comments", _comments(m)) for m in COMMENT_MODULES]
    if kind == "license":
        path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
        return [("LICENSE.txt", path.read_text(errors="replace"))] if path.exists() else []
    if kind == "code":
        return [(f"{m} source", Path(importlib.import_module(m).__file__).read_text()) for m in CODE_MODULES]
    raise ValueError(f"unknown text kind {kind!r}; known: docstring, comment, license, code")


def held_out_passages(tokenizer, kinds: tuple[str, ...] = ("docstring", "comment", "license"),
                      per_kind: int = 8, prompt: int = PROMPT) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, label, token ids [prompt + FORCED]) for up to ``per_kind`` passages of each kind; a long
    source (the license) gives consecutive non-overlapping passages, a module's source (code) its middle
    passage, any other source its first."""
    length = prompt + FORCED
    out = []
    for kind in kinds:
        found = 0
        for label, text in _sources(kind):
            ids = tokenizer(text, return_tensors="pt").input_ids[0]
            starts = [(len(ids) - length) // 2] if kind == "code" and len(ids) >= length else \
                range(0, len(ids) - length + 1, length)
            for start in starts:
                out.append((kind, label if start == 0 else f"{label}@{start}", ids[start:start + length]))
                found += 1
                if found == per_kind or kind != "license":
                    break
            if found == per_kind:
                break
    return out
