"""Freed host memory kept for reuse: the C library's allocator told not to hand freed blocks back to the kernel.

PyTorch's CPU tensors come from malloc. glibc's malloc maps blocks of more than 128 KiB (a threshold it raises as
such blocks are freed) straight from the kernel and unmaps them on free, and hands the top of its heap back once
more than twice that lies free there. A training step that frees and reallocates the same activations every step
then faults every page of them in again. On 2 cores of a Xeon with AMX, in a fresh process: the compiled bfloat16
toy-tiny step at 32x32 took ~10,000 page faults and ~25 ms of kernel time per step (toy-small ~30,000 and ~65 ms, a
fifth of its time), and `train_edm2.py --preset=toy-small --precision=bf16 --cpu-16bit` on 16x16 toy data ran at 208
images/s against 286 with the blocks kept, 124 against 211 beside two busy processes (scripts/bench_load.py). With
blocks up to 32 MiB kept in the heap and the heap never trimmed, a step takes no faults: the process keeps the
memory of its largest step (the compiled toy-small step: 662 MB against 507, flat over 300 steps), as PyTorch's CUDA
allocator does. How much a process gains depends on what it freed before (glibc raises its threshold to the largest
block freed), so it is measured in fresh processes."""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap; glibc refuses more (half its 64 MiB heap size on a 64-bit machine).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top is handed back beyond this: mallopt's largest value, so never within a run.
TRIM_THRESHOLD = (1 << 31) - 1
# The user's own malloc settings, which we leave as they are: glibc reads these when a process starts.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
# Allocators a user may preload in glibc's place (Intel's advice for PyTorch on CPUs): they keep their own settings.
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# Every variable users_settings reads.
ENVIRONMENT = (*USER_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD")

_kept = False


def users_settings() -> str | None:
    """The malloc setting the user made in the environment (a MALLOC_*_ variable, glibc.malloc in GLIBC_TUNABLES,
    or another allocator preloaded: jemalloc, tcmalloc, mimalloc), or None."""
    given = [name for name in USER_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        given.append("GLIBC_TUNABLES")
    if any(name in os.environ.get("LD_PRELOAD", "") for name in PRELOADED_ALLOCATORS):
        given.append("LD_PRELOAD")
    return given[0] if given else None


def glibc() -> bool:
    """Whether this process runs on glibc, whose malloc keep_freed_memory sets."""
    return platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks up to MMAP_THRESHOLD for reuse and never trim its heap, unless the
    user set malloc's settings; whether this process now keeps them (False on other C libraries)."""
    global _kept
    if _kept or users_settings() or not glibc():
        return _kept
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The threshold first: setting either stops glibc's own adjustment, and a trim threshold alone, with blocks
    # over 128 KiB still mapped on each use, made the toy-tiny step fault 3x as often.
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def describe() -> str:
    """What this process does with freed memory and who chose it, for a command's start line."""
    users = users_settings()
    if users:
        return f"malloc's settings as set ({users})"
    if _kept:
        return (f"freed memory up to {MMAP_THRESHOLD >> 20} MiB a block kept for reuse (our default: handed back to the "
                "kernel, every step faulted its pages in again; MALLOC_TRIM_THRESHOLD_ overrides)")
    return "freed memory handled by the C library's defaults"
