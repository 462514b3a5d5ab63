"""Kernel sources shipped as package data: CUDA (.cu/.cuh, launched through CuPy) and the CPU kernel
(paged_attention_cpu.cpp, built through torch's extension loader).

From the repository root (``python -m bench gpu``, ``python -m pytest``) this folder is also importable as the
top-level ``cuda``, the name of NVIDIA's namespace package (``cuda.bindings``, ``cuda.pathfinder``; CuPy 14
imports ``cuda.pathfinder`` when it is imported), which it would hide. Extending ``__path__`` with the other
``cuda`` folders on ``sys.path`` keeps NVIDIA's modules importable under that name; as ``hf_paged.cuda`` it
finds no other folder and changes nothing.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
