"""Checks an L3 store's LMDB environment before the server maps it, and moves a bad one aside.

LMDB trusts its file: a ``data.mdb`` shorter than its pages (an interrupted copy) faults the
process with SIGBUS when a page past the end is read, and damaged B-tree pages end in an
LMDB error at open or an assertion ``abort()`` on a later write. So the check runs in a child
process (``python -m ninfer.store.store_check DIR``), which only reads: it compares the file's
size with the last page LMDB's meta page names, then walks every named database and reads
every key and value whole. Whatever kills the child is a verdict, never the server's end.
A read cannot see damage confined to LMDB's free-page list (it is read only by writes).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHECK_TIMEOUT_S = 600.0   # a child walk longer than this leaves the store unused, not moved
CORRUPT = 1               # the child's exit status for a store that is not whole
UNCHECKED = 3             # ... for one it could not read (permissions, resources)


class CheckFailed(RuntimeError):
    """The check could not run or finish (no verdict): the store must not be used, nor moved."""


def walk(path: str, check_size: bool = True) -> int:
    """Read the whole environment under directory ``path`` (child side: may die of SIGBUS or
    abort on a damaged file). Returns the bytes of keys and values read. ``check_size``:
    first refuse a file shorter than its pages (False: read anyway, as LMDB would).

    Raises:
        ValueError: ``data.mdb`` is shorter than the pages its meta page says are in use.
        lmdb.Error: LMDB found the file invalid or corrupt (or could not open it).
    """
    import lmdb
    env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=64)
    try:
        size = os.path.getsize(os.path.join(path, "data.mdb"))
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if check_size and size < need:
            raise ValueError(f"data.mdb is {size} bytes, its pages end at {need} (truncated)")
        n = 0
        with env.begin(buffers=True) as txn:
            names = [bytes(k) for k, _ in txn.cursor()]   # the main DB lists the named ones
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                for k, v in txn.cursor(db=db):
                    n += len(bytes(k)) + len(bytes(v))    # copies: every page is touched
        return n
    finally:
        env.close()


def check(path: str, timeout_s: float = CHECK_TIMEOUT_S, check_size: bool = True
          ) -> str | None:
    """Whether the LMDB environment under directory ``path`` is whole: None (also when there
    is none yet), else why not, in one line. The walk (``walk``) runs in a child process;
    ``check_size`` False skips its size check (tests: what reading it does to a process).

    Raises:
        CheckFailed: the child could not be started, timed out, or could not read the store.
    """
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None
    try:
        argv = [sys.executable, "-m", "ninfer.store.store_check", path]
        r = subprocess.run(argv + ([] if check_size else ["--no-size-check"]),
                           capture_output=True, timeout=timeout_s, text=True, errors="replace")
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"checking {path} took longer than {timeout_s:g} s") from None
    except OSError as exc:
        raise CheckFailed(f"cannot start the check of {path}: {exc}") from None
    lines = r.stderr.strip().splitlines()
    last = lines[-1] if lines else f"exit status {r.returncode}"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        return f"reading it killed the check process ({signal.Signals(-r.returncode).name})"
    if r.returncode == CORRUPT:
        return last
    raise CheckFailed(f"cannot check {path}: {last}")


def quarantine(path: str) -> str:
    """Rename directory ``path`` to ``<path>.corrupt-<UTC time>`` next to it (a counter
    is appended if that exists); returns the new path.

    Raises:
        OSError: the rename failed.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, i = f"{path}.corrupt-{stamp}", 1
    while os.path.lexists(dest):
        i += 1
        dest = f"{path}.corrupt-{stamp}-{i}"
    os.rename(path, dest)
    return dest


def main(argv: list[str]) -> int:
    """The child (``DIR [--no-size-check]``): exit 0 (whole), ``CORRUPT`` or ``UNCHECKED``
    with the reason on stderr."""
    import lmdb
    # what says nothing about the file: the system's errors (lmdb.Error itself: errno) and
    # limits or resources
    environment = (lmdb.ReadersFullError, lmdb.TlsFullError, lmdb.MapResizedError,
                   lmdb.LockError, lmdb.MemoryError, lmdb.DiskError, lmdb.ReadonlyError,
                   lmdb.InvalidParameterError)
    try:
        walk(argv[0], check_size="--no-size-check" not in argv[1:])
    except (ValueError, lmdb.Error) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return UNCHECKED if type(exc) is lmdb.Error or isinstance(exc, environment) \
            else CORRUPT
    except Exception as exc:   # (memory, ...): no verdict
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return UNCHECKED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
