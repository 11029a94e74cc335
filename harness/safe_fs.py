"""File-system guards: writes that never follow a link out of a results folder, and the private job folder.

Trust model (docs/security.md): a results folder (``--out``) may be shared, so anything in
it is data another user may have planted. Below ``--out`` every directory is opened without following
symbolic links and every file is created fresh (``O_EXCL | O_NOFOLLOW``, then renamed into place), so a
planted link or hard link is refused or replaced, never written through. Code is never loaded from the
results folder: job files and submitit's pickles live in a private folder (0700, owned by the user, every
ancestor writable only by its owner or sticky) outside it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

JOBS_DIR_ENV = "PF_BENCH_JOBS_DIR"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class UnsafePathError(ValueError):
    """A write would follow a link out of its folder, or a folder is not private; the message says which."""


def _relative(path: Path, root: Path) -> Path:
    try:
        return path.relative_to(root)
    except ValueError:
        raise UnsafePathError(f"{path} is not inside {root}") from None


@contextmanager
def open_dir(path: str | Path, root: str | Path | None = None, create: bool = True) -> Iterator[int]:
    """A file descriptor of the directory ``path``. Every component below ``root`` (default: the path's
    parent) must be a real directory, not a link; missing ones are created (0755) when ``create``."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    parts = _relative(path, root).parts
    if create:
        root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root, _DIR_FLAGS)
    except NotADirectoryError:
        raise UnsafePathError(f"{root} is not a directory") from None
    try:
        here = root
        for part in parts:
            here = here / part
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "a symbolic link" if os.path.islink(here) else "not a directory"
                    raise UnsafePathError(
                        f"refusing to write under {here}: it is {kind} inside {root} "
                        "(planted in the results folder?); remove it or use another --out"
                    ) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _create(name: str, dir_fd: int, mode: int) -> int:
    return os.open(
        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd
    )


def atomic_write(
    path: str | Path, write: Callable[[BinaryIO], None], root: str | Path | None = None, mode: int = 0o644
) -> Path:
    """Write ``path`` atomically: a fresh temp file in its folder (never through a link), fsync, rename.
    The folder is opened as :func:`open_dir` does (no links below ``root``)."""
    path = Path(path)
    with open_dir(path.parent, root) as dfd:
        tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = _create(tmp, dfd, mode)
        try:
            os.fchmod(fd, mode)  # the umask must not narrow shared results
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a planted link itself
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        _remove_stale_temps(path.name, dfd)
    return path


STALE_TMP_S = 60.0  # a temp file untouched this long belongs to a writer that was killed
_TMP_HEX = 12


def _remove_stale_temps(name: str, dfd: int) -> int:
    """Unlink ``.NAME.<hex>.tmp`` files that a killed writer of ``name`` left in the folder (``dfd``): plain
    files of this user, older than :data:`STALE_TMP_S` (a live writer's temp is fresh); links are left."""
    prefix, removed = f".{name}.", 0
    now = time.time()
    with os.scandir(dfd) as entries:
        stale = [
            e.name
            for e in entries
            if e.name.startswith(prefix)
            and e.name.endswith(".tmp")
            and len(e.name) == len(prefix) + _TMP_HEX + 4
            and all(c in "0123456789abcdef" for c in e.name[len(prefix) : -4])
        ]
    for entry in stale:
        try:
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime > STALE_TMP_S:
                os.unlink(entry, dir_fd=dfd)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def open_new(path: str | Path, root: str | Path | None = None, mode: int = 0o644) -> BinaryIO:
    """Open ``path`` for writing as a new, empty file: whatever was there (a link, a hard link to someone
    else's file) is unlinked first, never truncated or followed."""
    path = Path(path)
    with open_dir(path.parent, root) as dfd:
        try:
            os.unlink(path.name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise UnsafePathError(f"refusing to write {path}: it is a directory") from None
        return os.fdopen(_create(path.name, dfd, mode), "wb")


def open_lock(path: str | Path, root: str | Path | None = None) -> int:
    """A descriptor for a lock file (created if missing, never truncated, never through a link)."""
    path = Path(path)
    with open_dir(path.parent, root) as dfd:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path.name, flags, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"refusing to open {path}: it is a symbolic link (planted in the results folder?); remove it"
                ) from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"refusing to open {path}: not a regular file")
    return fd


def check_writable(folder: str | Path, root: str | Path) -> None:
    """Create ``folder`` (no links below ``root``) and prove a file can be created in it: a clear error
    before any work, not after (OSError with strerror, or UnsafePathError)."""
    folder, root = Path(folder), Path(root)
    if root.exists() and not root.is_dir():
        raise UnsafePathError(f"{root} exists and is not a directory")
    with open_dir(folder, root) as dfd:
        probe = f".write-probe.{secrets.token_hex(6)}.tmp"
        os.close(_create(probe, dfd, 0o600))
        os.unlink(probe, dir_fd=dfd)


def is_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` (resolved, links followed) lies in ``folder`` (resolved)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def _check_ancestors(real: Path) -> None:
    uid = os.geteuid()
    for folder in reversed(real.parents):
        st = os.stat(folder)
        shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and not st.st_mode & stat.S_ISVTX:
            raise UnsafePathError(
                f"job folder {real} is unsafe: {folder} is writable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}), who could replace it; set {JOBS_DIR_ENV} to a private place"
            )
        if st.st_uid not in (0, uid):
            raise UnsafePathError(
                f"job folder {real} is unsafe: {folder} belongs to uid {st.st_uid}, who could replace it; "
                f"set {JOBS_DIR_ENV} to a private place"
            )


def trusted_dir(path: str | Path) -> bool:
    """Whether ``path`` and its ancestors are writable only by root or this user (e.g. before putting a
    folder of executables on PATH)."""
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
        _check_ancestors(real)
    except (OSError, UnsafePathError):
        return False
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def private_dir(path: str | Path) -> Path:
    """Create (0700) or check a private folder: a real directory owned by this user, writable by no one
    else, under ancestors that no other user can rename. Raises :class:`UnsafePathError` otherwise."""
    path = Path(path).expanduser().absolute()
    for folder in reversed([path, *path.parents]):
        if not folder.exists():
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
    real = Path(os.path.realpath(path))
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"job folder {real} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"job folder {real} belongs to uid {st.st_uid}, not to you; refusing to use it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(
            f"job folder {real} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"refusing to load job files from it: `chmod 700 {real}` or set {JOBS_DIR_ENV}"
        )
    _check_ancestors(real)
    return real


def jobs_root() -> Path:
    """Where private job folders live: ``$PF_BENCH_JOBS_DIR``, else ``~/.cache/pf-bench/jobs``."""
    return Path(os.environ.get(JOBS_DIR_ENV) or Path.home() / ".cache" / "pf-bench" / "jobs")


def jobs_folder(spec_folder: str | Path) -> Path:
    """The private job folder of one results spec folder (job files, submitit's pickles and logs): outside
    the results folder, 0700, named by the spec folder's real path."""
    real = os.path.realpath(spec_folder)
    root = jobs_root()
    if is_inside(root, Path(real).parent):
        raise UnsafePathError(
            f"job folder {root} lies inside the results folder {Path(real).parent}; "
            f"set {JOBS_DIR_ENV} to a private place outside it"
        )
    key = hashlib.sha256(real.encode()).hexdigest()[:16]
    return private_dir(root / f"{Path(real).name}-{key}")
