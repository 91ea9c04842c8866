"""Returning idle host memory to the OS: on a CPU box the engine's KV cache and the trainer share one RAM."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

MADV_DONTNEED = 4  # Linux: drop the pages; private anonymous memory reads back as zeros


def release_pages(address: int, nbytes: int) -> int:
    """madvise(MADV_DONTNEED) the whole pages inside [address, address + nbytes); returns the bytes released.

    The memory stays mapped and valid: the next write faults fresh zero pages in. Only for buffers whose
    contents are no longer needed (an idle KV cache). Returns 0 where madvise is unavailable (not Linux).
    """
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None
    if libc is None or not hasattr(libc, "madvise"):
        return 0
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end <= start:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) failed on {end - start} bytes")
    return end - start
