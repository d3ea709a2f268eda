"""KV pages: the page pool (which pages are free) and the KV cache memory (what they hold).

Pool and memory are separate (policy vs storage): a ``PagePool`` hands out page ids; a
``KVCache`` holds, for every attention layer, K and V arrays indexed by those ids. Sequences
address their KV through block tables of page ids (see ``models/llama.ForwardBatch``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from . import kv_dtypes


class OutOfPages(Exception):
    """Not enough free pages for an allocation; nothing was allocated.

    Attributes:
        requested: pages asked for.
        free: pages free at the time.
    """

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"out of KV pages: requested {requested}, {free} free")
        self.requested = requested
        self.free = free


class PagePool:
    """Free list over page ids ``0 .. num_pages - 1``.

    Allocation is deterministic: lowest ids first from a fresh pool; freed pages are reused
    most-recently-freed first. Not thread-safe (owned by the execution thread).
    """

    __slots__ = ("num_pages", "_free", "_used")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() from the end
        self._used = bytearray(num_pages)  # 1 = allocated

    @property
    def num_free(self) -> int:
        """Pages available to ``allocate``."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages currently allocated."""
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages.

        Raises:
            ValueError: ``n < 0``.
            OutOfPages: fewer than ``n`` pages free (the pool is unchanged).
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; all are validated before any is freed.

        Raises:
            ValueError: a page id out of range, not allocated (double free), or listed twice.
        """
        pages = [int(p) for p in pages]
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not in this pool (0..{self.num_pages - 1})")
            if not self._used[p] or p in seen:
                raise ValueError(f"page {p} is not allocated (double free?)")
            seen.add(p)
        for p in pages:
            self._used[p] = 0
            self._free.append(p)

    def check_integrity(self) -> None:
        """Verify that the free list and the allocated set partition all pages.

        Raises:
            RuntimeError: a free page that is out of range, listed twice or also allocated, or
                a page that is neither free nor allocated.
        """
        seen = bytearray(self.num_pages)
        for p in self._free:
            if not 0 <= p < self.num_pages:
                raise RuntimeError(f"free list holds out-of-range page {p}")
            if seen[p]:
                raise RuntimeError(f"page {p} is on the free list twice")
            if self._used[p]:
                raise RuntimeError(f"page {p} is both free and allocated")
            seen[p] = 1
        lost = [p for p in range(self.num_pages) if not seen[p] and not self._used[p]]
        if lost:
            raise RuntimeError(f"pages neither free nor allocated: {lost[:10]}")


class KVCache:
    """Per-layer paged K and V storage, in one of the KV dtypes (``kv_dtypes.KV_DTYPES``).

    ``k[l]`` and ``v[l]`` have shape ``(num_pages, page_size, nkv, k_width / v_width)``; token
    slot ``page * page_size + offset``. Under ``fp32`` they are float32 and the width is ``hd``;
    under every other dtype they are uint8 and each (token, head) is one row of that dtype's
    codec: its codes, then its fp16 scales' bytes (``kv_codec.PartCodec.encode_rows``), the
    width being ``kv_dtypes.head_bytes``. The arrays are allocated once (zero-filled) by
    ``zeros`` (a backend's ``ops.zeros``; NumPy by default) and written by ``ops.write_kv``
    with ``kv_dtype=cache.dtype``; pages are copied as stored (images, slot files), never
    re-encoded.

    Raises (constructor):
        ValueError: a size <= 0, an unknown dtype or one ``hd`` does not fit.
    """

    __slots__ = ("num_layers", "num_pages", "page_size", "nkv", "hd", "dtype", "k_width",
                 "v_width", "k", "v")

    def __init__(self, num_layers: int, num_pages: int, page_size: int, nkv: int, hd: int,
                 zeros: Callable[..., object] | None = None, dtype: str = "fp32") -> None:
        for name, val in (("num_layers", num_layers), ("num_pages", num_pages),
                          ("page_size", page_size), ("nkv", nkv), ("hd", hd)):
            if val <= 0:
                raise ValueError(f"{name} must be > 0, got {val}")
        kb, vb = kv_dtypes.head_bytes(dtype, hd)   # (ValueError for a dtype that cannot be)
        zeros = zeros or np.zeros
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.nkv, self.hd, self.dtype = nkv, hd, dtype
        self.k_width, self.v_width = (hd, hd) if dtype == "fp32" else (kb, vb)
        store = self.store_dtype
        self.k = [zeros((num_pages, page_size, nkv, self.k_width), dtype=store)
                  for _ in range(num_layers)]
        self.v = [zeros((num_pages, page_size, nkv, self.v_width), dtype=store)
                  for _ in range(num_layers)]

    @property
    def store_dtype(self) -> np.dtype:
        """The arrays' element type: float32 under ``fp32``, else uint8 (codec rows)."""
        return np.dtype(np.float32 if self.dtype == "fp32" else np.uint8)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes one token takes over all layers (``kv_dtypes.bytes_per_token``)."""
        return kv_dtypes.bytes_per_token(self.dtype, self.num_layers, self.nkv, self.hd)

    @property
    def nbytes(self) -> int:
        """Total bytes of all K and V arrays."""
        return self.bytes_per_token * self.num_pages * self.page_size
