"""bench/roofline_quant.py: the quantised fast-decode prediction (a model: nothing here is measured).

Hand-computed cases on bench/test_roofline.py's one-SM machine (16 B per clock, 2048 clocks per 32 KB),
and the issue's criterion: predicted decode time per token of context at or below bf16's."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench import roofline, roofline_quant
from hf_paged.kv_formats import FORMATS

ONE_SM = replace(roofline.Machine(), sms=1, clock_ghz=1.0, copy_bw=16e9, l2_bw=64e9, latency_ns=700)


def test_bytes_per_token_match_the_pool_layout():
    for design in roofline_quant.quant_designs(128):
        assert design.bytes_per_head_token() == FORMATS[design.fmt].bytes_per_head_token(128)
    assert roofline.DecodeFast().bytes_per_head_token() == 256


def test_fp8_group_4_by_hand():
    # 32 KB / (2 x 130 B) = 126.03 keys; x 4 rows x 16 lanes = 8065.97 lane-pairs; share 1/4
    lanes = 32768 / 260 * 4 * 16
    clocks = roofline_quant.quant_designs()[0].load(4).clocks(ONE_SM)
    # codes: 16 elements x 1 B per lane once per key; 2 scale loads per 32 lanes; 256 cp.async writes
    assert clocks["shared"] == pytest.approx(lanes / 4 * 16 / 128 + lanes / 4 * 2 / 32 + 256 + lanes * 4 / 32)
    assert clocks["fp32"] == pytest.approx(lanes * (16 + 4 + 3 + 2) / 128)
    assert clocks["alu"] == pytest.approx(lanes * (16 * 1.5 / 4 + 3) / 64)
    per_lane = 2 / 4 * 2 + 25 + (6 + 3) + 4 + 1
    assert clocks["issue"] == pytest.approx((lanes * per_lane / 32 + 2048 * 3 / 32) / 4)


def test_dequantising_per_row_costs_more():
    once, per_row = roofline_quant.quant_designs()[2], replace(roofline_quant.quant_designs()[2], dequant_once=False)
    assert per_row.load(1).clocks(ONE_SM) == once.load(1).clocks(ONE_SM)
    assert per_row.load(4).clocks(ONE_SM)["alu"] == pytest.approx(4 * once.load(4).clocks(ONE_SM)["alu"] - 3 * 3
                                                                  * 32768 / 260 * 64 / 64)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("shape", roofline.DECODE_SHAPES)
def test_quantised_decode_time_per_token_at_or_below_bf16(shape, group):
    m = roofline.Machine()
    bf16 = roofline_quant.time_per_token(roofline.decode_row(roofline.DecodeFast(), *shape, group, m))
    for design in roofline_quant.quant_designs():
        row = roofline.decode_row(design, *shape, group, m)
        assert roofline_quant.time_per_token(row) <= bf16, (design.fmt, row.bound, row.steady)


def test_report_carries_the_quantised_rows(tmp_path, capsys):
    report = roofline.main(["--json", str(tmp_path / "r.json")])
    capsys.readouterr()
    names = {r["design"] for r in report["decode_quantised"]}
    assert {f"hfp_decode_fast_q ({f})" for f in ("fp8_e4m3", "fp8_e5m2", "int8", "int4")} <= names


def test_quantised_extend_tile_by_hand():
    """int8 at d128: a 64-key tile's K and V are 2 x 64 x 130 B staged (and read from L2), read back once
    and written as 2 x 64 x 128 bf16 (STS.128) by the dequantise pass; Ragged's mma work is unchanged."""
    bf16 = roofline.Ragged().load(None)
    int8 = next(d for d in roofline_quant.quant_extend_designs() if d.fmt == "int8")
    load = int8.load(None)
    raw = 2 * 64 * 130
    assert int8.smem_bytes(64) == 85760                      # = kernel_registry.ragged_quant_smem_bytes(128, "int8")
    assert load.l2_bytes == raw and load.mma_flop == bf16.mma_flop
    assert load.wavefronts == pytest.approx(bf16.wavefronts - 32768 / 128 + 2 * raw / 128 + 2 * 64 * 128 * 2 / 128)
    elems = 2 * 64 * 128
    assert load.alu == pytest.approx(bf16.alu + elems * (1.25 + 0.5))
    assert load.fp32 == pytest.approx(bf16.fp32 + elems * 2.0)       # int8 -> float, x scale


def test_report_carries_the_quantised_extend_rows(tmp_path, capsys):
    from hf_paged.backends import kernel_registry as reg
    report = roofline.main(["--json", str(tmp_path / "r.json")])
    capsys.readouterr()
    names = {r["design"] for r in report["extend_quantised"]}
    assert names == {"hfp_ragged", *(f"hfp_ragged_{f}" for f in reg.KV_FORMAT_TAGS)}
    for design in roofline_quant.quant_extend_designs():      # the registry's shared memory, per format
        assert design.smem_bytes(64) == reg.ragged_quant_smem_bytes(128, reg.KV_FORMAT_TAGS[design.fmt])
