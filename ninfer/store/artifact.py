"""The ``.ninfer`` model container: writer, memory-mapped reader, SHA-256 identity.

File layout (all integers little-endian)::

    b"NINFER\\0\\0"                     8 bytes of magic
    u64 header_len                      length of the JSON header in bytes
    header_len bytes of UTF-8 JSON      padded with spaces so the data start is 64-byte aligned
    tensor payloads                     each part starts on a 64-byte boundary

Header::

    {"format_version": 1, "architecture": "llama", "config": {...}, "tokenizer": {...},
     "chat_template": str | null, "source": {...}, "data_size": int,
     "tensors": {name: {"scheme", "shape", "group",
                        "parts": {part: {"dtype", "shape", "offset", "nbytes"}}}}}

Part offsets are relative to the data start. ``data_size`` (total payload bytes) lets a truncated
file be told apart from a corrupt tensor directory; readers accept headers without it.

Identity is the SHA-256 of the whole file. It is cached in a sidecar ``<file>.sha256`` (JSON with
``size``, ``mtime_ns`` and ``sha256``); the sidecar is never authoritative: when the file's size
or mtime differ from the sidecar's, the hash is recomputed and the sidecar rewritten.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.store.atomic import atomic_file
from ninfer.store.quant import SCHEMES, QuantTensor

MAGIC = b"NINFER\0\0"
FORMAT_VERSION = 1
ALIGN = 64
SUPPORTED_ARCHITECTURES = ("llama", "qwen35")
SIDECAR_SUFFIX = ".sha256"

_PART_DTYPES = {
    # scheme -> part -> allowed little-endian dtype
    "f32": {"data": "float32"},
    "f16": {"data": "float16"},
    "bf16": {"data": "uint16"},
    "q8": {"codes": "int8", "scales": "float16"},
    "q4": {"codes": "uint8", "scales": "float16", "mins": "float16"},
}
_ALLOWED_DTYPES = frozenset(d for parts in _PART_DTYPES.values() for d in parts.values())
_REQUIRED_PARTS = {"f32": {"data"}, "f16": {"data"}, "bf16": {"data"},
                   "q8": {"codes", "scales"}, "q4": {"codes", "scales"}}
_HASH_CHUNK = 1 << 22


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_current_umask()  # what open() would give a new file


class ArtifactError(Exception):
    """A model file cannot be used; the message names the file and what is wrong."""


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# --------------------------------------------------------------------------------------------
# SHA-256 identity with sidecar cache
# --------------------------------------------------------------------------------------------

def sidecar_path(path: str | os.PathLike) -> Path:
    """Path of the SHA-256 sidecar of ``path`` (``<file>.sha256``)."""
    p = Path(path)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def _read_sidecar(path: Path, size: int, mtime_ns: int) -> str | None:
    try:
        d = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    sha = d.get("sha256")
    if (d.get("size") == size and d.get("mtime_ns") == mtime_ns and isinstance(sha, str)
            and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        return sha
    return None


def _write_sidecar(path: Path, size: int, mtime_ns: int, sha: str) -> None:
    """Best effort: an unwritable directory just means no cache."""
    side = sidecar_path(path)
    try:
        with atomic_file(side, prefix=side.name + ".", suffix=".tmp", mode=_FILE_MODE) as f:
            f.write(json.dumps({"size": size, "mtime_ns": mtime_ns, "sha256": sha}).encode())
    except OSError:
        pass


def _hash_fileobj(f) -> str:
    h = hashlib.sha256()
    while True:
        chunk = f.read(_HASH_CHUNK)
        if not chunk:
            break
        h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of the whole file at ``path``, using/refreshing the sidecar cache.

    The sidecar is used only when its ``size`` and ``mtime_ns`` equal the file's current ones;
    otherwise the file is hashed and the sidecar rewritten (best effort).

    Raises:
        ArtifactError: the file cannot be read.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            cached = _read_sidecar(p, st.st_size, st.st_mtime_ns)
            if cached is not None:
                return cached
            sha = _hash_fileobj(f)
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read file: {e.strerror or e}") from e
    _store_if_unchanged(p, st, sha)
    return sha


def _store_if_unchanged(p: Path, st: os.stat_result, sha: str) -> None:
    try:
        now = os.stat(p)
    except OSError:
        return
    if (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
        _write_sidecar(p, st.st_size, st.st_mtime_ns, sha)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------

def _le(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def _tensor_problem(name: str, t: QuantTensor, parts: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """Why the parts (name -> (dtype, shape)) do not form a valid tensor of ``t``'s kind."""
    scheme, shape, group = t.scheme, tuple(t.shape), t.group
    if scheme not in SCHEMES:
        return f"tensor {name!r} has unknown scheme {scheme!r}"
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        return f"tensor {name!r} has invalid shape {list(shape)}"
    allowed = _PART_DTYPES[scheme]
    missing = _REQUIRED_PARTS[scheme] - set(parts)
    extra = set(parts) - set(allowed)
    if missing or extra:
        return (f"tensor {name!r} ({scheme}) has parts {sorted(parts)}, "
                f"expected {sorted(_REQUIRED_PARTS[scheme])}")
    for part, (dtype, _) in parts.items():
        if dtype != allowed[part]:
            return f"tensor {name!r} part {part!r} has dtype {dtype}, expected {allowed[part]}"
    if scheme in ("f32", "f16", "bf16"):
        if parts["data"][1] != shape:
            return f"tensor {name!r} data shape {list(parts['data'][1])} != {list(shape)}"
        return None
    if len(shape) != 2 or not isinstance(group, int) or group <= 0:
        return f"tensor {name!r} ({scheme}) needs a 2-D shape and group > 0"
    n, k = shape
    if k % group or (scheme == "q4" and (k % 2 or group % 2)):
        return f"tensor {name!r} ({scheme}) K={k} is not a multiple of group {group}"
    want = {"codes": (n, k) if scheme == "q8" else (n, k // 2),
            "scales": (n, k // group), "mins": (n, k // group)}
    for part, (_, pshape) in parts.items():
        if pshape != want[part]:
            return f"tensor {name!r} part {part!r} shape {list(pshape)} != {list(want[part])}"
    return None


def write_artifact(path: str | os.PathLike, header: dict[str, Any],
                   tensors: dict[str, QuantTensor]) -> str:
    """Write a ``.ninfer`` file atomically and return its SHA-256 hex digest.

    Args:
        path: destination; written to a temp file in the same folder, then renamed over it.
        header: ``architecture``, ``config``, ``tokenizer``, ``chat_template``, ``source`` (any
            extra JSON-serialisable keys are kept). ``format_version``, ``tensors`` and
            ``data_size`` are filled in here.
        tensors: name -> QuantTensor; payloads are stored little-endian, 64-byte aligned.

    The SHA-256 sidecar is written too.

    Raises:
        ArtifactError: a tensor is malformed, or the header is not JSON-serialisable.
        OSError: the file cannot be written.
    """
    path = Path(path)
    directory: dict[str, Any] = {}
    layout: list[tuple[int, np.ndarray]] = []
    offset = 0
    for name, t in tensors.items():
        arrays = {p: _le(a) for p, a in t.parts().items()}
        desc = {p: (a.dtype.name, tuple(a.shape)) for p, a in arrays.items()}
        problem = _tensor_problem(name, t, desc)
        if problem:
            raise ArtifactError(f"{path}: cannot write: {problem}")
        parts = {}
        for p, a in arrays.items():
            offset = _align(offset)
            parts[p] = {"dtype": a.dtype.name, "shape": list(a.shape), "offset": offset,
                        "nbytes": int(a.nbytes)}
            layout.append((offset, a))
            offset += int(a.nbytes)
        directory[name] = {"scheme": t.scheme, "shape": [int(d) for d in t.shape],
                           "group": int(t.group), "parts": parts}
    full = {"format_version": FORMAT_VERSION}
    full.update({k: v for k, v in header.items() if k not in ("format_version", "tensors", "data_size")})
    full.setdefault("chat_template", None)
    full["data_size"] = offset
    full["tensors"] = directory
    try:
        blob = json.dumps(full, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: cannot write: header is not JSON-serialisable: {e}") from e
    data_start = _align(len(MAGIC) + 8 + len(blob))
    blob += b" " * (data_start - len(MAGIC) - 8 - len(blob))

    h = hashlib.sha256()
    with atomic_file(path, prefix=path.name + ".", suffix=".tmp", mode=_FILE_MODE) as f:
        def put(b) -> None:
            h.update(b)
            f.write(b)
        put(MAGIC)
        put(len(blob).to_bytes(8, "little"))
        put(blob)
        pos = 0
        for off, a in layout:
            if off > pos:
                put(b"\0" * (off - pos))
            put(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
            pos = off + a.nbytes
    sha = h.hexdigest()
    st = os.stat(path)
    _write_sidecar(path, st.st_size, st.st_mtime_ns, sha)
    return sha


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------

class Artifact:
    """An opened model: header fields plus tensors (memory-mapped views for ``.ninfer`` files).

    Attributes:
        path: the file it came from (a ``.ninfer`` or, via ``load_model_file``, a ``.gguf``).
        header: the full header dict.
        architecture / config / tokenizer / chat_template: header fields.
        tensors: name -> QuantTensor; arrays are read-only views of the mapped file.
        size_bytes: size of the file in bytes.
        file_format: "ninfer" or "gguf" (a GGUF converted in memory).
        sha256: SHA-256 hex digest of the file (computed lazily, sidecar cached).
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any],
                 tensors: dict[str, QuantTensor], size_bytes: int,
                 stat_key: tuple[int, int, int] | None = None, mapping: Any = None,
                 sha256: str | None = None, file_format: str = "ninfer"):
        self.path = Path(path)
        self.file_format = file_format
        self.header = header
        self.tensors = tensors
        self.size_bytes = int(size_bytes)
        self._stat_key = stat_key
        self._mapping = mapping
        self._sha256 = sha256

    @property
    def architecture(self) -> str:
        return self.header["architecture"]

    @property
    def config(self) -> dict[str, Any]:
        return self.header["config"]

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.header["tokenizer"]

    @property
    def chat_template(self) -> str | None:
        return self.header.get("chat_template")

    @property
    def sha256(self) -> str:
        """SHA-256 hex digest of the file, from a fresh sidecar or recomputed.

        For a ``.ninfer`` opened with ``Artifact.open`` the hash is taken over the mapped bytes
        (the content actually in use), even if the path was replaced since.
        """
        if self._sha256 is None:
            if self._mapping is not None and self._stat_key is not None:
                size, mtime_ns, ino = self._stat_key
                sha = _read_sidecar(self.path, size, mtime_ns)
                if sha is None:
                    sha = hashlib.sha256(self._mapping).hexdigest()
                    try:
                        now = os.stat(self.path)
                        if (now.st_size, now.st_mtime_ns, now.st_ino) == (size, mtime_ns, ino):
                            _write_sidecar(self.path, size, mtime_ns, sha)
                    except OSError:
                        pass
                self._sha256 = sha
            else:
                self._sha256 = file_sha256(self.path)
        return self._sha256

    def __repr__(self) -> str:
        return (f"Artifact({str(self.path)!r}, architecture={self.header.get('architecture')!r}, "
                f"tensors={len(self.tensors)})")

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Artifact":
        """Memory-map a ``.ninfer`` file and validate its header and tensor directory.

        Raises:
            ArtifactError: missing/unreadable file, truncated, wrong magic, corrupt header,
                unsupported format version, unknown architecture, malformed tensor entry or
                tensor out of bounds. The message starts with the path.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                if size < len(MAGIC) + 8:
                    head = f.read(len(MAGIC))
                    if not head:
                        raise ArtifactError(f"{path}: empty file, not a .ninfer file")
                    if not MAGIC.startswith(head[:len(MAGIC)]):
                        raise ArtifactError(f"{path}: wrong magic {head!r}, not a .ninfer file")
                    raise ArtifactError(f"{path}: truncated ({size} bytes, shorter than the "
                                        f"{len(MAGIC) + 8}-byte preamble)")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ArtifactError(f"{path}: cannot open: {e.strerror or e}") from e
        try:
            header, data_start = _parse_header(path, mm, size)
            tensors = _map_tensors(path, mm, header, data_start, size)
        except BaseException:
            try:
                mm.close()
            except BufferError:  # views created before the error still reference the map
                pass
            raise
        return cls(path, header, tensors, size, (st.st_size, st.st_mtime_ns, st.st_ino), mm)


def _parse_header(path: Path, mm, size: int) -> tuple[dict[str, Any], int]:
    magic = bytes(mm[:len(MAGIC)])
    if magic != MAGIC:
        what = " (this is a GGUF file; use load_model_file)" if magic[:4] == b"GGUF" else ""
        raise ArtifactError(f"{path}: wrong magic {magic!r}, not a .ninfer file{what}")
    hlen = int.from_bytes(mm[len(MAGIC):len(MAGIC) + 8], "little")
    data_start = len(MAGIC) + 8 + hlen
    if data_start > size:
        raise ArtifactError(f"{path}: truncated (header of {hlen} bytes does not fit in a "
                            f"{size}-byte file)")
    try:
        header = json.loads(bytes(mm[len(MAGIC) + 8:data_start]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: corrupt header (invalid JSON: {e})") from e
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: corrupt header (not a JSON object)")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: unsupported format_version {version!r} "
                            f"(this ninfer reads version {FORMAT_VERSION})")
    for key, typ in (("architecture", str), ("config", dict), ("tokenizer", dict),
                     ("tensors", dict)):
        if not isinstance(header.get(key), typ):
            raise ArtifactError(f"{path}: corrupt header (missing or invalid {key!r})")
    if header.get("chat_template") is not None and not isinstance(header["chat_template"], str):
        raise ArtifactError(f"{path}: corrupt header (chat_template is not a string)")
    check_architecture(path, header["architecture"])
    data_size = header.get("data_size")
    if data_size is not None:
        if not isinstance(data_size, int) or data_size < 0:
            raise ArtifactError(f"{path}: corrupt header (invalid data_size {data_size!r})")
        if data_start + data_size > size:
            raise ArtifactError(f"{path}: truncated (expected {data_start + data_size} bytes, "
                                f"file has {size})")
    return header, data_start


def check_architecture(path: str | os.PathLike, architecture: str) -> None:
    """Raise ArtifactError (naming ``path``) unless ``architecture`` is supported."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(f"{path}: unknown architecture {architecture!r} "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _map_tensors(path: Path, mm, header: dict[str, Any], data_start: int,
                 size: int) -> dict[str, QuantTensor]:
    data_size = header.get("data_size", size - data_start)
    out: dict[str, QuantTensor] = {}
    for name, entry in header["tensors"].items():
        bad = f"{path}: corrupt header (tensor {name!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("parts"), dict):
            raise ArtifactError(f"{bad} entry is malformed)")
        scheme, shape, group = entry.get("scheme"), entry.get("shape"), entry.get("group", 0)
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(group, int)):
            raise ArtifactError(f"{bad} has an invalid shape or group)")
        arrays: dict[str, np.ndarray] = {}
        for part, pd in entry["parts"].items():
            try:
                if pd["dtype"] not in _ALLOWED_DTYPES:
                    raise ValueError(f"dtype {pd['dtype']!r} is not allowed")
                dtype = np.dtype(pd["dtype"]).newbyteorder("<")
                pshape = tuple(pd["shape"])
                off, nbytes = pd["offset"], pd["nbytes"]
                if (not all(isinstance(d, int) and d >= 0 for d in pshape)
                        or not isinstance(off, int) or not isinstance(nbytes, int)
                        or off < 0 or nbytes < 0):
                    raise ValueError("negative or non-integer field")
            except (KeyError, TypeError, ValueError) as e:
                raise ArtifactError(f"{bad} part {part!r} is malformed: {e})") from e
            count = math.prod(pshape)
            if count * dtype.itemsize != nbytes:
                raise ArtifactError(f"{bad} part {part!r}: nbytes {nbytes} does not match "
                                    f"shape {list(pshape)} of {dtype.name})")
            if off + nbytes > data_size or data_start + off + nbytes > size:
                raise ArtifactError(f"{path}: tensor {name!r} part {part!r} out of bounds "
                                    f"(offset {off} + {nbytes} bytes > data size {data_size})")
            a = np.frombuffer(mm, dtype=dtype, count=count, offset=data_start + off)
            arrays[part] = a.reshape(pshape)
        t = QuantTensor(scheme, tuple(shape), group=group, **arrays)
        problem = _tensor_problem(name, t, {p: (a.dtype.name, a.shape) for p, a in arrays.items()})
        if problem:
            raise ArtifactError(f"{path}: corrupt header ({problem})")
        out[name] = t
    return out


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

def load_model_file(path: str | os.PathLike) -> Artifact:
    """Open a model file, detected by its magic bytes (not its extension).

    ``.ninfer`` files are memory-mapped (``Artifact.open``). GGUF files are converted in memory
    with ``gguf_import.import_gguf``; the returned Artifact's ``sha256`` and ``size_bytes`` are
    the GGUF file's. A directory is read as a HuggingFace Qwen3.5 / Qwen3-Next checkpoint
    folder (``hf_import.load_folder``, source precision, ``file_format`` "hf").

    Raises:
        ArtifactError: unreadable file, unknown magic, or any problem ``Artifact.open`` /
            ``import_gguf`` reports.
    """
    path = Path(path)
    if path.is_dir():
        from ninfer.store.hf_import import load_folder
        return load_folder(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ArtifactError(f"{path}: cannot open: {e.strerror or e}") from e
    if magic == MAGIC:
        return Artifact.open(path)
    if magic[:4] == b"GGUF":
        from ninfer.store.gguf_import import import_gguf
        header, tensors = import_gguf(path)
        return Artifact(path, header, tensors, size, file_format="gguf")
    if not magic:
        raise ArtifactError(f"{path}: empty file, not a model")
    raise ArtifactError(f"{path}: wrong magic {magic!r}: neither a .ninfer nor a GGUF file")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def describe(path: str | os.PathLike) -> str:
    """Human-readable summary of a model file for ``ninfer info`` (multi-line string).

    Lists the architecture, config values, tensor count, a histogram of weight schemes, payload
    and file bytes, SHA-256, tokenizer vocabulary size and whether a chat template is present.

    Raises:
        ArtifactError: as ``load_model_file``.
    """
    art = load_model_file(path)
    schemes = Counter(t.scheme for t in art.tensors.values())
    payload = sum(t.nbytes for t in art.tensors.values())
    params = sum(math.prod(t.shape) for t in art.tensors.values())
    tok = art.tokenizer or {}
    fmt = "GGUF (converted in memory)" if art.file_format == "gguf" else ".ninfer"
    lines = [
        f"file:          {art.path}",
        f"format:        {fmt}",
        f"architecture:  {art.architecture}",
        "config:",
    ]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in art.config.items()
              if not (k == "rope_scaling" and isinstance(v, dict) and len(json.dumps(v)) > 200)]
    lines += [
        f"tensors:       {len(art.tensors)} ({params:,} parameters)",
        "schemes:       " + ", ".join(f"{s}: {n}" for s, n in sorted(schemes.items())),
        f"tensor bytes:  {payload:,} ({_fmt_bytes(payload)})",
        f"file bytes:    {art.size_bytes:,} ({_fmt_bytes(art.size_bytes)})",
        f"sha256:        {art.sha256}",
        f"tokenizer:     {tok.get('model')}/{tok.get('pre')}, {len(tok.get('tokens') or [])} tokens, "
        f"bos={tok.get('bos_token_id')} eos={tok.get('eos_token_id')}",
        f"chat template: {'yes' if art.chat_template else 'no'}",
    ]
    return "\n".join(lines)
