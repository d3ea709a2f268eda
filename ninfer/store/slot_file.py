"""Slot snapshot files: ``POST /slots/{id}?action=save|restore`` (serving contract §1.10,
llama.cpp server's ``--slot-save-path``).

A file holds one ``LaneImage`` (the token ledger, every attention layer's K and V and, on hybrid
models, the recurrent state at exactly that frontier), bound to the runtime identity it was
saved under (artifact SHA-256 and KV / state layout): a file from another model, layout or
format version is refused, never loaded. Layout, little-endian::

    b"NINFSLOT"  uint32 header length  msgpack header  array bytes (in header order)

header: ``version``, ``identity`` (hex SHA-256 of the identity dict), ``tokens`` (int32
bytes), ``arrays`` ([name, dtype, shape] per array: ``k``, ``v``, then ``conv.i`` / ``ssm.i``,
then each checkpoint's ``ckptJ.conv.i`` / ``ckptJ.ssm.i`` (and ``ckptJ.mtp``, its MTP row),
then ``mtp.rows``), ``checkpoints`` ([depth, roles] per checkpoint, roles among ``turn`` /
``anchor`` / ``ring``), ``mtp_start`` (with ``mtp.rows``: the first position of a speculative
lane's pending MTP rows),
``payload_bytes`` and ``payload_sha256`` (hex, over the ledger: the tokens, checkpoints and
``mtp_start``, then the array bytes; before version 4 the array bytes alone, so a flipped token
restored a session whose K/V belonged to other tokens). Arrays are streamed, so an
image may exceed msgpack's 4 GiB object limit. A save writes a hidden temporary file in the same
directory, syncs it and renames it over the name: a reader sees the old file or the new one,
never half of one. ``k`` and ``v`` hold the pages as the KV cache stores them: float32 under
``--kv-dtype fp32``, uint8 codec rows (codes and fp16 scales, bit for bit) under the other KV
dtypes, whose name is part of the identity; the state arrays are float32. A header naming
another dtype, negative or absurd shapes, or a payload of another size is refused before
anything is allocated, and only a regular file is read (not a FIFO, not a symlink).

Versions: 2 adds the ``ring`` role (the turn-checkpoint ring, ``--turn-checkpoints``); 3 adds
a speculative lane's MTP rows (``--spec mtp``: the session is then reused by speculative
requests too); 4 covers the ledger by the checksum; version 1 (turn checkpoint and anchor
only), 2 and 3 files still restore.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import time

import msgpack
import numpy as np

from ..engine.continuation import ImageCheckpoint, LaneImage
from .atomic import atomic_file

MAGIC = b"NINFSLOT"
VERSION = 4
# version -> the checkpoint roles it holds (3: also MTP rows)
READS = {1: ("turn", "anchor"), 2: ("turn", "anchor", "ring"), 3: ("turn", "anchor", "ring"),
         4: ("turn", "anchor", "ring")}
TMP_MARK = ".tmp-"   # a save's temporary file: ".NAME.tmp-XXXXXXXX" beside NAME
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_CHUNK = 64 << 20   # bytes read / hashed at a time


class SlotFileError(ValueError):
    """A slot file that cannot be restored here: missing, unreadable, truncated or corrupt,
    another format version, or saved under another model or cache layout."""


def valid_filename(name) -> bool:
    """1-128 bytes of ``[A-Za-z0-9._-]``, not starting with a dot (no paths, no hidden
    files: the temporary files of a save are hidden)."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and not name.startswith(".")


def identity_digest(identity: dict, version: int = VERSION) -> str:
    """Hex SHA-256 of ``identity`` (JSON, sorted keys) with the format's ``version``."""
    return hashlib.sha256(json.dumps({"slot_format": version, **identity},
                                     sort_keys=True).encode()).hexdigest()


def _arrays(image: LaneImage) -> list[tuple[str, np.ndarray]]:
    out = [("k", image.k), ("v", image.v)]
    for i, a in enumerate(image.conv or []):
        out.append((f"conv.{i}", a))
    for i, a in enumerate(image.ssm or []):
        out.append((f"ssm.{i}", a))
    for j, mark in enumerate(image.checkpoints or []):
        out += [(f"ckpt{j}.conv.{i}", a) for i, a in enumerate(mark.conv)]
        out += [(f"ckpt{j}.ssm.{i}", a) for i, a in enumerate(mark.ssm)]
        if mark.mtp_row is not None:
            out.append((f"ckpt{j}.mtp", mark.mtp_row))
    if image.mtp_rows is not None:
        out.append(("mtp.rows", image.mtp_rows))
    return [(name, np.ascontiguousarray(a)) for name, a in out]


def _checksum(version: int, tokens: bytes, marks: list, mtp_start: int):
    """The running SHA-256 of a file's payload, seeded (version 4 on) with its ledger: the
    token ids, the checkpoints ([depth, roles]) and ``mtp_start``."""
    sha = hashlib.sha256()
    if version >= 4:
        sha.update(struct.pack("<Q", len(tokens)) + tokens)
        sha.update(json.dumps([[[int(d), list(r)] for d, r in marks], int(mtp_start)]).encode())
    return sha


def _mismatch(ident: str, identity: dict, version: int) -> str:
    """Why a file's identity digest is not this runtime's: a digest is not reversible, so the
    runtime's own identity is tried under each other KV dtype and backend, which a user can
    change (a restart with the saving server's flag restores the file)."""
    from ninfer.engine.kv_dtypes import KV_DTYPES
    for key, values, flag in (("kv_dtype", KV_DTYPES, "--kv-dtype"),
                              ("backend", ("numpy", "cupy"), "--backend")):
        for v in values:
            if key in identity and v != identity[key] and \
                    ident == identity_digest({**identity, key: v}, version):
                return (f"saved with {flag} {v}; this server runs {flag} {identity[key]} "
                        f"(restart it with {flag} {v} to restore the file)")
    return "saved under another model, cache layout or backend"


def write_slot_file(path: str, image: LaneImage, identity: dict) -> int:
    """Write ``image`` to ``path`` atomically (temporary file, fsync, rename); returns the
    bytes written.

    Raises:
        OSError: the directory cannot be written (the temporary file is removed).
    """
    arrays = _arrays(image)
    tokens = np.asarray(image.tokens, "<i4").tobytes()
    marks = [[int(c.depth), list(c.roles)] for c in image.checkpoints or []]
    sha = _checksum(VERSION, tokens, marks, image.mtp_start)
    for _, a in arrays:
        sha.update(memoryview(a).cast("B"))
    header = msgpack.packb({
        "version": VERSION, "identity": identity_digest(identity), "tokens": tokens,
        "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays],
        "checkpoints": marks, "mtp_start": int(image.mtp_start),
        "payload_bytes": sum(a.nbytes for _, a in arrays), "payload_sha256": sha.hexdigest()})
    name = os.path.basename(path)
    with atomic_file(path, prefix=f".{name}{TMP_MARK}") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        for _, a in arrays:
            f.write(memoryview(a).cast("B"))
        written = f.tell()
    return written


def read_slot_file(path: str, identity: dict, check=None,
                   max_tokens: int | None = None) -> tuple[LaneImage, int]:
    """The image saved in ``path`` and the bytes read.

    Args:
        path: the file (a regular file; a symlink or FIFO is refused).
        identity: this runtime's identity dict (what ``write_slot_file`` was given).
        check: optional ``check(image)`` raising ValueError when the arrays do not fit this
            runtime (``continuation_store.check_layout``).
        max_tokens: refuse, from the header alone, a session longer than this.

    Raises:
        SlotFileError: see the class; nothing is loaded.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise SlotFileError(f"cannot read the file: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SlotFileError("not a regular file")
            return _read(f, st.st_size, identity, check, max_tokens)
    except OSError as exc:
        raise SlotFileError(f"cannot read the file: {exc.strerror or exc}") from None


def _read(f, size: int, identity: dict, check, max_tokens) -> tuple[LaneImage, int]:
    lead = f.read(len(MAGIC) + 4)
    if len(lead) < len(MAGIC) + 4 or lead[:len(MAGIC)] != MAGIC:
        raise SlotFileError("not a ninfer slot file")
    (hlen,) = struct.unpack("<I", lead[len(MAGIC):])
    if hlen > size:
        raise SlotFileError("truncated header")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise SlotFileError("truncated header")
    try:
        h = msgpack.unpackb(raw)
        version, ident, token_bytes = h["version"], h["identity"], bytes(h["tokens"])
        tokens = np.frombuffer(token_bytes, "<i4").astype(np.int32)
        specs = [(str(n), np.dtype(dt), tuple(int(x) for x in shape))
                 for n, dt, shape in h["arrays"]]
        payload, want_sha = int(h["payload_bytes"]), str(h["payload_sha256"])
        marks = [(int(d), tuple(str(r) for r in roles)) for d, roles in h.get("checkpoints", [])]
        mtp_start = int(h.get("mtp_start", 0))
    except Exception as exc:
        raise SlotFileError(f"malformed header ({type(exc).__name__})") from None
    if not isinstance(version, int) or version not in READS:
        raise SlotFileError(f"slot file version {version} (this server reads "
                            f"{', '.join(map(str, READS))})")
    if ident != identity_digest(identity, version):
        raise SlotFileError(_mismatch(ident, identity, version))
    if tokens.size == 0:
        raise SlotFileError("the file holds no tokens")
    if max_tokens is not None and tokens.size > max_tokens:
        raise SlotFileError(f"the saved session has {tokens.size} tokens; a lane holds "
                            f"{max_tokens} (the session + at least one token)")
    f32, u8 = np.dtype("<f4"), np.dtype("u1")
    for name, dt, shape in specs:
        allowed = (f32, u8) if name in ("k", "v") else (f32,)
        if dt not in allowed or any(x < 0 for x in shape) or not shape:
            raise SlotFileError(f"array {name!r}: {dt.str} {shape} (float32 arrays, or uint8 "
                                f"K/V codec rows, only)")
    if size != len(MAGIC) + 4 + hlen + payload or payload != sum(
            dt.itemsize * int(np.prod(shape, dtype=object)) for _, dt, shape in specs):
        raise SlotFileError("truncated or oversized payload")
    sha = _checksum(version, token_bytes, marks, mtp_start)
    arrays = {}
    for name, dt, shape in specs:
        a = np.empty(shape, dtype=dt)
        buf = memoryview(a.reshape(-1).view(np.uint8))
        got = 0
        while got < a.nbytes:
            n = f.readinto(buf[got:got + _CHUNK])
            if not n:
                raise SlotFileError("truncated payload")
            got += n
        sha.update(buf)
        arrays[name] = a
    if sha.hexdigest() != want_sha:
        raise SlotFileError("checksum mismatch (corrupt file)")
    try:
        def state(prefix: str) -> tuple[list, list]:
            return ([arrays[f"{prefix}conv.{i}"] for i in range(
                        sum(n.startswith(f"{prefix}conv.") for n in arrays))],
                    [arrays[f"{prefix}ssm.{i}"] for i in range(
                        sum(n.startswith(f"{prefix}ssm.") for n in arrays))])

        conv, ssm = state("")
        image = LaneImage(tokens, arrays["k"], arrays["v"], conv or None, ssm or None)
        if "mtp.rows" in arrays:
            if version < 3:
                raise ValueError(f"MTP rows in a version {version} file")
            image.mtp_start, image.mtp_rows = mtp_start, arrays["mtp.rows"]
        checkpoints = []
        for j, (depth, roles) in enumerate(marks):
            cconv, cssm = state(f"ckpt{j}.")
            if not 0 < depth < tokens.size or not set(roles) <= set(READS[version]) or [
                    a.shape for a in cconv + cssm] != [a.shape for a in conv + ssm] or not conv:
                raise ValueError(f"checkpoint {j} (depth {depth}) does not fit the session")
            row = arrays.get(f"ckpt{j}.mtp")
            if row is not None and version < 3:
                raise ValueError(f"an MTP row in a version {version} file")
            checkpoints.append(ImageCheckpoint(depth, cconv, cssm, roles, row))
        if len(arrays) != 2 + len(conv) + len(ssm) + (image.mtp_rows is not None) + sum(
                len(c.conv) + len(c.ssm) + (c.mtp_row is not None) for c in checkpoints):
            raise ValueError("arrays the header does not account for")
        image.checkpoints = checkpoints or None
        if check is not None:
            check(image)
    except (KeyError, ValueError) as exc:
        raise SlotFileError(f"the arrays do not fit this runtime: {exc}") from None
    return image, len(MAGIC) + 4 + hlen + payload


def sweep_temporary_files(directory: str, older_than_s: float = 600.0) -> int:
    """Remove the temporary files of saves that never finished (a killed server) from
    ``directory``: hidden ``.NAME.tmp-*`` files not modified for ``older_than_s`` (a live
    save's file is newer). Returns how many went."""
    gone = 0
    now = time.time()
    for entry in os.scandir(directory):
        if entry.name.startswith(".") and TMP_MARK in entry.name and entry.is_file(
                follow_symlinks=False):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > older_than_s:
                    os.unlink(entry.path)
                    gone += 1
            except OSError:
                pass
    return gone
