"""Freed host memory kept for reuse (edm2.runtime.host_memory): a step that frees and reallocates its activations
does not fault their pages in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edm2.runtime import host_memory
from tests.helpers import REPO

# Eager training steps of toy-tiny (batch 8, 16x16, one thread): after three, the page faults of five more.
STEPS = """
import resource, sys, torch
from edm2.runtime import host_memory
from training.run.benchmark import synthetic_step
from training.step import training_step
kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
torch.set_num_threads(1)
step = synthetic_step("toy-tiny", 8, torch.device("cpu"), resolution=16)
for _ in range(3):
    float(training_step(step))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    float(training_step(step))
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def faults_per_step(how: str, **malloc: str) -> tuple[bool, float]:
    """(whether memory was kept, page faults per step of STEPS) in a fresh interpreter, with these malloc settings."""
    result = subprocess.run([sys.executable, "-c", STEPS, how], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**env_without_malloc(), **malloc})
    assert result.returncode == 0, result.stderr
    kept, faults = result.stdout.split()
    return kept == "True", float(faults)


def env_without_malloc() -> dict[str, str]:
    """This process's environment without a malloc setting of the user's."""
    return {k: v for k, v in os.environ.items() if k not in host_memory.ENVIRONMENT}


@pytest.mark.skipif(not host_memory.glibc(), reason="glibc's malloc")
def test_a_training_step_reuses_kept_memory_without_faulting_its_pages_in_again():
    # ~1,100 faults per step by default and ~45 kept on glibc 2.36 (the compiled bf16 toy-tiny step at 32x32:
    # ~10,000 and none, ~25 ms of kernel time a step saved). glibc's default thresholds adapt to the blocks a process
    # happens to free first, so in some processes they had already grown past this small step's blocks (33 faults
    # a step in one run out of seven); the comparison is with glibc's default mmap threshold held fixed, which also
    # keeps its default trim threshold, as a process that has not adapted runs.
    kept_by_default, default = faults_per_step("default", MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    kept, faults = faults_per_step("keep")
    assert kept and not kept_by_default
    assert faults < default / 5, (faults, default)


def test_a_users_malloc_setting_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(host_memory, "_kept", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    called = []
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: called.append(name))
    assert not host_memory.keep_freed_memory() and not called


def test_the_start_line_says_what_becomes_of_freed_memory(monkeypatch):
    monkeypatch.setattr(host_memory, "_kept", True)
    for name in host_memory.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.describe().startswith("freed memory up to 32 MiB a block kept for reuse")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert host_memory.describe() == "malloc's settings as set (GLIBC_TUNABLES)"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # not malloc's
    assert host_memory.describe().startswith("freed memory up to 32 MiB")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert host_memory.describe() == "malloc's settings as set (LD_PRELOAD)"
