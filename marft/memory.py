"""Giving freed host memory back to the operating system between the phases of an update.

glibc's ``malloc`` serves large blocks with ``mmap`` and unmaps them on ``free`` only until the first such
block is freed: then its mmap threshold rises to that block's size (up to 32 MiB), and later blocks of the same
size come from the heap, where freed space stays in the process. On CPU an update frees a whole minibatch of
activations after each backward pass; the next phase (the next agent's adapter, or the critic) allocates others
that do not exactly fit the holes, so the heap grows phase after phase and the process's peak memory grows with
the number of agents, not with the largest minibatch. ``malloc_trim(0)`` between phases returns the free heap
pages, so each phase starts from the memory actually in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_host_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``); whether it could. It changes no value
    of any tensor: only where freed memory goes."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
