"""Reading files someone else wrote (an export, a store's checkpoints) within bounds: only regular
files (a FIFO would block, ``/dev/zero`` never ends), never a link out of the folder they belong
to, never larger than a limit, and a zip archive (``torch.save``'s format) only when what it
inflates to is no larger than the file itself (``torch.save`` stores its members uncompressed, so
a member that inflates is a crafted archive: a zip bomb)."""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

from .errors import TridensError

__all__ = ["regular_file", "check_archive", "model_bytes_limit", "MANIFEST_BYTES", "MODEL_BYTES_FLOOR"]

# The most a manifest or a JSON file read from an export may hold.
MANIFEST_BYTES = 16 << 20
# The least a model space built from someone else's recipe may hold, whatever its weights.
MODEL_BYTES_FLOOR = 256 << 20
# What zip headers and padding may add beyond the members' bytes.
_ARCHIVE_SLACK = 1 << 20


def regular_file(path: str | os.PathLike[str], *, inside: str | os.PathLike[str] | None = None,
                 max_bytes: int | None = None, what: str = "file") -> Path:
    """``path`` if it is a regular file (a link only when it resolves inside ``inside``) of at
    most ``max_bytes``; else :class:`TridensError` naming it. Checked before it is opened.

    >>> regular_file("/dev/zero")
    Traceback (most recent call last):
    ...
    tridens.errors.TridensError: /dev/zero is not a regular file (a character device); tridens reads only regular files from it
    """
    path = Path(path)
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            real = path.resolve()
            if inside is not None and not real.is_relative_to(Path(inside).resolve()):
                raise TridensError(f"the {what} {path} is a link to {real}, outside {inside}; tridens reads no file "
                                   "outside the folder it loads")
            info = os.stat(path)
    except OSError as err:
        raise TridensError(f"cannot read the {what} {path}: {err.strerror or err}") from err
    if not stat.S_ISREG(info.st_mode):
        kind = ("a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                else "a character device" if stat.S_ISCHR(info.st_mode) else "a block device"
                if stat.S_ISBLK(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a file")
        raise TridensError(f"{path} is not a regular file ({kind}); tridens reads only regular files from it")
    if max_bytes is not None and info.st_size > max_bytes:
        raise TridensError(f"the {what} {path} holds {info.st_size:,} bytes, more than the {max_bytes:,} "
                           "tridens reads from one")
    return path


def model_bytes_limit(weights_bytes: int = 0) -> int:
    """The most parameters and buffers (bytes) a space built from a recipe someone else wrote may
    hold before it is allocated: four times the weights that come with it (the space object is
    built with its first candidates, which may be wider than the trained sample), and at least
    :data:`MODEL_BYTES_FLOOR`. The frozen model itself must match its weights tensor for tensor.

    >>> model_bytes_limit(1 << 30)
    4294967296
    """
    return max(4 * weights_bytes, MODEL_BYTES_FLOOR)


def check_archive(path: str | os.PathLike[str], *, what: str = "checkpoint") -> None:
    """Refuse a zip archive whose members inflate to more than the file holds (a zip bomb); a
    file that is no zip archive (torch's older format) is left to its reader.

    >>> check_archive("bomb.pt")   # doctest: +SKIP
    TridensError: the checkpoint bomb.pt inflates to 4,294,967,296 bytes from 4,170,450: ...
    """
    path = Path(path)
    try:
        if not zipfile.is_zipfile(path):
            return
        with zipfile.ZipFile(path) as archive:
            inflated = sum(info.file_size for info in archive.infolist())
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise TridensError(f"the {what} {path} is not a readable archive: {err}") from err
    size = path.stat().st_size
    if inflated > size + _ARCHIVE_SLACK:
        raise TridensError(f"the {what} {path} inflates to {inflated:,} bytes from {size:,}: torch.save stores its "
                           "data uncompressed, so this archive was crafted (a zip bomb); it is not loaded")
