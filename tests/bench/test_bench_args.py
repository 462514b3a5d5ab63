"""The benchmark commands refuse counts, rounds, threads and lengths below their bounds by the option's name
(they crashed with tracebacks, or ran and wrote empty results), and take comma lists as lists."""
from __future__ import annotations

import pytest

from bench import cpu_prefill, engine_bench, kv_quant, linear_cpu


@pytest.mark.parametrize("parse, argv, says", [
    (engine_bench.parse_args, ["--n", "0"], "argument --n: 0 is below 1"),
    (engine_bench.parse_args, ["--threads", "-2"], "argument --threads: -2 is below 1"),
    (engine_bench.parse_args, ["--discard", "-1"], "argument --discard: -1 is below 0"),
    (engine_bench.parse_args, ["--settle", "soon"], "argument --settle: 'soon' is not a number"),
    (engine_bench.parse_args, ["--rounds", "0"], "argument --rounds/--repeats: 0 is below 1"),
    (cpu_prefill.parse_args, ["--lengths", "256,abc"], "argument --lengths: 'abc' is not an integer"),
    (cpu_prefill.parse_args, ["--lengths", "0"], "argument --lengths: 0 is below 1"),
    (cpu_prefill.parse_args, ["--threads", ","], "argument --threads: give at least one integer"),
])
def test_bad_numbers_are_refused_by_name(parse, argv, says, capsys):
    with pytest.raises(SystemExit):
        parse(argv, "bench")
    assert says in capsys.readouterr().err


def test_lists_are_lists():
    args = cpu_prefill.parse_args(["--lengths", "256, 1024", "--threads", "2"], "bench")
    assert args.lengths == [256, 1024] and args.threads == [2]


@pytest.mark.parametrize("argv, says", [(["--sections", "speed,bogus"], "--sections: unknown ['bogus']"),
                                        (["--formats", "auto,fp9"], "--formats: unknown ['fp9']")])
def test_kv_quant_refuses_unknown_names_before_loading_anything(argv, says, capsys):
    with pytest.raises(SystemExit):
        kv_quant.main(argv)
    assert says in capsys.readouterr().err


def test_linear_rows(capsys):
    with pytest.raises(SystemExit):
        linear_cpu.main(["--rows", "1,0"])
    assert "argument --rows: 0 is below 1" in capsys.readouterr().err
