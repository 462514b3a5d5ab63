"""bench/bf16.py's agreement figures (the measurement itself needs the real model: ``python -m bench bf16``)."""
from bench.bf16 import agreement


def test_agreement_counts_equal_rows_first_differences_and_positions():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    got = agreement(ref, other)
    assert got["rows_equal"] == 1 and got["rows"] == 3
    assert got["first_difference"] == [4, 1, 0]
    assert got["positionwise"] == 10 / 12
