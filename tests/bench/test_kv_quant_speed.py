"""bench kv-quant's speed section on a tiny model: every format's rate, its ratio to auto per round and the
prefill / decode split of its steps (auto's seconds over the format's), and the report's columns."""
from __future__ import annotations

from bench import kv_quant
from tiny_models import make_model


def test_speed_reports_rates_and_the_phase_split():
    model = make_model("llama", seed=3)
    result = kv_quant.speed(model, ["auto", "int8"], lambda line: None, rounds=2, prompt=40, output=4, requests=3,
                            control=True)
    assert result["useful_tokens"] == 12 and result["rounds"] == 2
    for name in ("auto", "int8", kv_quant.CONTROL):
        r = result[name]
        assert r["n"] == 2 and r["min"] > 0
        for phase in ("prefill", "decode"):
            assert r[f"{phase}_s"]["min"] > 0, f"{name}: no {phase} step was timed"
            assert r[f"{phase}_ratio"]["n"] == 2
    assert result["auto"]["prefill_ratio"]["median"] == result["auto"]["decode_ratio"]["median"] == 1.0
    lines = kv_quant.report({"speed": result, "date": "today", "machine": "here"}).splitlines()
    header = next(line for line in lines if line.startswith("| kv_cache_dtype"))
    assert "prefill steps vs auto" in header and "decode steps vs auto" in header
    int8_row = next(line for line in lines if line.startswith("| int8"))
    assert int8_row.count("x (") == 3
    control_row = next(line for line in lines if line.startswith(f"| {kv_quant.CONTROL}"))
    assert control_row.count("x (") == 3, "the noise control is reported as the formats are"
