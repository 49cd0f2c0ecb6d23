"""Output files written whole or not at all, never through a name another user chose.

Every file memadvisor writes for the user (the CLI's ``--json``/``--html``/..., and
``Plan.to_json``/``Plan.to_html``) goes through :func:`write_text_atomic`:

* The bytes go to a temporary file that ``tempfile.mkstemp`` creates in the target's own
  folder: exclusive create (``O_EXCL``, so a file or a symlink another user planted under
  that name is never opened), an unpredictable name, and no two writers ever share one.
* The data is flushed and ``fsync``'d, then ``os.replace`` renames it over the target in one
  step: a reader sees the old file or the new one, never half of either. A failed write (a
  full disk, an interrupt) removes the temporary file and leaves the old target whole.
* The new file's mode is what the user's umask gives a new file (``0o666 & ~umask``), as a
  plain ``open(path, "w")`` would make it; ``mkstemp``'s own 0600 is only while writing.

What the target may be: a new name, or an existing regular file. A symlink to a regular file
is written through: the file it points to is replaced (atomically, in that file's folder) and
the link stays. A character device or a FIFO (``/dev/stdout``, a terminal, ``| jq`` through
a named pipe) is written through too, never replaced: the bytes go to it directly, with no
temporary file (a stream has no old content to keep whole). Anything else is refused with a
:class:`BadInputError` that names the path: a block device, a socket, a folder, a dangling
symlink, or a symlink owned by another user (in a shared folder that is how a plan would be
redirected into a file of theirs, or of root's). :func:`check_writable` runs the same
checks, and creates and removes a temporary file in the folder, so that the CLI refuses an
output path before the plan is made rather than after.

Known limitations:
    * ``fsync`` of the file, not of its folder: after a power cut the rename itself may be
      lost (the old file is then still there, whole).
    * The checks and the write are separate steps: a path changed between them (by another
      process) is caught by the write's own checks, which run again.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from memadvisor.errors import BadInputError

__all__ = ["check_writable", "write_bytes_atomic", "write_text_atomic"]

_KINDS = (
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)
_INSTEAD = (
    "pass the path of a regular file (a new name, or a file to replace), a FIFO or a "
    "character device such as /dev/stdout"
)


def _streams(mode: int) -> bool:
    """Whether a file of this mode is written through (a character device, a FIFO)."""
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _kind(mode: int) -> str | None:
    """What a file memadvisor will not write is, in words; None for one it writes."""
    if stat.S_ISREG(mode) or _streams(mode):
        return None
    for test, words in _KINDS:
        if test(mode):
            return words
    return "not a regular file"


def _target(path: Path, what: str) -> tuple[Path, bool]:
    """The file to write for ``path`` and whether it is a stream written through: itself, the
    regular file its symlink points to (replaced), or the device or FIFO it is or points to.

    Raises:
        BadInputError: ``path`` is none of those, or a symlink that is not safe to follow
            (dangling, owned by another user, pointing at anything else).
    """
    try:
        own = os.lstat(path)
    except FileNotFoundError:
        return path, False
    except OSError as e:
        raise BadInputError(f"Cannot write {what} to {str(path)!r}: {e.strerror}.") from e
    if not stat.S_ISLNK(own.st_mode):
        kind = _kind(own.st_mode)
        if kind is not None:
            raise BadInputError(f"Cannot write {what} to {str(path)!r}: it is {kind}; {_INSTEAD}.")
        return path, _streams(own.st_mode)
    if own.st_uid not in (os.geteuid(), 0):
        raise BadInputError(
            f"Cannot write {what} to {str(path)!r}: it is a symlink owned by another user "
            f"(uid {own.st_uid}), and following it would write where they chose; {_INSTEAD}."
        )
    resolved = Path(os.path.realpath(path))
    try:
        # Through the link itself: /dev/stdout -> /proc/self/fd/1 -> "pipe:[...]" has no
        # path of its own to resolve to, but opening the link reaches the pipe.
        points_to = os.stat(path)
    except FileNotFoundError:
        raise BadInputError(
            f"Cannot write {what} to {str(path)!r}: it is a symlink to {str(resolved)!r}, "
            f"which does not exist; {_INSTEAD}."
        ) from None
    kind = _kind(points_to.st_mode)
    if kind is not None:
        raise BadInputError(
            f"Cannot write {what} to {str(path)!r}: it is a symlink to {str(resolved)!r}, "
            f"which is {kind}; {_INSTEAD}."
        )
    if _streams(points_to.st_mode):
        return path, True
    return resolved, False


def check_writable(path: str | Path, what: str) -> Path:
    """Fail now, before any long work, if :func:`write_text_atomic` could not write ``path``.

    Runs the target checks and creates (then removes) a temporary file in the folder, which
    is what the write needs: a read-only file system or a folder without write permission
    fails here. Returns the file that will be replaced.

    Raises:
        BadInputError: the folder is missing or not writable, or the target is refused.
    """
    path = Path(path)
    target, stream = _target(path, what)
    if stream:
        if not os.access(target, os.W_OK):
            raise BadInputError(
                f"Cannot write {what} to {str(path)!r}: it is not writable by this user."
            )
        return target
    folder = target.parent
    if not folder.is_dir():
        raise BadInputError(
            f"Cannot write {what} to {str(path)!r}: the folder {str(folder)!r} does not exist; "
            "create it or write elsewhere."
        )
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".check")
    except OSError as e:
        raise BadInputError(
            f"Cannot write {what} to {str(path)!r}: the folder {str(folder)!r} is not writable "
            f"({e.strerror}); write elsewhere."
        ) from e
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return target


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: set and restored at once
    os.umask(mask)
    return mask


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd`` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_through(target: Path, data: bytes, what: str) -> None:
    """``data`` to a character device or FIFO as it is: opened for writing, never created,
    truncated or replaced (O_NOCTTY: a terminal does not become this process's)."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NOCTTY)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        raise BadInputError(f"Cannot write {what} to {str(target)!r}: {e.strerror or e}.") from e


def write_text_atomic(path: str | Path, text: str, what: str) -> Path:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8."""
    return write_bytes_atomic(path, text.encode("utf-8"), what)


def write_bytes_atomic(path: str | Path, data: bytes, what: str) -> Path:
    """Write ``data`` to ``path`` whole or not at all (the module docstring's rules).

    Args:
        path: the file to write.
        data: its new content.
        what: the file in words, for messages ("the plan").

    Returns:
        ``path`` as a Path.

    Raises:
        BadInputError: the target is refused, or the write failed (the old file is whole).
    """
    path = Path(path)
    target, stream = _target(path, what)
    if stream:
        _write_through(target, data, what)
        return path
    try:
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    except OSError as e:
        raise BadInputError(f"Cannot write {what} to {str(path)!r}: {e.strerror}.") from e
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(e, OSError):
            raise BadInputError(
                f"Cannot write {what} to {str(path)!r}: {e.strerror or e}; the file there "
                "before (if any) is unchanged."
            ) from e
        raise
    return path
