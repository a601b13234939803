"""`nixl._utils`: raw host buffers for tests and examples, as NIXL's
`nixl_utils.cpp` (`malloc_passthru`, `free_passthru`, `ba_buf`,
`verify_transfer`), through libc with ctypes."""

import ctypes as _ct

_libc = _ct.CDLL(None)
_libc.malloc.restype = _ct.c_void_p
_libc.malloc.argtypes = [_ct.c_size_t]
_libc.free.argtypes = [_ct.c_void_p]
_libc.memcmp.restype = _ct.c_int
_libc.memcmp.argtypes = [_ct.c_void_p, _ct.c_void_p, _ct.c_size_t]


def malloc_passthru(size: int) -> int:
    """`malloc(size)`; returns the address. Raises MemoryError on failure."""
    addr = _libc.malloc(int(size))
    if not addr:
        raise MemoryError(f"malloc({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    """`free(addr)` of an address from `malloc_passthru`."""
    _libc.free(_ct.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> None:
    """Fill `size` bytes at `addr` with the byte pattern `i % 256`."""
    pattern = bytes(i % 256 for i in range(min(int(size), 256)))
    buf = (_ct.c_ubyte * int(size)).from_address(int(addr))
    for off in range(0, int(size), 256):
        n = min(256, int(size) - off)
        _ct.memmove(_ct.addressof(buf) + off, pattern, n)


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Raise AssertionError unless the `size` bytes at `addr1` and `addr2` are equal."""
    if _libc.memcmp(_ct.c_void_p(int(addr1)), _ct.c_void_p(int(addr2)), int(size)) != 0:
        raise AssertionError(f"transfer verification failed: {size} bytes at {addr1:#x} and {addr2:#x} differ")
