"""Writing a file whole or not at all (temp file in the same directory, then ``os.replace``).

The one home of the daemon's atomic writes of small files (residency sets, routing traces, the
hardware profile): a failed write (disk full, quota, read-only file system) leaves the earlier file
as it was and no temp file behind, and is raised as :class:`WriteFailed` naming the path and the
errno.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from .errors import OstinatoError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(OstinatoError, OSError):
    """A file could not be written (an ``OSError`` with the same errno). ``path`` is the file
    that was to be written; ``no_space`` is true for a full disk or quota (ENOSPC, EDQUOT);
    ``code`` is "disk_full" then, else "write_failed" (status 507)."""

    status = 507

    def __init__(self, path: Path, cause: OSError):
        name = errno.errorcode.get(cause.errno, "") if cause.errno is not None else ""
        reason = cause.strerror or str(cause) or type(cause).__name__
        message = f"cannot write {path}: {reason}" + (f" ({name})" if name else "")
        OSError.__init__(self, cause.errno, message)  # errno and strerror as OSError has them
        self.path = Path(path)
        self.no_space = cause.errno in _NO_SPACE
        self.code, self.message, self.extra = ("disk_full" if self.no_space else "write_failed"), message, {}

    def __str__(self) -> str:
        return self.strerror


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically: readers see the old file or the new one, never part
    of one. Creates the parent directories. Returns ``path``; raises :class:`WriteFailed` (the
    old file untouched, the temp file removed)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise WriteFailed(path, e) from e
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def write_json_atomic(path: Path, doc: Any, indent: int | None = None) -> Path:
    """``doc`` as JSON (``indent``: pretty; None: compact), written by :func:`write_atomic`."""
    sep = None if indent is not None else (",", ":")
    return write_atomic(path, json.dumps(doc, indent=indent, separators=sep) + ("\n" if indent else ""))


class NotRegularFile(OstinatoError, OSError):
    """A path that does not name a readable regular file. ``kind`` says what it is instead:
    ``missing``, ``directory``, ``FIFO``, ``character device``, ``block device``, ``socket``,
    ``name too long``, ``invalid name`` (a NUL byte, not encodable) or ``unreadable`` (any
    other OSError: permissions, a loop of links); the message names the path (shortened).
    ``code`` is "not_a_file" (status 400)."""

    status = 400

    def __init__(self, path: Any, kind: str, detail: str = ""):
        shown = str(path).replace("\x00", "\\0")
        shown = shown if len(shown) <= 200 else shown[:120] + f"...({len(shown)} characters)"
        what = {"missing": "no such file", "invalid name": "not a valid file name",
                "name too long": "the file name is too long"}.get(kind, f"a {kind}, not a regular file")
        if kind == "unreadable":
            what = f"cannot be read ({detail})" if detail else "cannot be read"
        message = f"{shown}: {what}"
        OSError.__init__(self, message)
        self.code, self.message, self.extra = "not_a_file", message, {}
        self.kind = kind
        self.shown = shown  # the path as the message shows it

    def __str__(self) -> str:
        return self.args[0]


def regular_file(path: Any) -> Path:
    """``path`` (``~`` expanded) when it names a regular file (links followed); else raises
    :class:`NotRegularFile` saying what it is (a FIFO, a directory, ``/dev/zero``, missing, a
    name too long or with a NUL byte). Never opens the file (a FIFO would block)."""
    try:
        p = Path(str(path)).expanduser()
        st = os.stat(p)
    except ValueError:  # an embedded NUL byte
        raise NotRegularFile(path, "invalid name") from None
    except UnicodeEncodeError:
        raise NotRegularFile(path, "invalid name") from None
    except OSError as e:
        kind = {errno.ENOENT: "missing", errno.ENOTDIR: "missing",
                errno.ENAMETOOLONG: "name too long"}.get(e.errno or 0, "unreadable")
        raise NotRegularFile(path, kind, e.strerror or "") from None
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return p
    kind = ("directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else
            "character device" if stat.S_ISCHR(mode) else "block device" if stat.S_ISBLK(mode) else
            "socket" if stat.S_ISSOCK(mode) else "special file")
    raise NotRegularFile(path, kind)
