"""CUDA kernel sources (.cu/.cuh), shipped as package data."""
