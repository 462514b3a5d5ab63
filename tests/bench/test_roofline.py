"""bench/roofline.py's arithmetic on hand-computed cases (a prediction model: nothing here is measured).

The test machine is one SM at 1 GHz with 16 GB/s, so HBM delivers 16 B per clock and 32 KB of K+V
take 2048 clocks; the sm_90 per-clock rates are the defaults (FP32 128, ALU 64, MUFU 16, shuffle 32
lanes, one 128-byte wavefront, 4 warp instructions, 2048 tensor FLOP).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench import roofline

ONE_SM = replace(roofline.Machine(), sms=1, clock_ghz=1.0, copy_bw=16e9, l2_bw=64e9, latency_ns=700)


def test_memory_clocks_and_littles_law():
    assert ONE_SM.memory_clocks() == 2048
    assert ONE_SM.bytes_in_flight_needed() == pytest.approx(16e9 * 700e-9)            # 11,200 B
    h200 = roofline.Machine()
    assert h200.memory_clocks() == pytest.approx(32768 / (4.2e12 / 132 / 1.98e9))   # ~2039 clocks


def test_decode_fast_group_4_by_hand():
    # 32 KB = 64 keys of K+V (128 x 2 B each); x 4 rows = 256 (key, row) pairs; x 16 lanes = 4096 lane-pairs
    clocks = roofline.DecodeFast().load(4).clocks(ONE_SM)
    # shared: 4096 lanes x 2 LDS.128 x 16 B / 128 B = 1024 wavefronts, + 256 for the cp.async writes,
    # + 4096 x 4 shuffle lanes / 32 = 512
    assert clocks["shared"] == 1024 + 256 + 512
    assert clocks["fp32"] == 4096 * (16 + 4 + 3) / 128                                 # 736
    assert clocks["alu"] == 4096 * (16 + 3) / 64                                       # 1216
    assert clocks["mufu"] == 4096 / 16                                                 # 256
    assert clocks["tensor"] == 0
    # 4096 lanes x 49 instructions / 32 lanes + 2048 copies x 3 / 32; 4 per clock
    assert clocks["issue"] == (4096 * 49 / 32 + 2048 * 3 / 32) / 4                     # 1616
    assert clocks["l2"] == 32768 / 64


def test_decode_fast_group_8_is_shared_memory_bound():
    clocks = roofline.DecodeFast().load(8).clocks(ONE_SM)
    assert clocks["shared"] == 2048 + 256 + 1024                                       # 3328 > 2048
    assert ONE_SM.memory_clocks() / max(clocks.values()) == pytest.approx(2048 / 3328)  # 62% of copy bandwidth
    assert roofline.memory_bound_limit(roofline.DecodeFast(), ONE_SM) == 4              # G=5: 2176 > 2048


def test_ragged_tile_by_hand():
    clocks = roofline.Ragged().load(None).clocks(ONE_SM)
    # 4 warps x (64 LDSM.x4 K/V + 8 for Q) x 4 wavefronts + 256 writes; 4 x 8 shuffles x 32 lanes / 32
    assert clocks["shared"] == 4 * 72 * 4 + 256 + 32                                   # 1440
    assert clocks["tensor"] == 4 * 128 * 4096 / 2048                                   # 1024
    assert clocks["mufu"] == 4 * 34 * 32 / 16                                          # 272
    split = roofline.Ragged(decode_split_keys=True).load(16).clocks(ONE_SM)
    assert split["tensor"] == 256 and split["shared"] == 4 * (16 + 8) * 4 + 256 + 32    # a quarter of the tile per warp


def test_shared_memory_as_the_registry():
    # kernel_registry.decode_fast_smem_bytes(128) and ragged_smem_bytes(128)
    assert roofline.DecodeFast().smem_bytes(4) == 2 * 3 * 32 * 128 * 2 + 4 * 8 * 130          # 53,312
    assert roofline.Ragged().smem_bytes(16) == (64 + 4 * 64) * 136 * 2 + 4 * 64                 # 87,296


def test_occupancy_by_hand():
    h200 = roofline.Machine()
    assert h200.ctas_per_sm(128, 64, 33 * 1024) == 6     # registers allow 8; 228 KiB / 34 KiB
    assert h200.ctas_per_sm(128, 128, 80 * 1024) == 2    # registers allow 4; 228 KiB / 81 KiB
    assert h200.ctas_per_sm(128, 32, 0) == 16            # 64 warps


def test_decode_row_end_to_end_by_hand():
    """64 x 4k, GQA 4 on a 132-SM machine without launch gaps or latency tail: 512 CTAs (no split),
    memory-bound, so the fraction is the wave tail 3.88 / 4 CTAs per SM."""
    m = replace(roofline.Machine(), launch_us=0.0, latency_ns=1e-6)
    row = roofline.decode_row(roofline.DecodeFast(), 64, 4096, 4, m)
    assert (row.ctas, row.splits, row.bound, row.steady) == (512, 1, "memory", 1.0)
    assert row.fraction == pytest.approx((512 / 132) / 4, rel=1e-6)
    assert row.target == 0.80 and row.verdict == "meets"
    assert row.label == "predicted, not measured"


def test_in_flight_bound():
    """One K and one V buffer of 8 KB (one in flight while the other is read) and 2 CTAs per SM keep
    16 KB in flight; 4.2 TB/s x 700 ns / 132 SMs needs 22.3 KB: the steady state is capped at 16 / 22.3."""
    m = roofline.Machine()
    row = roofline.decode_row(replace(roofline.DecodeFast(), stages=1), 1, 4096, 4, m)
    assert row.resident == 2.0 and row.bound == "in flight"
    assert row.steady == pytest.approx(2 * 8192 / m.bytes_in_flight_needed())


def test_main_prints_and_writes_json(tmp_path, capsys):
    report = roofline.main(["--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "predicted, not measured" in out and (tmp_path / "r.json").exists()
    assert report["label"] == "predicted, not measured" and len(report["extend"]) == len(roofline.EXTEND_TOKENS)
