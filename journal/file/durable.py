"""Durable writes, as the segment log and the snapshot generations make them: append files
opened ``O_DSYNC``, writes that land whole, directory entries fsynced."""

from __future__ import annotations

import io
import os
from pathlib import Path

from rollout_journal.journal.errors import ConfigurationError


def open_append(path: Path, *, fsync: bool) -> io.FileIO:
    """An unbuffered append file. With ``fsync`` it is opened ``O_DSYNC``: each write
    returns once its data and the file size that reaches it are durable, one system
    call per commit instead of write + fdatasync (the committer thread gives up and
    takes back the GIL at each one)."""
    sync = os.O_DSYNC if fsync else 0
    return open(path, "ab", buffering=0, opener=lambda name, flags: os.open(name, flags | sync, 0o644))


def write_all(file: io.FileIO, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a regular file takes it all at once, barring a full disk or a signal
        view = view[file.write(view) :]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def for_writing(file: io.FileIO | None, root: Path, action: str = "write") -> io.FileIO:
    """``file``, the log segment or snapshot generation a writer appends to; a reader (or a
    closed writer) has none and refuses here, before it touches a file."""
    if file is None:
        raise ConfigurationError(f"file journal {root} is open read-only (or closed); cannot {action}")
    return file
