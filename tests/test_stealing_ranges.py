"""kernels/native/stealing_ranges.h, the share-out of the quantized products' column groups among
threads: every item handed out exactly once, whatever the team's size against the ranges' count
and however unevenly its threads run. A small C++ driver (built here with the native build's
compiler and OpenMP) runs the cases and reports, per case, how many items were taken other than
once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hybrid_engine.kernels.native import build

DRIVER = r"""
#include <omp.h>
#include <stdio.h>
#include <atomic>
#include <vector>
#include "native/stealing_ranges.h"

// per line "n ranges team skew": items 0..n-1 over `ranges` ranges, taken by a team of `team`
// threads, thread t spinning t * skew rounds after each item (so some finish their run early)
int main() {
  int n, ranges, team, skew;
  while (scanf("%d %d %d %d", &n, &ranges, &team, &skew) == 4) {
    native::StealingRanges work(n, ranges);
    std::vector<std::atomic<int>> taken(n);
    for (auto& c : taken) c.store(0);
#pragma omp parallel num_threads(team)
    {
      const int t = omp_get_thread_num();
      volatile int sink = 0;
      for (native::StealingRanges::Cursor items(work, t); items.next();) {
        taken[items.item()]++;
        for (int r = 0; r < t * skew; r++) sink = sink + r;
      }
    }
    int wrong = 0;
    for (auto& c : taken) wrong += c.load() != 1;
    printf("%d\n", wrong);
  }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stealing_ranges")
    (folder / "driver.cpp").write_text(DRIVER)
    subprocess.run([build._compiler(), *build.KERNEL_FLAGS, f"-I{build.KERNELS}",   # the kernels' own flags
                    str(folder / "driver.cpp"), "-o", str(folder / "driver")], check=True)
    return folder / "driver"


def run(driver: Path, cases: list[tuple[int, int, int, int]]) -> list[int]:
    text = "".join(f"{n} {ranges} {team} {skew}\n" for n, ranges, team, skew in cases)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


def test_every_item_once_in_the_usual_shapes(driver):
    cases = [(0, 2, 2, 0), (1, 2, 2, 0), (7, 2, 2, 50), (64, 2, 2, 0), (1000, 2, 2, 200),
             (1000, 2, 1, 0),           # a team smaller than the ranges: the one thread empties both
             (1000, 4, 2, 100), (1000, 2, 4, 100), (3, 8, 8, 10)]
    assert run(driver, cases) == [0] * len(cases)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 8), st.integers(1, 8), st.integers(0, 300)),
                min_size=1, max_size=12))
def test_every_item_once_in_any_shape(driver, cases):
    assert run(driver, cases) == [0] * len(cases)
