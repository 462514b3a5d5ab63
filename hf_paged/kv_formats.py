"""Quantised KV storage: the formats, the pool container and the PyTorch (reference) codec.

``kv_cache_dtype`` (vLLM's knob and values) chooses how a paged pool stores keys and values:

    "auto"      the model's dtype (no quantisation)
    "fp8"       = "fp8_e4m3": float8 e4m3fn codes, one bf16 scale per (token, head), searched (below)
    "fp8_e5m2"  float8 e5m2 codes, one bf16 scale per (token, head), searched (below)
    "int8"      symmetric int8 codes, one bf16 scale per (token, head)
    "int4"      asymmetric 4-bit codes, a bf16 scale and minimum per group of 16 along head_dim
    "nvfp4"     e2m1 4-bit float codes (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) in groups of 16 along head_dim, each
                group with an e4m3 scale relative to one bf16 scale per (token, head) (NVFP4's two levels);
                no CUDA kernel reads it: the CPU kernel reads it in place, other devices run the PyTorch path
    "kivi"      KIVI-style 4-bit: keys per channel over each full block, values per token, the open block
                in the model's dtype (``hf_paged.kivi``, which owns its layout; block_size 32)

Scales are computed on write from the values written (no calibration): amax / code_max, except that the
fp8 formats try 16 scales from there up to twice it and keep the one whose codes have the least squared
error (``_search_scale``; float codes lose 2^-4 of each element whatever the scale, the scale only chooses
where the row falls on the code grid). Before quantising, each
(token, head) vector is rotated by a fixed orthogonal matrix R (a normalised Hadamard matrix for power-of-two
head dims, else a seeded random orthogonal one): rotation spreads the outlier channels of keys over the
whole head, and since ``(qR)·(kR) = q·k`` and ``sum p_j (v_j R) R^T = sum p_j v_j``, attention only rotates
the query and un-rotates its output (``backends.step``), the kernels never see R. Why these choices: the
measurements on the real SmolLM2 in the README ("Quantised KV blocks") and ``bench/kv_quant.py``.

Layout of one quantised pool (per layer, keys and values alike; same block geometry as an unquantised pool)
----------------------------------------------------------------------------------------------------------
    data   : uint8 [Hkv, num_blocks, BS, D * bits / 8]     codes, contiguous
             fp8: the float8 bit pattern; int8: two's complement; int4: element 2i in the low nibble of byte
             i, element 2i + 1 in its high nibble, unsigned 0..15
             nvfp4: last dim D/2 + D/16: the D/2 bytes of e2m1 codes packed as int4's (bit 3 the sign, bits
             0-2 the index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), then the D/16 group scales' e4m3fn bit patterns
    scales : bfloat16 [Hkv, num_blocks, BS, S]               contiguous
             8-bit formats and nvfp4: S = 1, the (row) scale; int4: S = 2 * D / 16, the D/16 group scales then
             the D/16 minima
A stored element dequantises as ``code * scale`` (8-bit), ``code * scale + minimum`` (int4) or
``e2m1(code) * e4m3(group scale) * row scale`` (nvfp4), in fp32.
Both tensors are indexed by block on dimension 1, so a block's scales move with it (copy-on-write copies,
pool growth, prefix-cache reuse). Quantisation uses the *stored* (bf16-rounded) scale, so that codes and
scale agree exactly; an all-zero row gets scale 1. The readers never see how a scale was chosen: the search
changes the writers only (this module, cuda/kv_encode_cpu.h, cuda/kv_quant.cuh), which give equal codes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    """One way of storing K/V. ``bits`` per element; ``group`` elements per scale along head_dim
    (0 = the whole head); ``code_max`` the largest code magnitude used."""
    name: str
    bits: int
    group: int
    asymmetric: bool
    code_max: float
    float_codes: torch.dtype | None      # float8 dtype of fp8 codes; None for integer codes
    rotate: bool = True                  # store R-rotated vectors (see above)
    fp8_group_scales: bool = False       # nvfp4: e4m3 group scales in ``data``, one bf16 row scale in ``scales``
    scale_search: bool = False           # fp8: the row scale searched for the least error (``_search_scale``)

    @property
    def quantised(self) -> bool:
        return self.bits < 16

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of ``data`` per (token, head): the codes, then nvfp4's e4m3 group scales."""
        return head_dim * self.bits // 8 + (head_dim // self.group if self.fp8_group_scales else 0)

    def num_scales(self, head_dim: int) -> int:
        """bf16 values stored per (token, head): scales, then minima for asymmetric formats."""
        if self.fp8_group_scales:
            return 1
        groups = head_dim // self.group if self.group else 1
        return groups * (2 if self.asymmetric else 1)

    def bytes_per_head_token(self, head_dim: int) -> int:
        """Bytes one token of one KV head takes (keys or values), scales included."""
        return self.code_bytes(head_dim) + 2 * self.num_scales(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        if self.group and head_dim % self.group:
            raise ValueError(f"kv_cache_dtype={self.name!r} quantises groups of {self.group} along head_dim, "
                             f"but this model's head_dim is {head_dim}; use an 8-bit format or 'auto'")


FORMATS = {
    "fp8_e4m3": KVFormat("fp8_e4m3", 8, 0, False, 448.0, torch.float8_e4m3fn, scale_search=True),
    "fp8_e5m2": KVFormat("fp8_e5m2", 8, 0, False, 57344.0, torch.float8_e5m2, scale_search=True),
    "int8": KVFormat("int8", 8, 0, False, 127.0, None),
    "int4": KVFormat("int4", 4, 16, True, 15.0, None),
    "nvfp4": KVFormat("nvfp4", 4, 16, False, 6.0, None, rotate=True, fp8_group_scales=True),
}
# KIVI-style 4-bit blocks: the format here (a KVFormat like the others), its pools in hf_paged.kivi.
KIVI_BLOCK_SIZE = 32          # tokens per key group = per block (the bytes: hf_paged.kivi)
KIVI_VALUE_GROUP = 64         # at most this many elements per value scale along head_dim (value_group)
KIVI_CODE_MAX = 15.0


@dataclass(frozen=True)
class KiviFormat(KVFormat):
    """The KIVI format; ``bytes_per_head_token`` is the mean of keys and values (scales amortised over
    a block of ``KIVI_BLOCK_SIZE``)."""

    def value_group(self, head_dim: int) -> int:
        """Elements per value scale: the largest even divisor of head_dim not over ``KIVI_VALUE_GROUP``
        (64 for head_dim 64, 128, 256; 40 for 80, 48 for 96, head_dim itself below 64), so every even
        head_dim has whole groups at about the same bytes (0.29-0.31x bf16)."""
        return max((g for g in range(2, min(head_dim, KIVI_VALUE_GROUP) + 1, 2) if head_dim % g == 0), default=1)

    def num_scales(self, head_dim: int) -> int:
        return 2 * (head_dim // self.value_group(head_dim))

    def bytes_per_head_token(self, head_dim: int) -> int:
        key = head_dim // 2 + (2 * 2 * head_dim) // KIVI_BLOCK_SIZE
        value = head_dim // 2 + 2 * self.num_scales(head_dim)
        return (key + value) // 2

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 2:
            raise ValueError(f"kv_cache_dtype='kivi' packs two 4-bit codes per byte along head_dim, which must "
                             f"be even, got {head_dim}; use 'int8' or 'auto'")

    def check_block_size(self, block_size: int) -> None:
        if block_size != KIVI_BLOCK_SIZE:
            raise ValueError(f"kv_cache_dtype='kivi' quantises keys per channel over blocks of {KIVI_BLOCK_SIZE} tokens "
                             f"(needed for <= 0.30x bf16 bytes), but block_size={block_size}; set block_size="
                             f"{KIVI_BLOCK_SIZE}")


KIVI = KiviFormat("kivi", 4, 0, True, KIVI_CODE_MAX, None, rotate=False)


ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPES = ("auto", "fp8", *FORMATS, "kivi")


def kv_format(kv_cache_dtype: str | None) -> KVFormat | None:
    """The format named by ``kv_cache_dtype`` (vLLM's values plus "int8" and "int4"); None for "auto"."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return None
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if name == "kivi":
        return KIVI
    if name not in FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    return FORMATS[name]


def default_block_size(kv_cache_dtype: str | None) -> int:
    """Tokens per block when none is asked: KIVI's key group (``KIVI_BLOCK_SIZE``, the only size it takes) for
    "kivi", else 16 (vLLM's default on GPUs)."""
    return KIVI_BLOCK_SIZE if kv_format(kv_cache_dtype) is KIVI else 16


def rotation_matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed orthogonal fp32 [D, D] matrix R that quantised pools store ``x @ R`` of."""
    if head_dim & (head_dim - 1) == 0:
        r = torch.ones(1, 1)
        while r.shape[0] < head_dim:                      # Sylvester: [[H, H], [H, -H]]
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        r = r / head_dim ** 0.5
    else:
        gaussian = torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(head_dim), dtype=torch.float64)
        q, upper = torch.linalg.qr(gaussian)
        r = (q * upper.diagonal().sign()).float()
    return r.contiguous().to(device)                       # (row-major: what the C++ ops read)


@dataclass(frozen=True)
class QuantizedPool:
    """A layer's quantised keys (or values): ``data`` and ``scales`` as laid out above; ``rotation``: R
    (on the pool's device) when the format rotates, else None."""
    data: torch.Tensor
    scales: torch.Tensor
    fmt: KVFormat
    head_dim: int
    rotation: torch.Tensor | None = None

    @classmethod
    def zeros(cls, fmt: KVFormat, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
              device: torch.device, rotation: torch.Tensor | None = None) -> QuantizedPool:
        """Zeroed codes, unit scales; ``rotation``: R for a rotating format (shared by every layer)."""
        fmt.check_head_dim(head_dim)
        data = torch.zeros((num_kv_heads, num_blocks, block_size, fmt.code_bytes(head_dim)), dtype=torch.uint8,
                           device=device)
        scales = torch.ones((num_kv_heads, num_blocks, block_size, fmt.num_scales(head_dim)), dtype=torch.bfloat16,
                            device=device)
        return cls(data, scales, fmt, head_dim, rotation if fmt.rotate else None)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical [Hkv, num_blocks, BS, D] shape, as an unquantised pool's."""
        heads, blocks, block_size, _ = self.data.shape
        return heads, blocks, block_size, self.head_dim

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scales

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def with_tensors(self, data: torch.Tensor, scales: torch.Tensor) -> QuantizedPool:
        return QuantizedPool(data, scales, self.fmt, self.head_dim, self.rotation)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> x R in fp32 (what is stored); x itself when the format does not rotate."""
        return x if self.rotation is None else x.float() @ self.rotation

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """y [..., D] -> y R^T, in y's dtype."""
        return y if self.rotation is None else (y.float() @ self.rotation.T).to(y.dtype)


def quantize(fmt: KVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (uint8 codes [..., D*bits/8], bf16 scales [..., S])."""
    x = x.float()
    if fmt.fp8_group_scales:
        return _quantize_nvfp4(fmt, x)
    if fmt.asymmetric:
        groups = x.unflatten(-1, (-1, fmt.group))                            # [..., G, group]
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / fmt.code_max).to(torch.bfloat16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        low = low.to(torch.bfloat16)
        codes = ((groups - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, fmt.code_max)
        codes = codes.to(torch.uint8).flatten(-2)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return packed, torch.cat([scale, low], dim=-1)
    amax = x.abs().amax(-1, keepdim=True)
    if fmt.scale_search:
        return _search_scale(fmt, x, amax)
    scale = _stored_scale(amax / fmt.code_max)
    scaled = (x / scale.float()).clamp_(-fmt.code_max, fmt.code_max)
    if fmt.float_codes is not None:
        codes = scaled.to(fmt.float_codes).view(torch.uint8)
    else:
        codes = scaled.round_().to(torch.int8).view(torch.uint8)
    return codes, scale


def _stored_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales -> bf16 as stored (round to nearest even; 1 where not positive: an all-zero row)."""
    scale = scale.to(torch.bfloat16)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# The fp8 scale search's candidates: amax / code_max times these fp32 constants, 2^(j/16) for j < 16 (one octave:
# float codes are scale-invariant under powers of two, so the octave holds every alignment of a row with the
# code grid). The bit patterns are the kernels' too (kv_encode_cpu.h kScaleSteps, kv_quant.cuh scale_step).
SCALE_STEP_BITS = (0x3F800000, 0x3F85AAC3, 0x3F8B95C2, 0x3F91C3D3, 0x3F9837F0, 0x3F9EF532, 0x3FA5FED7, 0x3FAD583F,
                   0x3FB504F3, 0x3FBD08A4, 0x3FC5672A, 0x3FCE248C, 0x3FD744FD, 0x3FE0CCDF, 0x3FEAC0C7, 0x3FF5257D)


def _fixed_point_unit(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 powers of two whose product is 2^(151 - e), e the biased exponent field of ``amax``: a row's
    residuals (below amax / 8) times both are below 2^21, so their squares add up exactly in int64 in any
    order. Two factors so that each stays a normal fp32 for every e in [0, 254] (e//2 and e - e//2)."""
    exponent = (amax.view(torch.int32) >> 23) & 0xFF
    low = exponent >> 1
    first = ((203 - low) << 23).view(torch.float32)                  # 2^(76 - e//2)
    second = ((202 - (exponent - low)) << 23).view(torch.float32)    # 2^(75 - (e - e//2))
    return first, second


def _search_scale(fmt: KVFormat, x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes with the row scale, among bf16(amax / code_max * 2^(j/16)) for j < 16, whose dequantised row
    has the least squared error (ties: the smallest j; j = 0 is the plain amax scale). The error is made
    exact so that every write path picks the same j: code * scale is exact in fp32 (<= 4 + 8 significant
    bits), x - code * scale is exact (Sterbenz: within a factor 2 of x, or x itself for code 0), and the
    residuals in units of 2^(e - 151) (``_fixed_point_unit``), rounded to integers, square and add in int64.
    Why: e4m3's error is 2^-4 of each element whatever the scale; the scale only moves where the row falls
    on the code grid, and the best of 16 alignments cuts the KL on held-out text by ~30% (README)."""
    first, second = _fixed_point_unit(amax)
    base = amax / fmt.code_max
    steps = torch.tensor(SCALE_STEP_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32).tolist()
    best_codes = best_scale = best_error = None
    for step in steps:
        scale = _stored_scale(base * step)                            # fp32 x fp32 constant, one rounding
        s = scale.float()
        codes = (x / s).clamp_(-fmt.code_max, fmt.code_max).to(fmt.float_codes)
        residual = x - codes.float() * s
        error = (residual * first * second).round_().to(torch.int64).square_().sum(-1, keepdim=True)
        if best_error is None:
            best_codes, best_scale, best_error = codes.view(torch.uint8), scale, error
            continue
        better = error < best_error
        best_codes = torch.where(better, codes.view(torch.uint8), best_codes)
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_codes, best_scale


def dequantize(fmt: KVFormat, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize``: codes [..., D*bits/8], scales [..., S] -> [..., D] in ``dtype``."""
    if fmt.fp8_group_scales:
        return _dequantize_nvfp4(fmt, codes, scales, dtype)
    if fmt.asymmetric:
        values = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float()        # [..., D]
        groups = scales.shape[-1] // 2
        scale, low = scales[..., :groups].float(), scales[..., groups:].float()
        values = values.unflatten(-1, (groups, -1)) * scale.unsqueeze(-1) + low.unsqueeze(-1)
        return values.flatten(-2).to(dtype)
    if fmt.float_codes is not None:
        values = codes.view(fmt.float_codes).float()
    else:
        values = codes.view(torch.int8).float()
    return (values * scales.float()).to(dtype)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # the magnitudes of e2m1 codes 0..7
_E4M3_MAX = 448.0


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> uint8 e2m1 codes 0..15 (bit 3 the sign), round to nearest, ties to the even code
    (even mantissa), saturating at +-6. Zero and values that round to zero get code 0 (no -0)."""
    a = v.abs()
    # code k is reached above the midpoint between k-1 and k; a tie goes to the even one of the two
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for k in range(1, 8):
        mid = (E2M1_VALUES[k - 1] + E2M1_VALUES[k]) / 2
        code += (a >= mid if k % 2 == 0 else a > mid).to(torch.uint8)
    return code | (((v < 0) & (code > 0)).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes 0..15 -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-m for m in E2M1_VALUES), device=code.device)
    return table[code.long()]


def _quantize_nvfp4(fmt: KVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level scales: the row scale maps the row's largest |x| to 6 * 448 (so the group scales use
    e4m3's whole range), each group's e4m3 scale maps its largest |x| to 6. Codes are computed from the
    *stored* scales, so that a group whose e4m3 scale rounded down saturates at 6, never overflows."""
    groups = x.unflatten(-1, (-1, fmt.group))                                    # [..., G, 16]
    row = (x.abs().amax(-1, keepdim=True) / (fmt.code_max * _E4M3_MAX)).to(torch.bfloat16)
    row = torch.where(row > 0, row, torch.ones_like(row))
    group = (groups.abs().amax(-1) / fmt.code_max / row.float()).clamp_(max=_E4M3_MAX)
    group = group.to(torch.float8_e4m3fn)                                        # round to nearest even
    step = group.float() * row.float()                                           # [..., G]
    safe = torch.where(step > 0, step, torch.ones_like(step))                    # a zero group: codes 0
    codes = e2m1_encode(torch.where(step.unsqueeze(-1) > 0, groups / safe.unsqueeze(-1), 0.0)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([packed, group.view(torch.uint8)], dim=-1), row


def _dequantize_nvfp4(fmt: KVFormat, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    head_dim = codes.shape[-1] * 8 * fmt.group // (fmt.bits * fmt.group + 8)        # bytes = D/2 + D/16
    half = head_dim * fmt.bits // 8
    packed, group = codes[..., :half], codes[..., half:].contiguous().view(torch.float8_e4m3fn).float()
    values = e2m1_decode(torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2))           # [..., D]
    step = group * scales.float()                                                               # [..., G]
    return (values.unflatten(-1, (-1, fmt.group)) * step.unsqueeze(-1)).flatten(-2).to(dtype)
