"""Synthetic paged K/V: random pools with rows in shuffled blocks, for the fast kernels' first-use check
(``cuda_fast.self_check``), the kernel tests and the GPU benchmarks. Shuffled blocks are what catch a
kernel that reads a row's blocks in the wrong order, or assumes they are adjacent."""
from __future__ import annotations

import torch


def assign_blocks(order: torch.Tensor, blocks_per_row: list[int]) -> torch.Tensor:
    """int32 [B, W]: row b holds the next ``blocks_per_row[b]`` block ids of ``order`` (taken in turn),
    0-padded to W = max(1, max(blocks_per_row)); on ``order``'s device."""
    tables = torch.zeros(len(blocks_per_row), max(1, max(blocks_per_row, default=1)), dtype=torch.int32,
                         device=order.device)
    used = 0
    for row, count in enumerate(blocks_per_row):
        tables[row, :count] = order[used:used + count].to(torch.int32)
        used += count
    return tables


def random_paged_kv(lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    generator: torch.Generator, spare_blocks: int = 3, device: torch.device | str = "cpu"):
    """Random K and V pools [Hkv, blocks, block_size, D] (drawn on the CPU with ``generator``, then moved)
    holding rows of ``lengths`` stored tokens in shuffled blocks, plus ``spare_blocks`` unused ones.
    Returns (k_pool, v_pool, block_tables int32 [B, W], context_lens int32 [B])."""
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + spare_blocks
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pool = torch.randn(shape, generator=generator).to(device, dtype)
    v_pool = torch.randn(shape, generator=generator).to(device, dtype)
    tables = assign_blocks(torch.randperm(num_blocks, generator=generator), blocks).to(device)
    return k_pool, v_pool, tables, torch.tensor(lengths, dtype=torch.int32, device=device)
