"""Read and write IDX files, the format of MNIST and Fashion-MNIST, gzip-compressed or not.

An IDX file is a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim`` big-endian
uint32 dimension sizes, then the array in C order, big-endian. A file whose header is wrong, or
that holds fewer (or more) bytes than its header promises, is refused with :class:`IdxFormatError`
naming the file and what is wrong — a corrupt download must never train silently.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["IdxFormatError", "read_idx", "write_idx"]

# Type byte of the magic number -> big-endian element type.
_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES: dict[np.dtype, int] = {dtype.newbyteorder("="): code for code, dtype in _TYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 23


class IdxFormatError(ValueError):
    """The file is not a well-formed IDX file (bad magic number, dimensions or length)."""


def _open(path: Path) -> BinaryIO:
    """Open ``path`` for reading, decompressing when its first bytes are the gzip magic."""
    with path.open("rb") as probe:
        compressed = probe.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if compressed else path.open("rb")


def _read_up_to(stream: BinaryIO, size: int) -> bytes:
    """Read at most ``size`` bytes in chunks, so a lying header cannot allocate gigabytes."""
    buffer = bytearray()
    while len(buffer) < size:
        chunk = stream.read(min(size - len(buffer), _CHUNK))
        if not chunk:
            break
        buffer += chunk
    return bytes(buffer)


def _read_header(stream: BinaryIO, path: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """Parse and check the magic number and the dimension sizes."""
    magic = _read_up_to(stream, 4)
    if len(magic) < 4 or magic[:2] != b"\x00\x00" or magic[2] not in _TYPES or magic[3] == 0:
        raise IdxFormatError(
            f"{path}: not an IDX file (magic number {magic.hex() or 'missing'}; expected "
            "00 00 <type 08|09|0b|0c|0d|0e> <ndim >= 1>)"
        )
    ndim = magic[3]
    raw_dims = _read_up_to(stream, 4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise IdxFormatError(f"{path}: truncated header (expected {ndim} dimension sizes)")
    dims = tuple(int(d) for d in np.frombuffer(raw_dims, dtype=">u4"))
    return _TYPES[magic[2]], dims


def read_idx(path: str | Path, *, limit: int | None = None) -> np.ndarray:
    """Read an IDX file into a native-endian numpy array; ``limit`` keeps the first rows only.

    With ``limit`` only the bytes of those rows are read (fast subsets of large files); without
    it, trailing bytes after the promised data are an error too.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    try:
        with _open(path) as stream:
            dtype, dims = _read_header(stream, path)
            rows = dims[0] if limit is None else min(limit, dims[0])
            shape = (rows, *dims[1:])
            size = math.prod(shape) * dtype.itemsize
            data = _read_up_to(stream, size)
            if len(data) < size:
                raise IdxFormatError(
                    f"{path}: truncated: header promises {size} bytes of data for shape "
                    f"{shape}, found {len(data)}"
                )
            if limit is None and stream.read(1):
                raise IdxFormatError(f"{path}: trailing bytes after the {shape} array")
    except (EOFError, OSError, zlib.error) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise IdxFormatError(
            f"{path}: corrupt or unreadable file ({err}); check its permissions, or replace it "
            "with an intact copy"
        ) from err
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray, *, compress: bool | None = None) -> Path:
    """Write ``array`` as IDX; gzip it when ``compress`` (default: when the name ends in .gz)."""
    path = Path(path)
    array = np.asarray(array)
    code = _CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(
            f"IDX cannot store dtype {array.dtype}; use one of uint8, int8, "
            "int16, int32, float32, float64"
        )
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"IDX needs 1 to 255 dimensions, got {array.ndim}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=_TYPES[code]).tobytes()
    if compress is None:
        compress = path.suffix == ".gz"
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path
