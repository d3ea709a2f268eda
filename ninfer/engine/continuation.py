"""Continuation images and the host tier (L2) of the continuation cache (serving contract §4).

A ``LaneImage`` is a lane's computed prefix copied out of the paged KV cache: the token ledger,
every attention layer's K and V for those positions and, on hybrid models, the recurrent state
(conv inputs and GDN state) at exactly that frontier. It is pointer-free (no page ids), so it
can be imported into any lane, at any page placement.

``HostTier`` (L2) keeps images in host memory under a byte budget, least recently used first
out. When a retained lane is about to lose its prefix (another request takes the lane or cuts
it back), the engine demotes the prefix here; a later request whose prompt starts with it is
restored from here into a lane instead of prefilling it again.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import kv_dtypes


class ImageCheckpoint(NamedTuple):
    """A hybrid lane's rewind point inside an image: the recurrent state (per GDN layer,
    ``conv`` / ``ssm`` host arrays) at ``depth`` (``0 < depth < n``), the ``roles`` it plays
    for the lane, a subset of ``("turn", "anchor", "ring")`` (``checkpoints.py``), and on a
    speculative lane ``mtp_row``: the main model's ``(1, H)`` float32 hidden row at
    ``depth - 1`` (``Checkpoint.mtp_row``; None: it serves no speculative request)."""
    depth: int
    conv: list
    ssm: list
    roles: tuple
    mtp_row: np.ndarray | None = None


@dataclass(slots=True)
class LaneImage:
    """A lane's computed prefix, on the host.

    Attributes:
        tokens: ``(n,)`` int32 ledger (the tokens whose K/V and state the image holds).
        k, v: ``(layers, n, nkv, width)`` attention K and V as the cache stores them (every
            attention layer, in cache order): float32 heads (``fp32``, width ``hd``) or uint8
            codec rows (other KV dtypes, ``KVCache.k_width`` / ``v_width``), bit for bit.
        conv, ssm: hybrid models: per GDN layer, the slot's ``(Kc - 1, conv_dim)`` and
            ``(Hv, dk, dv)`` float32 state after exactly ``n`` tokens; None otherwise.
        checkpoints: hybrid lanes: the lane's rewind points below ``n`` (``ImageCheckpoint``,
            shallowest first) in slot files, and in L2 / L3 images with the turn-checkpoint
            ring on (the image then also restores at each of them); None otherwise.
        mtp_start, mtp_rows: a speculative lane's (``--spec mtp``) pending MTP rows: the main
            model's final-normed hidden states ``(n - mtp_start, H)`` float32 of positions
            ``mtp_start .. n - 1``, which the MTP head's KV (the cache's last layer, in ``k`` /
            ``v`` up to ``mtp_start``) has not seen yet; a speculative request resumes the
            image at its frontier only with them. None: the head's KV is not this ledger's.
    """
    tokens: np.ndarray
    k: np.ndarray
    v: np.ndarray
    conv: list | None = None
    ssm: list | None = None
    checkpoints: list[ImageCheckpoint] | None = None
    mtp_start: int = 0
    mtp_rows: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.conv or []) + (self.ssm or []))
        extra += self.mtp_rows.nbytes if self.mtp_rows is not None else 0
        extra += sum(a.nbytes for c in self.checkpoints or () for a in list(c.conv) + list(c.ssm)
                     + ([c.mtp_row] if c.mtp_row is not None else []))
        return self.tokens.nbytes + self.k.nbytes + self.v.nbytes + extra

    @property
    def marks(self) -> tuple:
        """The depths this image restores at below its frontier (its checkpoints')."""
        return tuple(c.depth for c in self.checkpoints or ())

    @property
    def mtp_marks(self) -> tuple:
        """The depths a speculative request resumes this image at: its checkpoints' with an
        MTP row, and its frontier with MTP rows."""
        return tuple(c.depth for c in self.checkpoints or () if c.mtp_row is not None) + \
            ((self.n,) if self.mtp_rows is not None else ())

    @property
    def key(self) -> str:
        """Content address: SHA-256 of the little-endian int32 ledger (hex)."""
        return image_key(self.tokens)


def image_key(tokens) -> str:
    """``LaneImage.key`` of an image whose ledger is ``tokens`` (hex SHA-256 of the
    little-endian int32 ids)."""
    return hashlib.sha256(np.asarray(tokens).astype("<i4").tobytes()).hexdigest()


def reusable_depth(ledger: np.ndarray, prompt: np.ndarray, limit: int, exact: bool) -> int:
    """Prompt tokens a held prefix saves recomputing: the common prefix of ``ledger`` and
    ``prompt`` capped at ``limit``; with ``exact`` (recurrent state, which cannot be cut back)
    the whole ledger or nothing.

    Args:
        ledger: ``(n,)`` integer token ids held.
        prompt: ``(P,)`` integer token ids of the request.
        limit: most tokens that may be reused (``P - 1``: the last one is always computed).
    """
    n = int(ledger.shape[0])
    if exact and n > limit:
        return 0
    m = min(n, limit)
    diff = np.flatnonzero(ledger[:m] != prompt[:m])
    common = int(diff[0]) if diff.size else m
    if exact:
        return n if common == n else 0
    return common


def resume_depth(ledger: np.ndarray, marks, prompt: np.ndarray, limit: int) -> int:
    """``reusable_depth`` of a hybrid image (``exact``) that also restores at its checkpoints'
    depths ``marks``: its whole ledger, else the deepest mark inside the common prefix."""
    d = reusable_depth(ledger, prompt, limit, True)
    if d or not marks:
        return d
    common = reusable_depth(ledger, prompt, limit, False)
    return max((m for m in marks if m <= common), default=0)


def best_resume(items, prompt: np.ndarray, limit: int) -> tuple[object, int]:
    """``(item, depth)`` of the ``(item, ledger, depths)`` triples reusing the most of
    ``prompt``: the deepest of an item's ``depths`` (where it can be resumed) inside the prefix
    its ledger shares with the prompt (at most ``limit`` tokens); ``(None, 0)``: none."""
    best, depth = None, 0
    for item, ledger, depths in items:
        if max(depths, default=0) <= depth:
            continue  # cannot beat the best so far
        common = reusable_depth(ledger, prompt, limit, False)
        d = max((m for m in depths if m <= common), default=0)
        if d > depth:
            best, depth = item, d
    return best, depth


def best_prefix(ledgers, prompt: np.ndarray, limit: int, exact: bool,
                marks=None) -> tuple[object, int]:
    """``(item, depth)`` of the ``(item, ledger)`` pair reusing the most of ``prompt``
    (``reusable_depth``; with ``exact``, ``marks(item)``: its checkpoint depths, as
    ``resume_depth``), or ``(None, 0)``."""
    best, depth = None, 0
    for item, ledger in ledgers:
        if min(int(ledger.shape[0]), limit) <= depth:
            continue  # cannot beat the best so far
        if exact and marks is not None:
            d = resume_depth(ledger, marks(item), prompt, limit)
        else:
            d = reusable_depth(ledger, prompt, limit, exact)
        if d > depth:
            best, depth = item, d
    return best, depth


def _paged(cache):
    """The paged ``KVCache`` of an engine cache (a hybrid cache wraps one)."""
    return getattr(cache, "kv", cache) if hasattr(cache, "conv") else cache


def _on_device(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def _module(a):
    """numpy, or cupy for a device array."""
    if _on_device(a):
        import cupy
        return cupy
    return np


def _index(a, idx: np.ndarray):
    """``idx`` as an index array of ``a``'s module (a device array takes a device index)."""
    if _on_device(a):
        import cupy
        return cupy.asarray(idx)
    return idx


def device_like(cache, host: np.ndarray):
    """``host`` as an array of ``cache``'s backend (a device copy where its KV is on one)."""
    ref = _paged(cache).k[0]
    if _on_device(ref):
        import cupy
        return cupy.asarray(host)
    return host


# An image's K / V rows come from a pinned pool of their own whose blocks are
# PINNED_LADDER-spaced sizes (a freed block serves the next image of a similar length) and which
# keeps at most PINNED_FREE_BLOCKS free: CuPy's default pool keeps every freed block for its exact
# size forever, so a server's images of ever-new lengths would pin ever more host memory.
PINNED_LADDER, PINNED_FREE_BLOCKS = 2 ** 0.25, 8


def pinned_block_bytes(nbytes: int) -> int:
    """The pool block an image array of ``nbytes`` takes: the next rung of a ladder of sizes
    ``PINNED_LADDER`` apart (at most ~19 % over), in 512-byte units (cudaHostAlloc's)."""
    if nbytes <= 512:
        return 512
    rung = PINNED_LADDER ** math.ceil(math.log(nbytes, PINNED_LADDER) - 1e-9)
    return -(-max(nbytes, math.ceil(rung)) // 512) * 512


@functools.lru_cache(maxsize=1)
def _image_pool():
    import cupy
    return cupy.cuda.PinnedMemoryPool()


def _host_empty(device: bool, shape, dtype, own_pool: bool = False) -> np.ndarray:
    """An uninitialised host array for copies out of the device: pinned (page-locked) where
    ``device``, so that the copy is one DMA at the bus's rate and a reused block takes no page
    faults (``own_pool``: from the images' laddered pool, for arrays whose size varies, else
    CuPy's, for fixed sizes); else, or when no pinned memory can be had (the host's
    page-locking limit), plain numpy."""
    if device:
        import cupy
        import cupyx
        try:
            if not own_pool:
                return cupyx.empty_pinned(shape, dtype)
            pool = _image_pool()
            if pool.n_free_blocks() > PINNED_FREE_BLOCKS:
                pool.free_all_blocks()   # (unpinned once no array uses them)
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            return np.ndarray(shape, dtype, buffer=pool.malloc(pinned_block_bytes(nbytes)))
        except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError):
            pass
    return np.empty(shape, dtype)


def _download(a, out: np.ndarray) -> np.ndarray:
    """Copy host or device array ``a`` into host ``out`` (same shape; C-contiguous)."""
    if _on_device(a):
        a.get(out=out)
    else:
        out[...] = a
    return out


def _upload(dst, index, host: np.ndarray) -> None:
    """``dst[index] = host`` for a host or device array ``dst``."""
    if _on_device(dst):
        import cupy
        host = cupy.asarray(host)
        if isinstance(index, np.ndarray):
            index = cupy.asarray(index)
    dst[index] = host


def export_lane(cache, pages: list, n: int, tokens, slot: int | None) -> LaneImage:
    """Copy a lane's first ``n`` positions (held in ``pages``) out of ``cache``.

    Args:
        cache: the engine's cache (``KVCache``, or a hybrid cache with ``kv``, ``conv``,
            ``ssm``, ``lengths``).
        pages: the lane's block table, at least ``ceil(n / page_size)`` pages.
        n: positions to copy (> 0).
        tokens: the lane's ledger (at least ``n`` ids).
        slot: the lane's state slot (hybrid models; its frontier must be ``n``).

    Raises:
        ValueError: too few pages or tokens, or a hybrid slot not at frontier ``n``.
    """
    kv = _paged(cache)
    need = math.ceil(n / kv.page_size)
    if n <= 0 or len(pages) < need or len(tokens) < n:
        raise ValueError(f"cannot export {n} positions from {len(pages)} pages and "
                         f"{len(tokens)} tokens")
    idx = np.asarray(pages[:need], dtype=np.int64)
    rows = need * kv.page_size

    def gather(arrays: list, width: int) -> np.ndarray:
        """Every layer's first n rows of the lane's pages, straight into one host array."""
        out = _host_empty(_on_device(arrays[0]), (len(arrays), n, kv.nkv, width),
                          np.dtype(arrays[0].dtype), own_pool=True)
        for layer, a in enumerate(arrays):
            _download(a[_index(a, idx)].reshape(rows, kv.nkv, width)[:n], out[layer])
        return out

    k, v = gather(kv.k, kv.k_width), gather(kv.v, kv.v_width)
    conv, ssm = export_state(cache, slot, n) if kv is not cache else (None, None)
    return LaneImage(np.asarray(tokens[:n], dtype=np.int32), k, v, conv, ssm)


def kv_image_bytes(cache, n: int) -> int:
    """The ledger and K / V bytes of an ``n``-position image of ``cache`` (a lower bound of
    ``LaneImage.nbytes``: a hybrid image adds its recurrent states), known before any copy."""
    kv = _paged(cache)
    row = sum(a.shape[2] * a.shape[3] * a.dtype.itemsize for a in kv.k + kv.v)
    return n * (4 + row)


def import_lane(cache, image: LaneImage, depth: int, pages: list, slot: int | None) -> None:
    """Write ``image``'s first ``depth`` positions into ``pages`` of ``cache`` (and, on hybrid
    models, its recurrent state into ``slot``, whose frontier becomes ``depth``: the image's
    own, or a checkpoint's at exactly that depth).

    Raises:
        ValueError: too few pages; ``depth`` outside ``1 .. image.n``; a hybrid import neither
            at the image's exact frontier nor at one of its checkpoints (recurrent state cannot
            be cut back).
    """
    kv = _paged(cache)
    need = math.ceil(depth / kv.page_size)
    if not 0 < depth <= image.n or len(pages) < need:
        raise ValueError(f"cannot import {depth} of {image.n} positions into "
                         f"{len(pages)} pages")
    conv, ssm = image.conv, image.ssm
    if kv is not cache and depth != image.n:
        mark = next((c for c in image.checkpoints or () if c.depth == depth), None)
        if mark is None:
            raise ValueError("a hybrid image restores only at its exact frontier or a "
                             "checkpoint")
        conv, ssm = mark.conv, mark.ssm
    idx = np.asarray(pages[:need], dtype=np.int64)
    pad = need * kv.page_size - depth
    for dst, src in ((kv.k, image.k), (kv.v, image.v)):
        for layer, a in enumerate(dst):
            xp = _module(a)
            block = xp.asarray(src[layer, :depth])   # (one copy to the device, if any)
            if pad:   # (padded where the block lives: no host copy of the whole block)
                block = xp.concatenate([block, xp.zeros((pad,) + block.shape[1:],
                                                        dtype=block.dtype)])
            a[_index(a, idx)] = block.reshape(need, kv.page_size, kv.nkv, block.shape[-1])
    if kv is not cache:
        restore_state(cache, slot, conv, ssm, depth)


def export_state(cache, slot: int, n: int) -> tuple[list, list]:
    """Host copies of a hybrid lane's conv and recurrent state (``slot``, at frontier ``n``):
    per GDN layer ``(Kc - 1, conv_dim)`` and ``(Hv, dk, dv)`` float32.

    Raises:
        ValueError: the slot is not at frontier ``n``.
    """
    if int(cache.lengths[slot]) != n:
        raise ValueError(f"slot {slot} is at {int(cache.lengths[slot])} tokens, not {n}")
    def own(a):   # a host copy of the slot's row (pinned from the device)
        return _download(a[slot], _host_empty(_on_device(a), a.shape[1:], np.dtype(a.dtype)))

    return [own(a) for a in cache.conv], [own(a) for a in cache.ssm]


def restore_state(cache, slot: int, conv: list, ssm: list, n: int) -> None:
    """Write ``export_state``'s arrays back into ``slot``, whose frontier becomes ``n``."""
    for dst, src in ((cache.conv, conv), (cache.ssm, ssm)):
        for a, s in zip(dst, src):
            _upload(a, slot, s)
    cache.lengths[slot] = n


def check_layout(layout: dict, image: LaneImage) -> None:
    """Raise ValueError unless ``image``'s arrays have the shapes and dtypes ``layout``
    (``Engine.layout_identity``) gives for ``image.n`` tokens (K/V rows of its ``kv_dtype``)."""
    n = image.n
    dtype, hd = layout.get("kv_dtype", "fp32"), layout.get("hd")
    if dtype not in kv_dtypes.KV_DTYPES or not isinstance(hd, (int, np.integer)) or hd <= 0:
        raise ValueError(f"layout with KV dtype {dtype!r} and head dim {hd!r}")
    widths = (hd, hd) if dtype == "fp32" else kv_dtypes.head_bytes(dtype, hd)
    want_k, want_v = ((layout.get("kv_layers"), n, layout.get("nkv"), w) for w in widths)
    if image.k.shape != want_k or image.v.shape != want_v:
        raise ValueError(f"K/V shapes {image.k.shape} {image.v.shape}, want {want_k} {want_v}")
    store = np.float32 if dtype == "fp32" else np.uint8
    if image.k.dtype != store or image.v.dtype != store:
        raise ValueError(f"{dtype} K/V must be {np.dtype(store)} arrays")
    if any(a.dtype != np.float32 for a in list(image.conv or []) + list(image.ssm or [])):
        raise ValueError("recurrent state arrays must be float32")
    if bool(layout.get("recurrent")) != (image.conv is not None):
        raise ValueError("recurrent state present/absent against the layout")
    if image.conv is not None:
        if [list(a.shape) for a in image.conv] != layout.get("conv") or \
                [list(a.shape) for a in image.ssm] != layout.get("ssm"):
            raise ValueError("recurrent state shapes differ from the layout")
    rows = image.mtp_rows
    if rows is not None and (image.conv is None or rows.dtype != np.float32 or rows.ndim != 2
                             or not 0 <= image.mtp_start < n
                             or rows.shape[0] != n - image.mtp_start):
        raise ValueError(f"MTP rows {rows.dtype} {rows.shape} from {image.mtp_start} do not "
                         f"fit {n} tokens")
    for c in image.checkpoints or ():
        row = c.mtp_row
        if row is not None and (row.dtype != np.float32 or row.ndim != 2 or row.shape[0] != 1):
            raise ValueError(f"checkpoint at {c.depth}: MTP row {row.dtype} {row.shape}")
        if image.conv is None or not 0 < c.depth < n or \
                [a.shape for a in list(c.conv) + list(c.ssm)] != \
                [a.shape for a in image.conv + image.ssm] or \
                any(a.dtype != np.float32 for a in list(c.conv) + list(c.ssm)):
            raise ValueError(f"checkpoint at {c.depth} does not fit the image")


class HostTier:
    """L2: images in host memory under a byte budget, shared fairly between sessions: when an
    image needs room, the session holding the most bytes loses its least recently used image
    first (images without a session, e.g. published breakpoints, count as one session), so a
    long conversation cannot push every other session's images out.

    Args:
        budget_bytes: ceiling on the images' bytes (an image larger than it is refused).
        supersede: an admitted image replaces the held ones whose whole ledger is a strict
            prefix of its own (attention-only models, where the longer one serves every
            prompt the shorter did; not on hybrid models, where an image restores only at its
            exact end), as the L3 store does: a conversation's earlier turns are not kept
            beside its latest.
    """

    def __init__(self, budget_bytes: int, supersede: bool = False):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.supersede = supersede
        self.nbytes = 0
        self._images: collections.OrderedDict[str, LaneImage] = collections.OrderedDict()
        self._session: dict[str, str] = {}   # image key -> its session key ("": none)

    def __len__(self) -> int:
        return len(self._images)

    def put(self, image: LaneImage, session: str = "") -> tuple[bool, list[LaneImage],
                                                               list[LaneImage]]:
        """Admit ``image`` of session ``session`` (a copy already held: refreshed). Returns
        (admitted, images evicted to make room, images it superseded). An image over the
        whole budget is refused and evicts nothing."""
        key = image.key
        held = self._images.get(key)
        if held is not None and (held.mtp_rows is not None or image.mtp_rows is None):
            self._images.move_to_end(key)
            return True, [], []
        if held is not None:   # the same ledger, now with the MTP rows a speculative lane needs
            self._drop(key)
        if image.nbytes > self.budget_bytes:
            return False, [], []
        superseded = [old for old in self._images.values() if self.supersede and old.n < image.n
                      and np.array_equal(old.tokens, image.tokens[:old.n])]
        for old in superseded:
            self._drop(old.key)
        evicted = []
        while self.nbytes + image.nbytes > self.budget_bytes:
            evicted.append(self._drop(self._victim()))
        self._images[key] = image
        self._session[key] = session
        self.nbytes += image.nbytes
        return True, evicted, superseded

    def _victim(self) -> str:
        """The key of the least recently used image of the session holding the most bytes."""
        held = self.shares()
        top = max(held.values())
        return next(k for k in self._images if held[self._session[k]] == top)

    def _drop(self, key: str) -> LaneImage:
        image = self._images.pop(key)
        del self._session[key]
        self.nbytes -= image.nbytes
        return image

    def shares(self) -> dict[str, int]:
        """Bytes held per session key."""
        out: dict[str, int] = collections.defaultdict(int)
        for k, im in self._images.items():
            out[self._session[k]] += im.nbytes
        return dict(out)

    def holds(self, key: str, mtp: bool = False) -> bool:
        """Whether an image with this ``LaneImage.key`` (with ``mtp``: and MTP rows) is held
        (its recency unchanged)."""
        im = self._images.get(key)
        return im is not None and (not mtp or im.mtp_rows is not None)

    def best(self, prompt: np.ndarray, limit: int, exact: bool,
             mtp: bool = False) -> tuple[LaneImage | None, int]:
        """The image reusing the most of ``prompt`` (at most ``limit`` tokens) and that depth;
        ``exact``: only an image whose whole ledger is a prefix, or one of its checkpoints'
        (hybrid models); ``mtp`` (a speculative request): only at an image's ``mtp_marks``."""
        if mtp:
            best, depth = best_resume(((im, im.tokens, im.mtp_marks)
                                       for im in self._images.values()), prompt, limit)
        else:
            best, depth = best_prefix(((im, im.tokens) for im in self._images.values()),
                                      prompt, limit, exact, marks=lambda im: im.marks)
        if best is not None:
            self._images.move_to_end(best.key)
        return best, depth

    def shared(self, prompt: np.ndarray) -> int:
        """The longest prefix of ``prompt`` any image holds, reusable or not (recency
        unchanged)."""
        return best_prefix(((im, im.tokens) for im in self._images.values()), prompt,
                           len(prompt), False)[1]
