"""File access confined to a directory, immune to symlink races.

Every function takes a workspace ``root`` (a real, absolute directory path) and ``rel``, a
path relative to it (a string, a ``Path`` or a sequence of components). The root is opened
once per call; each component is then opened *relative to the directory descriptor of the
previous one* with ``O_NOFOLLOW`` (``openat``-style, ``os.open(..., dir_fd=...)``), so a
directory swapped for a symlink between a check and the open makes the call fail with
:class:`UnsafePathError` instead of reaching outside the root. ``..`` components are refused.
Directories are listed the same way: :func:`open_dir` gives a descriptor to ``os.scandir``, and
:func:`open_subdir` opens a directory found in it, so a walk never enters a swapped symlink.

Reads are bounded while reading (``max_bytes``): a 2 GB sparse file costs one bounded read.
Anything that is not a regular file (a FIFO, a socket, a device) is refused without being
opened at all: its type is looked at first (``fstatat`` of the name in its directory, no
symlink followed), since opening some devices has effects of its own (a terminal, a tape);
what is then opened (``O_NONBLOCK``, never a blocking open) is checked again (``fstat``), in
case the name was swapped meanwhile. :func:`regular_or_missing` tells, without opening
anything, whether the name holds a regular file, nothing, or something else (for a read or a
write made by someone else, the client's editor, at that path). Writes go to a temporary file
in the same directory (its name starts with the file's, cut to at most 200 bytes, so that any
legal name has a legal temporary one), then ``os.replace`` over the name, both relative to the parent's
descriptor: a reader never sees half a file, and a symlink at the final name is replaced,
never followed. The new text is flushed to disk (``fsync``) before the rename, and the
directory after it (and the parent of every directory the write made), so a write that
returned survives a power loss. A replaced file keeps its mode and (as far as we may) its
owner; a read-only one is refused, not replaced; a write that fails removes the directories
it made. :func:`check_writable` tells, without writing, whether such a write is bound to
fail (a read-only file, a directory at the name, a file where a directory is needed, a
directory we may not write).
"""

from __future__ import annotations

import errno
import os
import stat as _stat
from pathlib import Path, PurePosixPath
from typing import Iterable

__all__ = ["UnsafePathError", "NotRegularFileError", "ReadOnlyFileError", "components", "lstat", "stat", "open_dir", "open_subdir",
           "open_regular", "regular_or_missing", "read_bytes", "read_text",
           "check_writable", "write_bytes_atomic", "write_text_atomic"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePathError(OSError):
    """The path leaves the root, or a component is a symlink or not a directory."""


class NotRegularFileError(OSError):
    """The final component is not a regular file (a FIFO, socket, device or directory)."""


class ReadOnlyFileError(PermissionError):
    """The file to replace is read-only (its own permissions forbid writing it)."""


def components(rel: str | os.PathLike[str] | Iterable[str]) -> list[str]:
    """The components of ``rel``; ``..``, absolute paths and NULs are refused."""
    if isinstance(rel, (str, os.PathLike)):
        text = os.fspath(rel)
        if "\x00" in text:
            raise UnsafePathError(errno.EINVAL, "path contains a NUL character")
        if os.path.isabs(text):
            raise UnsafePathError(errno.EINVAL, f"{text!r} is not relative to the workspace root")
        parts = [p for p in PurePosixPath(text).parts if p not in ("", ".")]
    else:
        parts = [p for p in rel if p not in ("", ".")]
    for p in parts:
        if p == ".." or "/" in p or "\x00" in p:
            raise UnsafePathError(errno.EINVAL, f"path component {p!r} is not allowed")
    return parts


def _open_root(root: str | os.PathLike[str]) -> int:
    return os.open(os.fspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_subdir(dfd: int, name: str) -> int:
    """A descriptor of the directory ``name`` in ``dfd``, never through a symlink: a symlink or
    a non-directory is :class:`UnsafePathError`; a missing one raises ``FileNotFoundError``."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise UnsafePathError(e.errno, f"{name!r} is a symlink or not a directory") from None
        raise


def open_subdir(dfd: int, name: str) -> int:
    """A descriptor of the directory ``name`` in the directory ``dfd`` (``O_NOFOLLOW |
    O_DIRECTORY``): a symlink or a non-directory there is :class:`UnsafePathError`, a missing
    one ``FileNotFoundError``. The caller closes it."""
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        raise UnsafePathError(errno.EINVAL, f"path component {name!r} is not allowed")
    return _open_subdir(dfd, name)


def open_dir(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str]) -> int:
    """A descriptor of the directory ``rel`` under ``root``, to list with ``os.scandir(fd)``:
    each component is opened from its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``,
    so a directory swapped for a symlink makes it fail (:class:`UnsafePathError`) instead of
    listing another directory; a missing one is ``FileNotFoundError``. The caller closes it."""
    return _walk(root, components(rel))


def _walk(root: str | os.PathLike[str], parts: list[str], *, create: bool = False) -> int:
    """A descriptor of the directory ``parts`` names under ``root`` (no symlink followed);
    with ``create``, missing directories are made on the way. The caller closes it."""
    return _walk_creating(root, parts, create=create)[0]


def _walk_creating(root: str | os.PathLike[str], parts: list[str], *, create: bool = False) -> tuple[int, int]:
    """``_walk``, and the index in ``parts`` of the first directory this call made (``len(parts)``
    when it made none): the directories from there on are new, so a write that fails can
    take them away again."""
    fd = _open_root(root)
    made = len(parts)
    try:
        for i, name in enumerate(parts):
            try:
                nfd = _open_subdir(fd, name)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                    made = min(made, i)
                except FileExistsError:
                    pass
                nfd = _open_subdir(fd, name)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        if made < len(parts):
            _remove_made(root, parts, made)
        raise
    return fd, made


def _remove_made(root: str | os.PathLike[str], dirs: list[str], made: int) -> None:
    """Remove the directories ``dirs[made:]`` a failed write made, deepest first, each only
    while empty (a directory something else put a file in meanwhile stays)."""
    for depth in range(len(dirs), made, -1):
        try:
            pfd = _walk(root, dirs[:depth - 1])
            try:
                os.rmdir(dirs[depth - 1], dir_fd=pfd)
            finally:
                os.close(pfd)
        except OSError:
            return


def _split(rel: str | os.PathLike[str] | Iterable[str]) -> tuple[list[str], str]:
    parts = components(rel)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, "the workspace root is a directory")
    return parts[:-1], parts[-1]


def lstat(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str]) -> os.stat_result:
    """``lstat`` of ``rel`` under ``root`` (the last component is not followed)."""
    parts = components(rel)
    if not parts:
        return os.stat(os.fspath(root))
    dfd = _walk(root, parts[:-1])
    try:
        return os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)


stat = lstat


def _not_regular(name: str, st: os.stat_result) -> OSError:
    """The error for ``name``, whose ``lstat`` is ``st``, which is not a regular file."""
    if _stat.S_ISLNK(st.st_mode):
        return UnsafePathError(errno.ELOOP, f"{name!r} is a symlink")
    return NotRegularFileError(errno.EINVAL, f"{name!r} is not a regular file")


def open_regular(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str]) -> tuple[int, int]:
    """A read descriptor of the regular file ``rel`` (blocking mode restored) and its size.
    Anything else at ``rel`` is refused before it is opened (opening a device can act on it):
    a symlink (:class:`UnsafePathError`), a directory, a FIFO, a socket or a device
    (:class:`NotRegularFileError`); the descriptor is checked again once open (the name may
    have been swapped between the look and the open)."""
    dirs, name = _split(rel)
    dfd = _walk(root, dirs)
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)  # fstatat(AT_SYMLINK_NOFOLLOW): opens nothing
        if not _stat.S_ISREG(st.st_mode):
            raise _not_regular(name, st)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePathError(e.errno, f"{name!r} is a symlink") from None
            raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(errno.EINVAL, f"{name!r} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def regular_or_missing(root: str | os.PathLike[str],
                       rel: str | os.PathLike[str] | Iterable[str]) -> os.stat_result | None:
    """The ``lstat`` of the regular file ``rel``, or None when there is nothing at ``rel`` (nor,
    maybe, at a directory on the way); nothing is opened but the directories, walked as every
    call here walks them. Anything else is refused: a symlink or a non-directory on the way, or
    a symlink at ``rel`` (:class:`UnsafePathError`), a directory (``IsADirectoryError``), a
    FIFO, a socket or a device (:class:`NotRegularFileError`). For a path someone else is about
    to open (the client's editor): they will find there what was found here, unless it changes
    in between."""
    dirs, name = _split(rel)  # (the workspace root: a directory)
    try:
        st = lstat(root, [*dirs, name])
    except FileNotFoundError:
        return None
    if _stat.S_ISREG(st.st_mode):
        return st
    if _stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"{name!r} is a directory")
    raise _not_regular(name, st)


def read_bytes(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str],
               max_bytes: int | None = None) -> tuple[bytes, bool]:
    """At most ``max_bytes`` bytes of the regular file ``rel`` and whether there was more."""
    fd, size = open_regular(root, rel)
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            if max_bytes is None:
                return f.read(), False
            data = f.read(max_bytes + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        return data[:max_bytes], True
    return data, False


def read_text(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str],
              max_bytes: int | None = None) -> tuple[str, bool]:
    """``read_bytes`` decoded as UTF-8 (invalid bytes replaced; a code point cut by the cap
    dropped) and whether the file was longer than ``max_bytes``."""
    data, more = read_bytes(root, rel, max_bytes)
    text = data.decode("utf-8", "replace")
    if more and text.endswith("\ufffd"):
        text = data.decode("utf-8", "ignore")  # the cap cut a multi-byte character
    return text, more


def write_bytes_atomic(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str], data: bytes,
                       *, make_dirs: bool = True) -> bool:
    """Replace (or create) ``rel`` with ``data``; returns True when the file was created.
    A replaced file keeps its mode and, as far as we may set them, its owner and group; a
    read-only file (no write permission for us, or none for anyone) is refused with
    :class:`ReadOnlyFileError`, as is a directory at the name (``IsADirectoryError``). The
    file is fsynced before the rename, its directory after it (and the parent of each
    directory made), so a write that returned is on disk. A failed write leaves nothing
    behind: no temporary file, no directory it made."""
    dirs, name = _split(rel)
    dfd, made = _walk_creating(root, dirs, create=make_dirs)
    try:
        old = _replaceable(dfd, name)
        regular = old is not None and _stat.S_ISREG(old.st_mode)
        mode = _stat.S_IMODE(old.st_mode) if regular else None
        tmp = None
        for attempt in range(100):
            candidate = f".{_stem(name)}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
            try:
                fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o666 if mode is None else 0o600, dir_fd=dfd)
            except FileExistsError:
                continue
            tmp = candidate
            break
        if tmp is None:  # pragma: no cover - 100 random collisions
            raise FileExistsError(errno.EEXIST, "could not create a temporary file")
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(data)
                if regular:
                    _keep_owner(f.fileno(), old)
                if mode is not None:
                    os.fchmod(f.fileno(), mode)  # after the owner: a chown clears set-id bits
                f.flush()
                os.fsync(f.fileno())  # the text is on disk before any name points at it
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        os.fsync(dfd)  # the rename itself
        _sync_made(root, dirs, made)  # and the entry of every directory this write made
        return old is None
    except BaseException:
        if made < len(dirs):
            _remove_made(root, dirs, made)
        raise
    finally:
        os.close(dfd)


#: the bytes of the final name a temporary file's name starts with: with the dot, the process
#: id, eight hex digits and ".tmp" (at most 22 bytes more) it stays under NAME_MAX (255 bytes)
TEMP_STEM_BYTES = 200


def _stem(name: str, limit: int = TEMP_STEM_BYTES) -> str:
    """The start of ``name`` that takes at most ``limit`` bytes on disk, cut between characters
    (a name of 80 CJK characters is 244 bytes: cut at 200 characters, its temporary file's name
    was over NAME_MAX, and a legal name could never be written). A byte of a name that is not
    UTF-8 (held as ``\udc80``-``\udcff``) is one byte on disk, and counts as one."""
    size = 0
    for i, ch in enumerate(name):
        size += len(os.fsencode(ch))
        if size > limit:
            return name[:i]
    return name


def _replaceable(dfd: int, name: str) -> os.stat_result | None:
    """The ``lstat`` of ``name`` in the directory ``dfd`` (None when there is none), after
    checking that a write may replace it: not a directory, not a read-only file."""
    try:
        old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if _stat.S_ISDIR(old.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"{name!r} is a directory")
    if _stat.S_ISREG(old.st_mode) and (not old.st_mode & 0o222 or not os.access(name, os.W_OK, dir_fd=dfd,
                                                                                follow_symlinks=False)):
        # replacing the name needs only the directory's permission: the file's own is what says no
        raise ReadOnlyFileError(errno.EACCES, f"{name!r} is read-only")
    return old


def _writable_dir(dfd: int, shown: str) -> None:
    """PermissionError (or EROFS) unless we may add and remove names in the directory ``dfd``."""
    if os.access(".", os.W_OK | os.X_OK, dir_fd=dfd):
        return
    try:  # a read-only file system (which says no to root too)
        read_only = bool(os.statvfs(dfd).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise OSError(errno.EROFS, f"{shown} is on a read-only file system")
    raise PermissionError(errno.EACCES, f"{shown} is not writable")


def check_writable(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str]) -> None:
    """Raise the error :func:`write_bytes_atomic` of ``rel`` is bound to fail with, without
    writing anything: a read-only file (:class:`ReadOnlyFileError`), a directory at the name
    (``IsADirectoryError``), a symlink or a file where a directory is needed
    (:class:`UnsafePathError`), or a directory we may not write to, the one that would hold
    the file or the first one missing (``PermissionError``, or ``EROFS``). A write can still
    fail later (the disk fills up, something changes meanwhile): it checks again."""
    dirs, name = _split(rel)
    fd = _open_root(root)
    try:
        for i, part in enumerate(dirs):
            try:
                nfd = _open_subdir(fd, part)
            except FileNotFoundError:  # made by the write, in the last directory there is
                _writable_dir(fd, f"{'/'.join(dirs[:i]) or 'the workspace folder'!r}")
                return
            os.close(fd)
            fd = nfd
        _replaceable(fd, name)
        _writable_dir(fd, f"{'/'.join(dirs) or 'the workspace folder'!r}")
    finally:
        os.close(fd)


def _sync_made(root: str | os.PathLike[str], dirs: list[str], made: int) -> None:
    """fsync the parent of each directory a write made (``dirs[made:]``), so that its entry,
    and with it the path to the new file, is on disk too."""
    for depth in range(made, len(dirs)):
        pfd = _walk(root, dirs[:depth])
        try:
            os.fsync(pfd)
        finally:
            os.close(pfd)


def _keep_owner(fd: int, old: os.stat_result) -> None:
    """Give the new file the old one's owner and group, or its group alone, as far as we may."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == (old.st_uid, old.st_gid):
        return
    for uid, gid in ((old.st_uid, old.st_gid), (-1, old.st_gid)):
        try:
            os.fchown(fd, uid, gid)
            return
        except OSError:
            continue


def write_text_atomic(root: str | os.PathLike[str], rel: str | os.PathLike[str] | Iterable[str], text: str,
                      *, make_dirs: bool = True) -> bool:
    """``write_bytes_atomic`` of ``text`` as UTF-8; True when the file was created."""
    return write_bytes_atomic(root, rel, text.encode("utf-8"), make_dirs=make_dirs)


def relative_to_root(root: Path, real: Path) -> list[str]:
    """The components of ``real`` (an absolute path inside ``root``) below ``root``."""
    return list(real.relative_to(root).parts)
