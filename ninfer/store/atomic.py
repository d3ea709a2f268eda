"""Atomic file replacement: write a temporary file beside the target, sync it, rename it over
the target (readers see the old file or the new one, never half of one), sync the directory;
on any failure the temporary file is removed and the target is untouched."""
from __future__ import annotations

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_file(path, prefix: str, suffix: str = "", mode: int | None = None):
    """Yield a binary file open for writing; on a clean exit it is flushed, fsynced,
    ``chmod``-ed to ``mode`` (when given) and renamed over ``path``.

    Args:
        path: the target (str or Path).
        prefix, suffix: of the temporary file's name (``tempfile.mkstemp``: unique, so
            concurrent writers of one target never share it).

    Raises:
        OSError: the directory cannot be written (nothing changes).
    """
    d = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):   # the rename itself durable
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
