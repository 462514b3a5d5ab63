"""The nvfp4 codec: the exact e2m1 grid, round to nearest with ties to the even code, saturation at 6,
the two-level scales (a bf16 row scale, e4m3 group scales in ``data``) and the packing."""
import torch

from hf_paged.kv_formats import E2M1_VALUES, dequantize, e2m1_decode, e2m1_encode, kv_format, quantize

GRID = torch.tensor(E2M1_VALUES)


def _nearest_even_reference(v: float) -> float:
    """The e2m1 value nearest to v (saturated at +-6); of two equally near, the one with the even code."""
    a = min(abs(v), 6.0)
    dist = (GRID - a).abs()
    best = [k for k in range(8) if dist[k] == dist.min()]
    k = next((k for k in best if k % 2 == 0), best[0])
    return (-1.0 if v < 0 else 1.0) * E2M1_VALUES[k]


def test_e2m1_grid_is_exact_and_signed():
    values = torch.cat([GRID, -GRID[1:]])
    codes = e2m1_encode(values)
    assert torch.equal(e2m1_decode(codes), values)
    assert codes[:8].tolist() == list(range(8)) and codes[8:].tolist() == list(range(9, 16))
    assert e2m1_encode(torch.tensor([-0.0, -0.1])).tolist() == [0, 0]          # no negative zero


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    midpoints = [(E2M1_VALUES[k] + E2M1_VALUES[k + 1]) / 2 for k in range(7)]   # 0.25 .. 5, the ties
    probes = midpoints + [m + d for m in midpoints for d in (-1e-3, 1e-3)] + [6.5, 100.0, 1e30]
    probes += [-p for p in probes]
    got = e2m1_decode(e2m1_encode(torch.tensor(probes))).tolist()
    assert got == [_nearest_even_reference(p) for p in probes]
    assert [abs(g) for g in got[:7]] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_nvfp4_layout_and_two_level_scales():
    fmt = kv_format("nvfp4")
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize(fmt, x)
    assert codes.shape == (3, 5, 32 + 4) and scales.shape == (3, 5, 1) and scales.dtype == torch.bfloat16
    assert fmt.bytes_per_head_token(64) == 32 + 4 + 2
    group = codes[..., 32:].contiguous().view(torch.float8_e4m3fn).float()           # [3, 5, 4]
    # the row scale puts the largest group scale at the top of e4m3's range (448, up to rounding)
    assert (group.amax(-1) >= 448 * (1 - 2 ** -4) / (1 + 2 ** -8)).all() and (group <= 448).all()
    # each element is the nearest grid value of x / (group scale * row scale)
    step = (group * scales.float()).repeat_interleave(16, -1)
    want = torch.tensor([_nearest_even_reference(v) for v in (x / step).flatten().tolist()]).view_as(x)
    assert torch.equal(dequantize(fmt, codes, scales, torch.float32), want * step)
    low, high = codes[..., :32] & 15, codes[..., :32] >> 4                            # element 2i low nibble
    assert torch.equal(e2m1_decode(low) * step[..., 0::2], want[..., 0::2] * step[..., 0::2])
    assert torch.equal(e2m1_decode(high) * step[..., 1::2], want[..., 1::2] * step[..., 1::2])


def test_nvfp4_zero_groups_and_rows():
    fmt = kv_format("nvfp4")
    x = torch.zeros(2, 64)
    x[1, 16:32] = torch.linspace(-3, 3, 16)                      # row 1: one non-zero group
    codes, scales = quantize(fmt, x)
    y = dequantize(fmt, codes, scales, torch.float32)
    assert scales[0].item() == 1.0 and (codes[0] == 0).all() and (y[0] == 0).all()
    assert (y[1, :16] == 0).all() and (y[1, 32:] == 0).all()
    # the group's extremes land on +-6 steps, up to the bf16 rounding of the row scale (2^-8 relative)
    assert abs(y[1, 16].item() + 3.0) <= 3 * 2 ** -8 and y[1, 31].item() == -y[1, 16].item()
