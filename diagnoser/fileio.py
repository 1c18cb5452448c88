"""File writes and reads that fail safely: atomic writes (captures, reports, the calibration store, the agent's
reports), a check that an output can be written before a window starts, and reads bounded by size (captures,
configs) so that a hostile or mistaken path (/dev/zero, a sparse file, a huge file) cannot fill memory."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, data: bytes, mode: int = 0o644) -> Path:
    """Write to a temporary file beside `path`, fsync, rename: readers see the old file or the new one, never half
    of one, even if the process is killed mid-write. Raises OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable(path: str | Path, option: str) -> None:
    """Fail now, in one sentence, if `path` could not be written later; create nothing that was not there.

    For outputs written after an observation window (--save, --html): finding out after the window loses it. The
    folder must already exist (a typo such as --html /nonexistent/dir/x.html must not create /nonexistent), the
    path must not be a folder, and a file must be creatable in the folder: probed by creating and removing a
    temporary file, since permission bits do not tell root, read-only mounts or ACLs apart.
    """
    from diagnoser.errors import InputError

    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder; give a file name in it.")
    if not parent.exists():
        raise InputError(f"{option} {path}: the folder {parent} does not exist; create it first or pick another "
                         "path.")
    if not parent.is_dir():
        raise InputError(f"{option} {path}: {parent} is not a folder.")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as exc:
        raise InputError(f"{option} {path} cannot be written: {exc.strerror or exc} in {parent}.") from None
    os.close(fd)
    Path(probe).unlink(missing_ok=True)


class TooLarge(OSError):
    """A file or stream holds more than the caller accepts (`limit` bytes); `size` is what was seen, if known."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        super().__init__(f"more than {_human(limit)}" + (f" ({_human(size)})" if size is not None else ""))
        self.limit = limit
        self.size = size


def _human(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 \
        else f"{n} bytes"


_CHUNK = 1 << 20


def read_bounded(path: str | Path, limit: int,
                 check_head: Callable[[bytes], None] | None = None) -> bytearray:
    """The bytes of `path`, never more than `limit`: a regular file is refused by its size before anything is read
    (a huge or sparse file), anything else (a pipe, a device: /dev/zero never ends) while it is read. `check_head`
    sees the first chunk and may raise, so that what is plainly not the expected format (zeros, binary) is refused
    after one chunk rather than after `limit` bytes. Raises OSError (TooLarge when over the limit)."""
    # O_NONBLOCK: opening a FIFO with no writer would otherwise hang here; reads are made blocking again below.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise TooLarge(limit, st.st_size)
        os.set_blocking(fd, True)
        out = bytearray()
        while len(out) <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - len(out)))
            if not chunk:
                break
            if not out and check_head is not None:
                check_head(chunk)
            out += chunk
        if len(out) > limit:
            raise TooLarge(limit)
        return out  # not copied into bytes: the callers' decoders take any buffer
    finally:
        os.close(fd)


# Configs (a model's config.json, rules and agent TOML) are kilobytes; a large quantization config is a few hundred.
MAX_CONFIG_BYTES = 16 << 20


class NotText(OSError):
    """A file that should be text holds NUL bytes (/dev/zero, a binary file given by mistake)."""

    def __init__(self) -> None:
        super().__init__("it is not a text file (it holds NUL bytes)")


def _text_head(head: bytes) -> None:
    if b"\0" in head:
        raise NotText


def read_text_bounded(path: str | Path, limit: int = MAX_CONFIG_BYTES) -> str:
    """A UTF-8 text file of at most `limit` bytes (configs). Raises OSError (TooLarge, NotText) or
    UnicodeDecodeError."""
    data = read_bounded(path, limit, _text_head)
    if b"\0" in data:
        raise NotText
    return data.decode("utf-8")
