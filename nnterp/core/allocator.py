"""An opt-in allocator setting for CPU runs with glibc (Linux).

A trace keeps every value it saves until it ends, then frees them all at once. glibc hands the
freed top of the heap back to the kernel (and serves large blocks with fresh ``mmap`` calls), so
the next trace faults the same memory back in, 4 KiB at a time: on a CPU the page faults can
cost more than the values' reads. ``tune_allocator()`` asks glibc to keep freed memory for
reuse instead. It changes the whole process, so it is never on by default; the environment
variables ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<bytes>`` do the same from the shell, and
jemalloc or tcmalloc (``LD_PRELOAD``) avoid the problem too.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def tune_allocator(keep_bytes: int = 2**31 - 1) -> None:
    """Keep memory freed by a trace for the next one: no ``mmap`` per large block, and up to ``keep_bytes``
    (2 GiB, glibc's most, by default) of free heap top kept rather than returned to the kernel. For the
    whole process; glibc (Linux) only: elsewhere it raises ``OSError`` saying so, and changes nothing."""
    if not 0 < keep_bytes <= 2**31 - 1:
        raise ValueError(f"keep_bytes is a number of bytes from 1 to 2**31 - 1 (glibc's limit), not {keep_bytes}.")
    libc = _glibc()
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, keep_bytes)):
        raise OSError("glibc refused the allocator settings (mallopt returned 0).")


def _glibc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        raise OSError("tune_allocator needs glibc (Linux); this platform's allocator is another. "
                      "jemalloc or tcmalloc (LD_PRELOAD) are the alternatives there.")
    return libc
