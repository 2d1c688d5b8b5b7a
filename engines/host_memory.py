"""glibc malloc settings for a process that allocates large tensors over and over: a trainer on the CPU.

Why: a training micro-step allocates activations and gradients of a few hundred KiB to tens of MiB and frees them
again, thousands of times a run. By default glibc serves such blocks with mmap and gives them back with munmap (its
mmap threshold starts at 128 KiB and only grows as mapped blocks are freed), and trims the heap's free top as soon
as it passes 128 KiB, so the same memory is mapped, zero-filled page by page by the kernel and unmapped again for
every tensor. On the main job's trainer (engines/trainer.py on the warm start, chunks of ~2,048 tokens) that was
~13% of its CPU: 0.32 of 2.37 CPU-s as system time, 112k page faults for 6 chunks, against 0.07-0.10 s and 25k
faults once freed blocks stay for reuse, with bit-identical gradients (BENCHMARKS.md, session 26). Where memory
lives changes no arithmetic: torch aligns every CPU allocation to 64 bytes either way.

`keep_freed_tensor_memory` fixes the mmap threshold at glibc's largest (32 MiB on 64-bit), so blocks below it come
from the heap and are reused, and raises the trim threshold to 1 GiB, so a free heap top is kept up to that much.
Both together: setting either one turns off glibc's dynamic threshold, and a trim threshold alone leaves every block
over 128 KiB mapped and unmapped each time (sevenfold the system time). The cost is that a process's resident
memory stays near its peak instead of falling between steps (the trainer's peak did not grow). Blocks of 32 MiB
and more (the logits of a whole chunk) are still mapped each time. Process-wide, Linux with glibc only.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_tensor_memory"]

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks at least this large are mapped (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of the heap beyond this goes back to the system."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_tensor_memory() -> bool:
    """Set this process's malloc to keep freed blocks for reuse (module docstring); False where it cannot (no
    glibc, or glibc refused a value), leaving malloc as it was."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: should the trim threshold be set and not it, every block over 128 KiB would be
    # mapped and unmapped again (see the module docstring).
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
