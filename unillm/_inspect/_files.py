"""Paths and files, looked at and read within bounds: whatever a path names (nothing, a FIFO, a
device, a file this user cannot read, a name too long) ends in its own message."""

from __future__ import annotations

import errno
import os
import stat
from io import FileIO
from pathlib import Path

from unillm._errors import ModelFormatError, ModelNotFound

# ---- paths and files ------------------------------------------------------------------------
# A path is untrusted too: it may name nothing, a FIFO (opening one for reading waits for a writer
# forever), a device, a file this user cannot read, or be too long for the filesystem. Each case
# is its own message; only "nothing is there" is ModelNotFound.

_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
_NOTHING_THERE = (FileNotFoundError, NotADirectoryError)


def _expand(path: str | Path) -> Path:
    p = Path(path)
    try:
        return p.expanduser()
    except RuntimeError:  # "~user" naming no user: take the path literally
        return p


def _kind(p: Path) -> str | None:
    """``"file"`` or ``"dir"`` (symlinks followed); None when nothing is there."""
    try:
        mode = p.stat().st_mode
    except _NOTHING_THERE:
        return None
    except OSError as exc:
        raise _unreadable(p, exc) from exc
    except ValueError as exc:  # a NUL byte, or a name the filesystem encoding cannot hold
        raise ModelFormatError(f"{str(p)!r} is not a valid path ({exc}): check the model path") from None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    raise _not_regular(p, mode)


def _not_regular(p: Path, mode: int) -> ModelFormatError:
    what = _NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")
    return ModelFormatError(
        f"{str(p)!r} is {what}, not a model file: pass a .gguf file, a .safetensors file or a model directory"
    )


def _unreadable(p: Path, exc: OSError) -> ModelFormatError:
    if exc.errno == errno.ENAMETOOLONG:
        why = "the path is too long for the filesystem (names have at most 255 bytes): check it"
    elif isinstance(exc, PermissionError):
        why = "permission denied: make it readable for this user (chmod, chown) or run as one who can"
    elif exc.errno == errno.ELOOP:
        why = "it is a loop of symbolic links: fix the link"
    elif exc.errno == errno.EISDIR:
        why = "it is a directory where a file was expected"
    else:
        why = f"{exc.strerror or exc}: check the file and the disk it is on"
    return ModelFormatError(f"{str(p)!r} cannot be read: {why}")


def _open(p: Path) -> FileIO:
    """``p`` opened for reading, unbuffered, if it is a regular file; never blocks on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except _NOTHING_THERE:
        raise ModelNotFound(str(p)) from None
    except OSError as exc:
        raise _unreadable(p, exc) from exc
    except ValueError as exc:
        raise ModelFormatError(f"{str(p)!r} is not a valid path ({exc}): check the model path") from None
    try:
        # checked on the open file: the path may have been replaced since it was looked at
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ModelFormatError(f"{str(p)!r} is a directory where a model file was expected")
        if not stat.S_ISREG(mode):
            raise _not_regular(p, mode)
        return FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _read(f: FileIO, n: int, p: Path | str) -> bytes:
    """``n`` bytes, fewer only at the end of the file. Callers bound ``n`` by the file's size: a
    read allocates what it asks for up front, so a lying length must never reach here."""
    try:
        data = f.read(n) or b""
        while 0 < len(data) < n:  # a short read before the end (a signal, a read over 2 GiB)
            more = f.read(n - len(data))
            if not more:
                break
            data += more
    except OSError as exc:
        raise _unreadable(Path(p), exc) from exc
    return data


def _listing(d: Path, suffix: str) -> list[Path]:
    """The entries of ``d`` whose names end with ``suffix``, sorted (what ``glob("*" + suffix)`` finds,
    with an unreadable directory reported instead of looking empty)."""
    try:
        with os.scandir(d) as entries:
            names = [e.name for e in entries if e.name.endswith(suffix)]
    except OSError as exc:
        raise _unreadable(d, exc) from exc
    return sorted(d / name for name in names)
