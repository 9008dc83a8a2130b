"""The IDX format of MNIST and Fashion-MNIST, plain or gzipped.

An IDX file is two zero bytes, a type byte, the number of dimensions ``d``, ``d`` big-endian uint32
sizes, then the values in C order, big-endian.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ._base import DatasetError, DatasetNotFound

__all__ = ["read_idx"]

_TYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
          0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (gzipped or not, told by its first bytes, not its name) into a numpy array
    of native byte order.

    >>> import tempfile, struct
    >>> p = os.path.join(tempfile.mkdtemp(), "x-idx1-ubyte")
    >>> _ = open(p, "wb").write(struct.pack(">BBBBI", 0, 0, 0x08, 1, 3) + bytes([7, 8, 9]))
    >>> read_idx(p).tolist()
    [7, 8, 9]
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(p, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise DatasetNotFound(f"no IDX file {p}") from e
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"cannot read the IDX file {p}: {e}") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _TYPES:
        raise DatasetError(f"{p} is not an IDX file: it starts with bytes {data[:4].hex()}, expected 0000 then a "
                           f"type byte (08, 09, 0b, 0c, 0d or 0e) and the number of dimensions")
    ndim, dtype = data[3], _TYPES[data[2]]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{p} is truncated: its IDX header announces {ndim} dimensions but the file has "
                           f"{len(data)} bytes")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise DatasetError(f"{p} is truncated or corrupt: its header says shape {tuple(dims)} of {dtype.name} "
                           f"({expected} bytes) but {len(data) - header} bytes follow it")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)
