"""The fp8 codec's scale math and rounding, against an independent reference (every e4m3 value enumerated).

Why these properties: they are the suspects for fp8_e4m3's perplexity loss on held-out text (issue 24):
a bf16-rounded scale that saturates the largest element, a conversion that does not round to nearest even,
codes that disagree with the stored scale. Measured on SmolLM2 (README "Quantised KV blocks"), none of them
is where the loss comes from; these tests keep them from becoming so. The loss is the 3 mantissa bits, and
what the codec does about it, the row scale searched for the least error among 16 alignments with the code
grid, is checked against a float64 brute force over the same candidates.
"""
import pytest
import torch

from hf_paged.kv_formats import FORMATS, dequantize, quantize

E4M3 = FORMATS["fp8_e4m3"]


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3fn value (sorted) and whether its code is even (last mantissa bit 0)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    keep = torch.isfinite(values)
    values, even = values[keep], (codes[keep] & 1) == 0
    order = values.argsort()
    return values[order], even[order]


def _round_to_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """Reference: the nearest grid value, ties to the even code; |x| > 448 saturates (clamped first)."""
    grid, even = _e4m3_grid()
    x = x.clamp(-448, 448)
    distance = (x.unsqueeze(-1) - grid).abs()
    best = distance.min(-1, keepdim=True).values
    ties = distance == best
    pick = torch.where(ties.sum(-1) > 1, (ties & even).float().argmax(-1), distance.argmin(-1))
    return grid[pick]


def test_e4m3_codes_are_round_to_nearest_even_of_x_over_the_stored_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2, 64, generator=gen) * torch.logspace(-4, 4, 512).view(-1, 1, 1)
    x[0, 0, :8] = torch.tensor([1.0625, 1.1875, -1.0625, 3.0, 0.0, 448.0, -0.5, 0.0])     # exact ties
    codes, scales = quantize(E4M3, x)
    got = codes.view(torch.float8_e4m3fn).float()
    want = _round_to_nearest_even(x / scales.float())
    assert torch.equal(got, want)
    assert torch.equal(dequantize(E4M3, codes, scales, torch.float32), got * scales.float())


def _candidates(fmt, x: torch.Tensor) -> torch.Tensor:
    """Reference: the search's candidate scales [..., 16], bf16(amax / code_max * fp32(2^(j/16))), 1 for 0."""
    steps = torch.tensor([2 ** (j / 16) for j in range(16)], dtype=torch.float32)
    scales = (x.abs().amax(-1, keepdim=True) / fmt.code_max * steps).to(torch.bfloat16).float()
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def _errors(fmt, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 squared error of x [..., D] coded under each scale [..., K] -> [..., K] (the fp8 cast of
    torch, clamped as kv_formats does)."""
    y = (x.unsqueeze(-2) / scales.unsqueeze(-1)).clamp(-fmt.code_max, fmt.code_max)
    back = y.to(fmt.float_codes).double() * scales.double().unsqueeze(-1)
    return (back - x.double().unsqueeze(-2)).square().sum(-1)


def _random_rows(seed: int, n: int = 4096, d: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * torch.logspace(-3, 3, n).view(-1, 1)
    x[: n // 4] = x[: n // 4] ** 3                                           # heavy tails
    x[1, :] = 0                                                              # all-zero row: scale 1, no search
    x[2, :] = 0
    x[2, 5] = -3.0                                                           # one element
    x[3] = torch.where(torch.rand(d, generator=gen) < 0.5, -1.0, 1.0) * 7.0  # equal magnitudes
    x[4] *= 1e-39                                                            # fp32 subnormals
    x[5] *= 1e36
    return x


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_searched_scale_has_the_least_error_of_its_candidates(name):
    """The stored scale is one of the 16 candidates, its float64 error is the least of theirs (up to the
    search's exact fixed-point rounding, 2^-24 of amax per element), so never above amax / code_max's
    (candidate 0, what the codec stored before the search); and over random rows it is clearly lower."""
    fmt = FORMATS[name]
    x = _random_rows(3)
    codes, scales = quantize(fmt, x)
    candidates = _candidates(fmt, x)
    assert ((scales.float() == candidates).sum(-1) >= 1).all(), "a scale that is not a candidate"
    got = (dequantize(fmt, codes, scales, torch.float32).double() - x.double()).square().sum(-1)
    errors = _errors(fmt, x, candidates)
    amax = x.double().abs().amax(-1)
    slack = x.shape[-1] * (amax * 2.0 ** -23) ** 2
    assert (got <= errors.min(-1).values + slack).all()
    assert (got <= errors[:, 0] + slack).all()
    assert got[1] == 0 and scales[1].item() == 1.0
    lossy = errors[:, 0] > 0                   # rows candidate 0 codes exactly (equal magnitudes) have 0 / 0
    ratio = (got[lossy] / errors[lossy, 0]).mean()
    assert ratio < 0.85, ratio.item()          # ~0.75 on Gaussian rows; the best alignment is worth having


def test_no_element_saturates_by_more_than_the_scale_rounding():
    """Every candidate scale is >= bf16(amax / 448) (steps >= 1): x / scale stays within 448 * (1 + 2^-8),
    so the clamp to the code range only ever acts within the bf16 scale's own rounding."""
    x = _random_rows(1)
    _, scales = quantize(E4M3, x)
    scaled = (x / scales.float()).abs()
    assert scaled.max() <= 448 * (1 + 2 ** -8), scaled.max().item()
    plain = (x.abs().amax(-1, keepdim=True) / 448).to(torch.bfloat16).float()
    assert (scales.float() >= torch.where(plain > 0, plain, torch.ones_like(plain))).all()


def test_e4m3_error_is_relative_per_element_whatever_the_scale():
    """Float codes: each element's error is at most half a mantissa step (2^-4 relative) above the
    subnormal range, so neither a per-group scale nor a per-channel pre-scale can shrink it (why the
    README says the remaining loss is the format's 3 mantissa bits)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 64, generator=gen) * 10.0
    codes, scales = quantize(E4M3, x)
    back = dequantize(E4M3, codes, scales, torch.float32)
    normal = (x / scales.float()).abs() >= 2 ** -6            # smallest normal e4m3 magnitude
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= 2 ** -4 * (1 + 2 ** -7), relative.max().item()
    assert relative.mean() > 2 ** -6           # not exact either: the bound is tight, the format is lossy
