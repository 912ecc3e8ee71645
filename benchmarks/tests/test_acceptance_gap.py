"""benchmarks/acceptance_gap.py: the per-position gap between float and quantized acceptance, its
standard error over the subsets, and the largest gap."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
import acceptance_gap  # noqa: E402


def test_gaps_are_float_minus_quantized_per_subset_with_the_standard_error_of_their_mean():
    base = [{1: [0.90], 2: [0.90, 0.80]}, {1: [0.92], 2: [0.88, 0.84]}, {1: [0.91], 2: [0.89, 0.82]}]
    runs = [{1: [0.89], 2: [0.88, 0.79]}, {1: [0.90], 2: [0.88, 0.80]}, {1: [0.91], 2: [0.86, 0.80]}]
    table = acceptance_gap.gaps(base, runs)
    # k=1: gaps 0.01, 0.02, 0.00 -> mean 0.01, sample sd 0.01, se 0.01 / sqrt(3)
    assert table[1][0] == pytest.approx((0.01, 0.01 / math.sqrt(3)))
    # k=2, position 2: gaps 0.01, 0.04, 0.02 -> mean 0.07 / 3
    assert table[2][1][0] == pytest.approx(0.07 / 3)
    gap, se, k, position = acceptance_gap.largest(table)
    assert (k, position) == (2, 2) and gap == pytest.approx(0.07 / 3)


def test_gaps_need_the_same_subsets_on_both_sides():
    with pytest.raises(ValueError, match="same two or more subsets"):
        acceptance_gap.gaps([{1: [0.9]}, {1: [0.9]}], [{1: [0.9]}])


def test_per_position_reads_a_bench_report_without_k0():
    report = {"results": [{"k": 0, "acceptance_rate_per_position": []},
                          {"k": 1, "acceptance_rate_per_position": [0.9]},
                          {"k": 2, "acceptance_rate_per_position": [0.9, 0.8]}]}
    assert acceptance_gap.per_position(report) == {1: [0.9], 2: [0.9, 0.8]}


def test_float_rates_are_reused_only_from_a_report_of_the_same_runs(tmp_path):
    rates = [{"1": [0.9], "2": [0.9, 0.8]}, {"1": [0.91], "2": [0.88, 0.81]}]
    report = tmp_path / "earlier.json"
    report.write_text(acceptance_gap.json.dumps({"prompts": "made: 64", "num_prompts": 64, "subsets": 2,
                                                 "max_tokens": 128, "model": "default", "rates": {"float": rates}}))
    args = acceptance_gap.argparse.Namespace(prompts=None, make_prompts=64, subsets=2, max_tokens=128, model=None,
                                             max_k=2)
    lines = ["{}"] * 64
    # as a run's own: k an int
    assert acceptance_gap.earlier_float_rates(str(report), lines, args) == [{1: [0.9], 2: [0.9, 0.8]},
                                                                            {1: [0.91], 2: [0.88, 0.81]}]
    with pytest.raises(SystemExit, match="its subsets, max_tokens differ"):
        acceptance_gap.earlier_float_rates(str(report), lines, acceptance_gap.argparse.Namespace(
            **{**vars(args), "subsets": 4, "max_tokens": 64}))
    with pytest.raises(SystemExit, match="its prompts differ"):
        acceptance_gap.earlier_float_rates(str(report), lines, acceptance_gap.argparse.Namespace(
            **{**vars(args), "prompts": "other.jsonl", "make_prompts": None}))
