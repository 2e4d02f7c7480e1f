"""tune_allocator: memory a trace frees is reused by the next one instead of being faulted back in."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nnterp.core.allocator import _glibc, tune_allocator

# A trace's pattern: large tensors kept until the end, then all freed; the kernel's count of minor page
# faults over the later rounds says whether the memory came back from the kernel each time.
ROUNDS = """
import resource, sys, torch
from nnterp.core.allocator import tune_allocator
if sys.argv[1] == "tuned":
    tune_allocator()
def one_round():
    kept = [torch.ones(64 * 2**20 // 4) for _ in range(2)]  # 2 x 64 MiB: above glibc's largest mmap threshold
    del kept
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


@pytest.mark.slow  # outside the fast tier (./run.sh test --fast)
def test_tuned_allocator_reuses_freed_memory_instead_of_faulting_it_back():
    try:
        _glibc()
    except OSError:
        pytest.skip("not glibc")
    pages = 4 * 2 * 64 * 2**20 // 4096  # every page of the later rounds, if each came back from the kernel
    default, tuned = faults("default"), faults("tuned")
    assert default > pages // 2, default  # glibc's default returns them: most pages fault again
    assert tuned < pages // 4, tuned  # tuned: the heap keeps them (a fraction faults as the heap first grows)


def test_bad_settings_are_refused_before_anything_changes():
    with pytest.raises(ValueError, match="keep_bytes"):
        tune_allocator(0)
    with pytest.raises(ValueError, match="keep_bytes"):
        tune_allocator(2**31)
