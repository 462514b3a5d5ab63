"""Kernel sources shipped as package data: CUDA (.cu/.cuh, launched through CuPy) and the CPU kernel
(paged_attention_cpu.cpp, built through torch's extension loader)."""
