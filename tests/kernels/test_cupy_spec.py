"""The speculative round's GPU kernels (``gpu.spec``) against the NumPy reference
(``kernels.spec``) on fresh random inputs, outputs poisoned first."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.kernels import spec as ref
from ninfer.kernels.gdn import record_width

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from ninfer.kernels.cupy_ops import CupyOps, cuda_available
    if not cuda_available():
        pytest.skip("no CUDA device")
    return CupyOps()


def bound(ops, *host):
    """Device buffers (poisoned) bound to ``host`` arrays, as a CUDA graph's would be."""
    dev = [cp.full(h.shape, -7, dtype=h.dtype) for h in host]
    ops.bind_static(list(zip(host, dev)))
    return dev


@pytest.mark.parametrize("b,k", [(1, 1), (3, 3), (8, 5)])
def test_accept_rows_and_chain(ops, b, k):
    rng = np.random.default_rng(b * 10 + k)
    t = b * (k + 1)
    targets = rng.integers(0, 4, t).astype(np.int32)
    ids = targets.copy()
    ids = np.roll(ids, 1)   # ids[i + 1] == targets[i] within a lane, mostly
    ids[rng.random(t) < 0.3] = 9
    acc_h = np.zeros(b, dtype=np.int32)
    ref.accept_counts(ids, targets, k, acc_h)
    out = np.zeros(b, dtype=np.int32)
    (d_out,) = bound(ops, out)
    ops.spec_accept(ids, targets, k, out)
    np.testing.assert_array_equal(cp.asnumpy(d_out), acc_h)
    assert set(acc_h.tolist()) <= set(range(1, k + 2))
    x = rng.standard_normal((t, 33)).astype(np.float32)
    got = ops.spec_rows(cp.asarray(x), acc_h, k)
    np.testing.assert_array_equal(cp.asnumpy(got), ref.accepted_rows(x, acc_h, k))
    ps, width = 4, 9
    pos = np.repeat(rng.integers(0, 8, b), k + 1).astype(np.int32)
    pos += np.tile(np.arange(k + 1), b).astype(np.int32)
    sm = np.zeros(t, dtype=np.int64)
    sm[::k + 1][rng.random(b) < 0.3] = -1    # padding lanes
    bt = rng.integers(0, 50, (b, width)).astype(np.int32)
    want = [np.zeros(b, np.int32), np.zeros(b, np.int64), np.zeros(b, np.int32)]
    ref.chain_inputs(pos, sm, acc_h, k + 1, bt, ps, *want)
    host = [np.zeros(b, np.int32), np.zeros(b, np.int64), np.zeros(b, np.int32)]
    dev = bound(ops, *host)
    ops.spec_chain(pos, sm, acc_h, k + 1, bt, ps, *host)
    for w, d in zip(want, dev):
        np.testing.assert_array_equal(cp.asnumpy(d), w)


@pytest.mark.parametrize("s,length", [(1, 2), (4, 6)])
def test_record_conv_and_commit(ops, s, length):
    rng = np.random.default_rng(s + length)
    pool, kc1, c, hv, dk, dv = 6, 3, 24, 4, 8, 4
    conv = rng.standard_normal((pool, kc1, c)).astype(np.float32)
    ssm = rng.standard_normal((pool, hv, dk, dv)).astype(np.float32)
    slots = rng.choice(pool, s, replace=False).astype(np.int64)
    slots[0] = -1 if s > 1 else slots[0]   # a padding row
    cu = np.arange(s + 1, dtype=np.int32) * length
    x = rng.standard_normal((s * length, c + 5)).astype(np.float32)[:, :c]   # strided rows
    rec = np.full((s, kc1 + length, c), np.nan, dtype=np.float32)
    ref.record_conv(rec, conv, x, cu, slots)
    d_rec = cp.full(rec.shape, np.nan, dtype=cp.float32)
    ops.bind_static([])
    ops.gdn_record_conv(d_rec, cp.asarray(conv), cp.asarray(x), cu, slots)
    np.testing.assert_array_equal(cp.asnumpy(d_rec), rec)
    # two layers in one commit, each slot's state advanced by the records of the tokens it
    # keeps (all `length` of them for the last)
    hk = 2   # (value heads 0, 1 take key head 0; 2, 3 key head 1)
    width = record_width(hk, hv, dk, dv)
    rec_ssm = [rng.standard_normal((s, length, width)).astype(np.float32) for _ in "ab"]
    for r in rec_ssm:   # (decays in (0, 1))
        r[..., -hv:] = rng.uniform(0.2, 1.0, (s, length, hv))
    recs = [rec, rng.standard_normal(rec.shape).astype(np.float32)]
    ssms = [ssm, rng.standard_normal(ssm.shape).astype(np.float32)]
    convs = [conv, rng.standard_normal(conv.shape).astype(np.float32)]
    acc = rng.integers(1, length + 1, s).astype(np.int32)
    acc[-1] = length
    d_ssm, d_conv = [cp.asarray(a) for a in ssms], [cp.asarray(a) for a in convs]
    before = [a.copy() for a in ssms + convs]
    for layer in zip(ssms, convs, rec_ssm, recs):
        ref.commit_state(*layer, slots, acc)
    ops.gdn_commit(d_ssm, d_conv, [cp.asarray(a) for a in rec_ssm], [d_rec, cp.asarray(recs[1])],
                   slots, acc)
    for got, want in zip(d_ssm, ssms):   # (fused multiply-adds on the GPU)
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-5)
    for got, want in zip(d_conv, convs):
        np.testing.assert_array_equal(cp.asnumpy(got), want)
    for got, was in zip(ssms, before):   # padding rows move nothing, the others all move
        moved = [not np.array_equal(got[i], was[i]) for i in range(pool)]
        assert moved == [i in set(slots[slots >= 0].tolist()) for i in range(pool)]


def test_argmax_into_needs_a_bound_output(ops):
    logits = cp.asarray(np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32))
    out = np.zeros(5, dtype=np.int32)
    (d,) = bound(ops, out)
    ops.argmax_into(logits, out)
    np.testing.assert_array_equal(cp.asnumpy(d), cp.asnumpy(logits).argmax(-1))
    ops.bind_static([])
    with pytest.raises(RuntimeError, match="bound"):
        ops.argmax_into(logits, out)
