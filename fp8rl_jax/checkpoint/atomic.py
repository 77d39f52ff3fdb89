"""Writing files and folders so that a reader sees the old content or the new, never a part.

A file is written to a uniquely named temporary file beside its destination and renamed over it
(``os.replace``: atomic within one filesystem); a folder is built in a unique staging folder
beside its destination and renamed into place. Any failure removes the temporary file or folder.
Unique names (``tempfile``) let processes writing the same destination not share anything: the
last rename of a file wins, and a folder is only ever renamed onto an absent or empty one.

``tempfile`` creates files 0600 and folders 0700; both get the modes a plain ``open()`` or
``mkdir`` would give instead: 0666 or 0777 less the process umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def umask() -> int:
    """The process umask (read from /proc where there is one: ``os.umask`` can only be read by setting it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode ``mkdir`` gives a new folder: 0777 less the umask."""
    return 0o777 & ~umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed to ``path`` when the block succeeds, removed if not."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Calls ``write`` on a binary file that replaces ``path`` once it returns."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def make_parents(path: str | os.PathLike) -> list[Path]:
    """Creates the missing folders above ``path``; returns those it created, outermost first."""
    missing = [p for p in Path(path).parents if not p.exists()][::-1]
    created: list[Path] = []
    try:
        for p in missing:
            try:
                p.mkdir()
            except FileExistsError:  # made meanwhile by another process: not ours to remove
                continue
            created.append(p)
    except BaseException:
        remove_empty(created)
        raise
    return created


def remove_empty(folders: list[Path]) -> None:
    """Removes ``folders`` (innermost last in the list) where they are still empty."""
    for p in reversed(folders):
        with contextlib.suppress(OSError):
            p.rmdir()


def staging_dir(dst: str | os.PathLike) -> Path:
    """A new, uniquely named folder beside ``dst`` (whose parent must exist) to build ``dst`` in."""
    dst = Path(dst)
    staging = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".partial"))
    os.chmod(staging, dir_mode())
    return staging


def publish_dir(staging: Path, dst: str | os.PathLike) -> None:
    """Renames the finished ``staging`` folder to ``dst``; raises FileExistsError (removing ``staging``)
    when ``dst`` is meanwhile a file or a non-empty folder. An empty ``dst`` folder is replaced."""
    try:
        os.rename(staging, dst)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(e.errno, f"{dst} is not an empty folder", str(dst)) from None
        raise
