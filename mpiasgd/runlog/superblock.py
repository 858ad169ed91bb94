"""The HDF5 superblock's file consistency flags (superblock versions 2 and 3, at offset 0), and clearing
the ones a killed writer left, as `h5clear -s` does."""

from __future__ import annotations

import os

from mpiasgd.runlog.lock import writer_alive

SIGNATURE = b"\x89HDF\r\n\x1a\n"
SWMR_WRITE = 0x04  # flag bits: 0x01 open for writing, 0x04 open for SWMR writing


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 `hashlittle(data, len(data), initval)` (2006, public domain): the 32-bit checksum
    HDF5 stores after its metadata (H5_checksum_metadata = H5_checksum_lookup3 with initval 0).
    lookup3(b"") = 0xdeadbeef; lookup3(b"Four score and seven years ago") = 0x17770551."""
    m = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & m

    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    i = 0
    while n - i > 12:  # every 12-byte block but the last: mix
        a = (a + int.from_bytes(data[i:i + 4], "little")) & m
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & m
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & m
        a = (a - c) & m ^ rot(c, 4)
        c = (c + b) & m
        b = (b - a) & m ^ rot(a, 6)
        a = (a + c) & m
        c = (c - b) & m ^ rot(b, 8)
        b = (b + a) & m
        a = (a - c) & m ^ rot(c, 16)
        c = (c + b) & m
        b = (b - a) & m ^ rot(a, 19)
        a = (a + c) & m
        c = (c - b) & m ^ rot(b, 4)
        b = (b + a) & m
        i += 12
    if n == i:  # nothing left (only for empty data)
        return c
    tail = data[i:] + bytes(12 - (n - i))  # the last 1..12 bytes, zero-padded
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c = (c ^ b) - rot(b, 14) & m
    a = (a ^ c) - rot(c, 11) & m
    b = (b ^ a) - rot(a, 25) & m
    c = (c ^ b) - rot(b, 16) & m
    a = (a ^ c) - rot(c, 4) & m
    b = (b ^ a) - rot(a, 14) & m
    c = (c ^ b) - rot(b, 24) & m
    return c


def _superblock(path: str) -> tuple[bytes, int] | None:
    """(the superblock's bytes before its checksum, the stored checksum) of a version 2/3 superblock at
    offset 0 whose checksum `lookup3` reproduces; None for anything else (or an unreadable file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except OSError:
        return None
    if head[:8] != SIGNATURE or len(head) < 12 or head[8] not in (2, 3):
        return None
    n = 12 + 4 * head[9]  # signature, version, sizes of offsets and lengths, flags; 4 addresses
    if len(head) < n + 4:
        return None
    stored = int.from_bytes(head[n:n + 4], "little")
    return (head[:n], stored) if lookup3(head[:n]) == stored else None


def superblock_flags(path: str) -> int | None:
    """The file consistency flags of the HDF5 file at `path` (0: closed cleanly; 0x01: open for writing; 0x05:
    open for SWMR writing), None if its superblock is not one `clear_stale_flags` understands."""
    sb = _superblock(path)
    return None if sb is None else sb[0][11]


def clear_stale_flags(path: str, check_writer: bool = True) -> bool:
    """Clear the file consistency flags a killed writer left in the superblock, as `h5clear -s` does: the
    flags byte set to 0 and the superblock checksum (`lookup3`) recomputed. True if they were cleared.

    A writer killed while it had the file open (rank 0 killed inside `RunLog.close`'s non-SWMR reopen)
    leaves them set: HDF5 then refuses every later open ("file is already open for write", "not already
    open for SWMR writing"). Nothing is changed (False) if the writer is alive (`check_writer` False: the
    caller holds the lock, so it is not), the flags are 0, or the superblock is not version 2/3 with a
    checksum `lookup3` reproduces. OSError if the file cannot be written (read-only).
    """
    if check_writer and writer_alive(path):
        return False
    sb = _superblock(path)
    if sb is None or sb[0][11] == 0:
        return False
    head = bytearray(sb[0])
    head[11] = 0
    with open(path, "r+b") as fh:
        fh.seek(len(head))
        fh.write(lookup3(bytes(head)).to_bytes(4, "little"))
        fh.seek(11)
        fh.write(b"\0")
        fh.flush()
        os.fsync(fh.fileno())
    return True

