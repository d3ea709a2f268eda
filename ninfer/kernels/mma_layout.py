"""The tensor-core ("mma") layout of packed q4 / q8 weights on the GPU, and a NumPy emulation
of the GEMV that reads it.

The GPU GEMV (``gpu/linear.cu``, ``gemv_mma``) multiplies packed weights with the warp-level
``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` instruction: a 16 x 16 tile of weights
(rows = output features, columns = K) times a 16 x 8 tile of activations (8 token columns).
The weights are stored so that one 16-byte load per lane yields that lane's A fragments for
four consecutive k-tiles, already in register order, and a few bit operations turn each 4-bit
or 8-bit code into the fp16 value the instruction wants. Source of the fragment layout: the
PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (NVIDIA); the nibble to
fp16 conversion by OR-ing into the mantissa of 1024.0 is the one of FasterTransformer /
Marlin (Frantar et al. 2024, "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference").

Fragment layout (lane = 4 g + t, g = lane // 4, t = lane % 4), for a tile with rows r0..r0+15
and columns c0..c0+15:

- A register 0: rows g, columns 2t, 2t+1 (low, high half); register 1: row g + 8, same
  columns; register 2: row g, columns 2t+8, 2t+9; register 3: row g + 8, columns 2t+8, 2t+9.
- B register 0: k = 2t, 2t+1 of token column g; register 1: k = 2t+8, 2t+9.
- C: c0, c1 = row g, token columns 2t, 2t+1; c2, c3 = row g + 8, same columns.

Arrays (N16 = ceil(N / 16) row tiles, KC = ceil(K / 64) chunks of 64 columns = 4 k-tiles;
padding rows and columns hold code 0 and scale 0, so they add nothing):

- q4 ``codes``: uint32 ``(N16, KC, 32, 4)``: ``codes[rt, kc, lane, j]`` covers k-tile j of chunk
  kc; its nibble n (bits 4n..4n+3) is the code of row ``r0 + g + 8h``, column
  ``c0 + 2t + 8c + e`` with ``n = h + 2c + 4e`` (``r0 = 16 rt``, ``c0 = 64 kc + 16 j``). Then
  ``(w & 0x000F000F) | 0x64006400`` is register 0 as fp16 ``1024 + q``,
  ``(w & 0x00F000F0) | 0x64006400`` register 1 as ``1024 + 16 q``, and the same on ``w >> 8``
  registers 2 and 3.
- q8 ``codes``: uint32 ``(N16, KC, 2, 32, 4)``: ``codes[rt, kc, p, lane]`` is one 16-byte load
  holding k-tiles 2p and 2p+1; word ``2 (j % 2) + c`` holds the bytes of columns
  ``c0 + 2t + 8c + (0, 1)`` of row g (bytes 0, 1) and of row g + 8 (bytes 2, 3).
- ``scales``: uint32 ``(N16, KC, 8, S)``, each word two fp16 values (low: row ``r0 + g``, high:
  row ``r0 + g + 8``); ``[..., 0:2]`` are the scales of the chunk's two 32-column segments and,
  for q4 with mins (S = 4), ``[..., 2:4]`` their mins. A group wider than 32 repeats its scale
  in each of its segments, so the GEMV applies one scale per 32 columns.

Every function takes ``xp`` (``numpy`` or ``cupy``): the GPU backend repacks on the device with
the same code that the CPU tests check.
"""
from __future__ import annotations

import numpy as np

CHUNK = 64      # columns per chunk (4 k-tiles): one 16-byte code load per lane (q4)
SEGMENT = 32    # columns per scale segment


def padded(n: int, k: int) -> tuple[int, int]:
    """(N16, KC): row tiles and column chunks of an (n, k) weight."""
    return -(-n // 16), -(-k // CHUNK)


def layout_ok(k: int, group: int) -> bool:
    """Whether an (N, K) weight with this group fits the layout (K and group multiples of 32)."""
    return k % SEGMENT == 0 and group > 0 and group % SEGMENT == 0


def _segment_values(v, n: int, k: int, group: int, xp):
    """(N, K/group) per-group values -> float16 (N16*16, KC*2) per 32-column segment, 0-padded."""
    n16, kc = padded(n, k)
    seg_group = (np.arange(k // SEGMENT) * SEGMENT) // group
    out = xp.zeros((n16 * 16, kc * 2), dtype=xp.float16)
    out[:n, :k // SEGMENT] = xp.asarray(v, dtype=xp.float16)[:, xp.asarray(seg_group)]
    return out


def pack_scales(scales, mins, n: int, k: int, group: int, xp=np):
    """``scales`` (and ``mins`` or None), float16 (N, K/group) -> uint32 (N16, KC, 8, 2 or 4)."""
    n16, kc = padded(n, k)
    parts = [_segment_values(scales, n, k, group, xp)]
    if mins is not None:
        parts.append(_segment_values(mins, n, k, group, xp))
    # (N16, h, g, KC, seg) per part -> (N16, KC, g, part, seg, h)
    st = xp.stack([p.reshape(n16, 2, 8, kc, 2) for p in parts], axis=0)
    st = xp.ascontiguousarray(st.transpose(1, 4, 3, 0, 5, 2))
    return st.reshape(n16, kc, 8, 4 * len(parts)).view(xp.uint32)


def _padded_codes(q, n: int, k: int, xp):
    n16, kc = padded(n, k)
    out = xp.zeros((n16 * 16, kc * CHUNK), dtype=q.dtype)
    out[:n, :k] = q
    return out


def pack_q4(codes, n: int, k: int, xp=np):
    """Stored q4 codes (uint8 (N, K/2), low nibble first) -> uint32 (N16, KC, 32, 4)."""
    c = xp.asarray(codes, dtype=xp.uint8)
    q = xp.zeros((n, k), dtype=xp.uint8)
    q[:, 0::2] = c & 15
    q[:, 1::2] = c >> 4
    n16, kc = padded(n, k)
    q = _padded_codes(q, n, k, xp).reshape(n16, 2, 8, kc, 4, 2, 4, 2)  # rt h g kc j c t e
    q = q.transpose(0, 3, 2, 6, 4, 7, 5, 1).reshape(n16, kc, 32, 4, 8)  # rt kc (g t) j (e c h)
    shifts = xp.asarray(np.arange(8, dtype=np.uint32) * 4)
    return (q.astype(xp.uint32) << shifts).sum(axis=-1, dtype=xp.uint32)


def pack_q8(codes, n: int, k: int, xp=np):
    """Stored q8 codes (int8 (N, K)) -> uint32 (N16, KC, 2, 32, 4)."""
    q = xp.ascontiguousarray(xp.asarray(codes, dtype=xp.int8)).view(xp.uint8)
    n16, kc = padded(n, k)
    q = _padded_codes(q, n, k, xp).reshape(n16, 2, 8, kc, 2, 2, 2, 4, 2)  # rt h g kc p jj c t e
    q = xp.ascontiguousarray(q.transpose(0, 3, 4, 2, 7, 5, 6, 1, 8))  # rt kc p g t jj c h e
    return q.reshape(n16, kc, 2, 32, 16).view(xp.uint32)


# --------------------------------------------------------------------------------------------
# NumPy emulation (CPU tests): decode the packed arrays the way the kernel's lanes do and
# multiply with the fragment layout above.

def _half_pair(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(word, dtype=np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return lo, hi


def a_registers(scheme: str, mins: bool, codes: np.ndarray, rt: int, kc: int, lane: int,
                j: int) -> list[tuple[float, float]]:
    """The four A registers (pairs of values, as the kernel's bit tricks produce them) of one
    lane for k-tile j of chunk kc, in code units (q - 8 for q4 without mins, q with mins, the
    signed byte for q8)."""
    f16 = lambda bits: float(np.uint16(bits).view(np.float16))  # noqa: E731
    regs = []
    if scheme == "q4":
        w = int(codes[rt, kc, lane, j])
        for src in (w, w >> 8):
            lo = (src & 0x000F000F) | 0x64006400
            hi = (src & 0x00F000F0) | 0x64006400
            bias = 1024.0 if mins else 1032.0
            regs.append((f16(lo & 0xFFFF) - bias, f16(lo >> 16) - bias))
            regs.append((f16(hi & 0xFFFF) / 16 - (bias - 960.0),
                         f16(hi >> 16) / 16 - (bias - 960.0)))
        return [regs[0], regs[1], regs[2], regs[3]]
    words = codes[rt, kc, j // 2, lane]
    for c in (0, 1):
        w = int(words[2 * (j % 2) + c]) ^ 0x80808080
        b = [(w >> (8 * i)) & 255 for i in range(4)]
        regs.append((b[0] - 128.0, b[1] - 128.0))
        regs.append((b[2] - 128.0, b[3] - 128.0))
    return [regs[0], regs[1], regs[2], regs[3]]


def emulate_gemv(scheme: str, codes: np.ndarray, scales: np.ndarray, x: np.ndarray,
                 n: int, k: int) -> np.ndarray:
    """``x @ dequant(w).T`` for (T, K) float ``x`` (T <= 8), computed lane by lane from the
    packed arrays with the fragment layout of the module docstring (float64, no rounding of x).
    Slow: for tests on small shapes."""
    t_tot = x.shape[0]
    n16, kc_n = padded(n, k)
    mins = scales.shape[-1] == 4
    xp = np.zeros((8, kc_n * CHUNK))
    xp[:t_tot, :k] = x
    out = np.zeros((n16 * 16, 8))
    for rt in range(n16):
        for kc in range(kc_n):
            for seg in (0, 1):
                part = np.zeros((16, 8))   # this segment's sum of code * x, per (row, token)
                xsum = np.zeros(8)
                for jj in (0, 1):
                    j = 2 * seg + jj
                    c0 = kc * CHUNK + 16 * j
                    xsum += xp[:, c0:c0 + 16].sum(axis=1)
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        a = a_registers(scheme, mins, codes, rt, kc, lane, j)
                        # A fragment element (row, col) of this lane
                        elems = {(g, 2 * t): a[0][0], (g, 2 * t + 1): a[0][1],
                                 (g + 8, 2 * t): a[1][0], (g + 8, 2 * t + 1): a[1][1],
                                 (g, 2 * t + 8): a[2][0], (g, 2 * t + 9): a[2][1],
                                 (g + 8, 2 * t + 8): a[3][0], (g + 8, 2 * t + 9): a[3][1]}
                        for (r, c), v in elems.items():
                            part[r] += v * xp[:, c0 + c]
                for lane_g in range(8):
                    s_lo, s_hi = _half_pair(scales[rt, kc, lane_g, seg])
                    out[rt * 16 + lane_g] += s_lo * part[lane_g]
                    out[rt * 16 + lane_g + 8] += s_hi * part[lane_g + 8]
                    if mins:
                        m_lo, m_hi = _half_pair(scales[rt, kc, lane_g, 2 + seg])
                        out[rt * 16 + lane_g] += m_lo * xsum
                        out[rt * 16 + lane_g + 8] += m_hi * xsum
    return out[:n, :t_tot].T.copy()


def unpack(scheme: str, codes: np.ndarray, scales: np.ndarray, n: int, k: int) -> np.ndarray:
    """Dequantized float32 (N, K) weight from the packed arrays (inverse of the packing; what
    the GPU's gather and dequantization kernels compute element by element)."""
    n16, kc_n = padded(n, k)
    mins = scales.shape[-1] == 4
    if scheme == "q4":
        q = np.stack([(codes >> np.uint32(4 * i)) & np.uint32(15) for i in range(8)], axis=-1)
        # rt kc g t j (e c h) -> rt h g kc j c t e
        q = q.reshape(n16, kc_n, 8, 4, 4, 2, 2, 2).transpose(0, 7, 2, 1, 4, 6, 3, 5)
        q = q.reshape(n16 * 16, kc_n * CHUNK).astype(np.float32)
        if not mins:
            q -= 8.0
    else:
        b = codes.view(np.int8).reshape(n16, kc_n, 2, 8, 4, 2, 2, 2, 2)  # rt kc p g t jj c h e
        q = b.transpose(0, 7, 3, 1, 2, 5, 6, 4, 8).reshape(n16 * 16, kc_n * CHUNK)
        q = q.astype(np.float32)
    sv = scales.view(np.float16).reshape(n16, kc_n, 8, scales.shape[-1], 2).astype(np.float32)
    # rt kc g (part seg) h -> rows, segments
    s = sv[:, :, :, 0:2, :].transpose(0, 4, 2, 1, 3).reshape(n16 * 16, kc_n * 2)
    w = q * np.repeat(s, SEGMENT, axis=1)
    if mins:
        m = sv[:, :, :, 2:4, :].transpose(0, 4, 2, 1, 3).reshape(n16 * 16, kc_n * 2)
        w += np.repeat(m, SEGMENT, axis=1)
    return w[:n, :k]


# --------------------------------------------------------------------------------------------
# int8 activations ("q8a", ``gemv_q8a`` of gpu/linear.cu): the activations are quantized per
# 32-column segment and multiplied with the integer mma.sync m16n8k32 (PTX ISA, "Matrix
# Fragments for mma.m16n8k32": A register i of lane (g, t) holds row g (i even) or g + 8
# (i odd), k = 4t..4t+3 (i < 2) or 16 + 4t.. (i >= 2); B register h holds k = 16h + 4t..+3 of
# token column g; C as for m16n8k16). The k index 4t + b of a segment's mma stands for column
# ``Q8A_COLS[b] + 2t`` of the segment's first k-tile (16 + ... for its second), the order in
# which the packed q4 words already hold a row's codes.

Q8A_COLS = (0, 8, 1, 9)   # column offset (from 2t) of byte b of an A / B register


def quantize_activations_q8(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32-column int8 quantization of float32 activations, exactly as ``gemv_q8a`` does it.

    Args:
        a: float32 (T, K), K a multiple of 32.

    Returns:
        ``(q, d)``: int8 (T, K) codes ``rint(a * (127 / amax))`` (round half to even, float32
        arithmetic) and float32 (T, K / 32) scales ``amax / 127`` (0 for an all-zero segment),
        so that ``q * d`` approximates ``a`` with an error of at most ``d / 2`` per element.
    """
    a = np.asarray(a, dtype=np.float32)
    t, k = a.shape
    seg = a.reshape(t, k // SEGMENT, SEGMENT)
    amax = np.abs(seg).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(seg * inv[..., None]).astype(np.int8).reshape(t, k)
    return q, (amax / np.float32(127.0)).astype(np.float32)


def dequantize_activations_q8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """float64 (T, K) ``q * d`` of ``quantize_activations_q8``'s output (the values the q8a GEMV
    multiplies)."""
    t, k = q.shape
    return (q.astype(np.float64).reshape(t, -1, SEGMENT) * d[..., None]).reshape(t, k)


def emulate_gemv_q8a(scheme: str, codes: np.ndarray, scales: np.ndarray, x: np.ndarray,
                     n: int, k: int) -> np.ndarray:
    """``gemv_q8a``'s result for (T, K) float32 ``x`` (T <= 8, no prologue), computed lane by
    lane: A registers made from the packed words with the kernel's masks / byte permutes, each
    byte's k index mapped to its column through ``Q8A_COLS`` (the order in which the kernel
    stages the int8 activations; the staging code itself and its per-chunk scale words are
    checked by the GPU tests only), the m16n8k32 fragment layout, integer sums per segment,
    then the kernel's float scaling (float64 here). Slow: small shapes only."""
    t_tot = x.shape[0]
    n16, kc_n = padded(n, k)
    mins = scales.shape[-1] == 4
    xq = np.zeros((8, kc_n * CHUNK), dtype=np.int64)
    dx = np.zeros((8, kc_n * 2))
    q, d = quantize_activations_q8(x)
    xq[:t_tot, :k] = q
    dx[:t_tot, :k // SEGMENT] = d
    xq[t_tot:] = xq[t_tot - 1]          # B columns past T repeat the last token (discarded)
    dx[t_tot:] = dx[t_tot - 1]
    sq = xq.reshape(8, kc_n * 2, SEGMENT).sum(axis=-1)
    out = np.zeros((n16 * 16, 8))
    byte = lambda w, b: (int(w) >> (8 * b)) & 255  # noqa: E731
    s8 = lambda v: v - 256 if v >= 128 else v  # noqa: E731
    for rt in range(n16):
        for kc in range(kc_n):
            for sg in (0, 1):
                c0 = kc * CHUNK + SEGMENT * sg
                acc = np.zeros((16, 8), dtype=np.int64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    if scheme == "q4":
                        w0, w1 = codes[rt, kc, lane, 2 * sg], codes[rt, kc, lane, 2 * sg + 1]
                        a = [int(w0) & 0x0F0F0F0F, int(w0) & 0xF0F0F0F0,
                             int(w1) & 0x0F0F0F0F, int(w1) & 0xF0F0F0F0]
                        aval = lambda i, b: byte(a[i], b)  # noqa: E731  (u8)
                    else:
                        wq = [int(v) for v in codes[rt, kc, sg, lane]]
                        perm = lambda p, q_, sel: sum(  # noqa: E731  (__byte_perm)
                            ((p | q_ << 32) >> (8 * ((sel >> (4 * i)) & 7)) & 255) << (8 * i)
                            for i in range(4))
                        a = [perm(wq[0], wq[1], 0x5140), perm(wq[0], wq[1], 0x7362),
                             perm(wq[2], wq[3], 0x5140), perm(wq[2], wq[3], 0x7362)]
                        aval = lambda i, b: s8(byte(a[i], b))  # noqa: E731
                    for i in range(4):
                        row = g + 8 * (i % 2)
                        for b in range(4):
                            col = c0 + 16 * (i // 2) + 2 * t + Q8A_COLS[b]
                            acc[row] += aval(i, b) * xq[:, col]
                s_lo, s_hi = (np.array(v) for v in zip(*[_half_pair(scales[rt, kc, gg, sg])
                                                         for gg in range(8)]))
                dseg = dx[:, kc * 2 + sg]
                for half, s in ((0, s_lo), (1, s_hi)):
                    rows = slice(8 * half, 8 * half + 8)
                    c = acc[rows].astype(np.float64)
                    if scheme == "q4":
                        c = c / 16 if half else c
                        if not mins:
                            c = c - 8 * sq[:, kc * 2 + sg]
                    out[rt * 16 + 8 * half:rt * 16 + 8 * half + 8] += s[:, None] * c * dseg
                    if mins:
                        m = np.array([_half_pair(scales[rt, kc, gg, 2 + sg])[half]
                                      for gg in range(8)])
                        out[rt * 16 + 8 * half:rt * 16 + 8 * half + 8] += (
                            m[:, None] * (sq[:, kc * 2 + sg] * dseg))
    return out[:n, :t_tot].T.copy()
