"""The CPU tile loops are built three times, for AVX-512, for AVX2 with FMA and
for the baseline x86-64 target, and the build follows ATen's CPU capability.
The rest of the suite runs the build this machine takes; this reruns the
reference tests of both ops on each narrower build."""

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


# ATEN_CPU_CAPABILITY's values, narrowest first, and what torch then reports.
CAPABILITIES = [("default", "DEFAULT"), ("avx2", "AVX2"), ("avx512", "AVX512")]
REPORTED = [reported for _, reported in CAPABILITIES]
NATIVE = torch.backends.cpu.get_cpu_capability()
# The builds narrower than the one this machine takes.
NARROWER = CAPABILITIES[: REPORTED.index(NATIVE)] if NATIVE in REPORTED else []


@pytest.mark.skipif(not NARROWER, reason="this machine takes the narrowest build")
@pytest.mark.parametrize("capability, reported", NARROWER)
def test_narrower_build_matches_reference(capability, reported):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    check = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert check.stdout.strip() == reported, check.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cpu", *SELECTED],
        env=env, cwd=TESTS, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
