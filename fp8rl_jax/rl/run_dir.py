"""A run folder (``logging.out_dir``: metrics, config.json, checkpoints) owned by one run at a time.

Design notes
------------
* **One owner.** :class:`RunLock` creates ``FOLDER/run.lock`` holding the owner's pid, host, start
  time and command line, and holds an exclusive ``flock`` on it for the owner's lifetime. The file
  is written under a temporary name, locked, then hard-linked to ``run.lock``: the link either
  fails (someone owns the folder) or makes a complete, already locked file appear at once, so two
  runs starting together cannot both win.
* **Stale locks.** A lock whose ``flock`` can be taken belongs to a run that is gone (the kernel
  drops a process's locks when it dies, SIGKILL included): it is replaced, and
  ``RunLock.replaced`` names it. On a filesystem without ``flock`` the pid is checked instead when
  the owner ran on this host; an owner on another host then counts as alive (the message says
  which file to delete once that run is over).
* **Release.** Leaving the ``with`` block (or :meth:`RunLock.release`) deletes the file, provided
  it is still this run's, then drops the lock; a folder the lock created and nothing else filled is
  removed too.
* **Same run?** :func:`config_differences` compares the identity keys of the folder's saved
  config.json with the run's (seed, model, data: the scripts choose the keys), so a resume does not
  continue another run's checkpoints.
* **Set aside, never delete.** :func:`move_aside` moves a folder's contents (all but the lock) to a
  dated sibling, ``FOLDER.YYYYmmdd-HHMMSS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

LOCK_NAME = "run.lock"
CONFIG_NAME = "config.json"


class RunFolderError(RuntimeError):
    """A run folder this run cannot use as asked (in use, another run's, unreadable)."""


class RunFolderBusy(RunFolderError):
    """Another live run owns the folder."""


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who holds a run folder: what ``run.lock`` records."""

    pid: int
    host: str
    started: str  # UTC, ISO 8601
    command: str

    @classmethod
    def this_process(cls) -> Owner:
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv else "")

    @classmethod
    def from_json(cls, text: str) -> Owner | None:
        try:
            d = json.loads(text)
            return cls(pid=int(d["pid"]), host=str(d["host"]), started=str(d["started"]), command=str(d["command"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: {self.command}"


def _try_flock(fd: int) -> bool | None:
    """True: locked now; False: another open file holds it; None: the filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class RunLock:
    """Claims ``folder`` (created if needed) for this process; a context manager.

    Raises :class:`RunFolderBusy` (one line, naming the owner) when a live run holds it. After
    :meth:`acquire`, ``replaced`` is the :class:`Owner` of a stale lock that was taken over (or None).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.owner = Owner.this_process()
        self.replaced: Owner | None = None
        self._fd: int | None = None
        self._created = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> Self:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        if self.folder.exists() and not self.folder.is_dir():
            raise RunFolderError(f"{self.folder} is a file, not a run folder")
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock removed, or the owner released in between: try again
            fd, tmp = tempfile.mkstemp(prefix=f".{LOCK_NAME}.", dir=self.folder)
            try:
                os.fchmod(fd, 0o644)  # anyone may read who owns the folder
                os.write(fd, (json.dumps(dataclasses.asdict(self.owner)) + "\n").encode())
                _try_flock(fd)  # before the link, so the lock is held from the moment run.lock appears
                os.link(tmp, self.path)
                self._fd, fd = fd, None
                return self
            except FileExistsError:
                self._check_existing()
            finally:
                if fd is not None:
                    os.close(fd)
                os.unlink(tmp)
        raise RunFolderBusy(f"run folder {self.folder}: could not take {self.path} (other runs keep claiming it)")

    def _check_existing(self) -> None:
        """Raises RunFolderBusy if a live run owns ``run.lock``; else removes the stale file."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:  # released meanwhile
            return
        except PermissionError:
            raise RunFolderBusy(f"run folder {self.folder} is in use by another run ({self.path} is not "
                                "readable by this user)") from None
        try:
            owner = Owner.from_json(os.read(fd, 1 << 16).decode(errors="replace"))
            here = owner is not None and owner.host == socket.gethostname()
            free = _try_flock(fd)
            sure = free is not None and here  # only then does the lock's state settle whether the owner lives
            if free is None:  # no flock here: judge by the pid where it can be checked
                free = here and not _pid_alive(owner.pid)
            if not free:
                who = owner.describe() if owner else "an unreadable lock file"
                hint = "" if sure else f"; if that run is over, delete {self.path}"
                raise RunFolderBusy(f"run folder {self.folder} is in use by another run ({who}){hint}")
            if _same_file(fd, self.path):  # still the stale file (not a newer owner's): remove it
                os.unlink(self.path)
                self.replaced = owner or Owner(pid=-1, host="?", started="?", command="unreadable lock file")
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        finally:
            os.close(self._fd)  # drops the flock
            self._fd = None
        if self._created:  # a run that stopped before writing anything leaves no empty folder behind
            with contextlib.suppress(OSError):
                self.folder.rmdir()

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------ the run's config


def read_config(folder: str | Path) -> dict[str, Any] | None:
    """The folder's ``config.json`` (None when absent); :class:`RunFolderError` when unreadable."""
    path = Path(folder) / CONFIG_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunFolderError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{path} is not a JSON object")
    return data


_ABSENT = object()


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, Mapping) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _leaves(value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{key}.{k}"))
        return out
    return {key: value}


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """``"key: A in the folder, B in this run"`` for every differing (leaf of a) dotted ``key``."""
    out = []
    for key in keys:
        a, b = _get(saved, key), _get(current, key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            la, lb = _leaves(a, key), _leaves(b, key)
            pairs = [(k, la.get(k, _ABSENT), lb.get(k, _ABSENT)) for k in sorted(la.keys() | lb.keys())]
        else:
            pairs = [(key, a, b)]
        for k, x, y in pairs:
            if x != y:
                out.append(f"{k}: {_show(x)} in the folder, {_show(y)} in this run")
    return out


# ------------------------------------------------------------------------------------ setting a run aside


def move_aside(folder: str | Path, keep: Iterable[str] = (LOCK_NAME,)) -> Path:
    """Moves everything in ``folder`` but ``keep`` into a new dated sibling, ``FOLDER.YYYYmmdd-HHMMSS``
    (``-2``, ``-3``... if taken); returns it."""
    folder = Path(folder)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = folder.with_name(f"{folder.name}.{stamp}"), 2
    while True:
        try:
            dest.mkdir()
            break
        except FileExistsError:
            dest, n = folder.with_name(f"{folder.name}.{stamp}-{n}"), n + 1
    keep = set(keep)
    for entry in sorted(folder.iterdir()):
        if entry.name not in keep:
            entry.rename(dest / entry.name)
    return dest
