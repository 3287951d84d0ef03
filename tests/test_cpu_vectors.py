"""The CPU tile loops are built twice, for AVX2 with FMA and for the baseline
x86-64 target, and the build follows ATen's CPU capability. The rest of the
suite runs the build this machine takes; this reruns the reference tests of
both ops on the other build, the baseline one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# The tests that compare against the float64 references: tiles of every
# shape, label layouts, empty sets, NaN, several thread counts.
SELECTED = [
    "test_correctness.py::test_matches_reference",
    "test_correctness.py::test_classes_across_tiles",
    "test_correctness.py::test_label_layouts",
    "test_correctness.py::test_huge_gamma_stays_finite",
    "test_correctness.py::test_nan_propagates",
    "test_correctness.py::test_bitwise_deterministic_across_calls_and_threads",
    "test_anchor_loss.py::test_matches_reference",
    "test_anchor_loss.py::test_self_copies_in_a_memory_bank_are_left_out",
    "test_anchor_loss.py::test_rows_with_an_empty_set_give_zero",
    "test_anchor_loss.py::test_nan_propagates",
    "test_anchor_loss.py::test_bitwise_deterministic_for_any_thread_count",
]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="this run is the baseline build")
def test_baseline_build_matches_reference():
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    check = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert check.stdout.strip() == "DEFAULT", check.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cpu", *SELECTED],
        env=env, cwd=TESTS, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
