"""Gated DeltaNet reference ops: each against an independent formulation (float64 math, the
explicit ``a (I - b k k^T) S + b k v^T`` update, HF transformers' torch functions), and the fast
forms against the slow ones (chunked == recurrent, conv prefill == repeated steps)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.kernels import get_ops, gdn


@pytest.fixture
def ops():
    return get_ops("numpy")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def rel_err(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def gdn_inputs(rng, t, hk=2, hv=4, dk=16, dv=8, state=True):
    """Random GDN inputs shaped like a real layer's: L2-normalised q/k, g <= 0, beta in (0,1)."""
    q = gdn.l2_norm(rng.standard_normal((t, hk, dk)).astype(np.float32))
    k = gdn.l2_norm(rng.standard_normal((t, hk, dk)).astype(np.float32))
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g, beta = gdn.gdn_gates(rng.standard_normal((t, hv)).astype(np.float32),
                            rng.standard_normal((t, hv)).astype(np.float32),
                            np.log(rng.uniform(0.01, 4, hv)).astype(np.float32),
                            np.ones(hv, np.float32))
    s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32) * 0.3 if state else None
    return q, k, v, g, beta, s0


def naive_delta_rule(q, k, v, g, beta, s0, scale):
    """float64, literally S_t = a_t (I - b_t k k^T) S_{t-1} + b_t k v^T, o_t = S_t^T q_t."""
    t, hv, dv = v.shape
    hk, dk = k.shape[1:]
    r = hv // hk
    s = np.zeros((hv, dk, dv)) if s0 is None else s0.astype(np.float64).copy()
    out = np.zeros((t, hv, dv))
    for i in range(t):
        for h in range(hv):
            kk = k[i, h // r].astype(np.float64)
            qq = q[i, h // r].astype(np.float64) * scale
            a = np.exp(np.float64(g[i, h]))
            b = np.float64(beta[i, h])
            s[h] = a * (np.eye(dk) - b * np.outer(kk, kk)) @ s[h] + b * np.outer(kk, v[i, h])
            out[i, h] = s[h].T @ qq
    return out, s


# ---------------------------------------------------------------------------- delta rule

def test_recurrent_matches_float64_formula(rng):
    q, k, v, g, beta, s0 = gdn_inputs(rng, 23)
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0, 16 ** -0.5)
    o_ref, s_ref = naive_delta_rule(q, k, v, g, beta, s0, 16 ** -0.5)
    assert o.dtype == np.float32 and o.shape == (23, 4, 8) and s.shape == (4, 16, 8)
    assert rel_err(o, o_ref) < 2e-6
    assert rel_err(s, s_ref) < 2e-6


@pytest.mark.parametrize("t,chunk", [(1, 64), (5, 64), (64, 64), (150, 64), (100, 16), (37, 8)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(rng, t, chunk, with_state):
    q, k, v, g, beta, s0 = gdn_inputs(rng, t, state=with_state)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0, 0.25)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0, 0.25, chunk_size=chunk)
    assert o_c.shape == o_r.shape and s_c.shape == s_r.shape
    assert rel_err(o_c, o_r) < 1e-5
    assert rel_err(s_c, s_r) < 1e-5
    if s0 is not None:
        assert np.abs(s_r - s0).max() > 1e-2  # the state really moved


def test_chunked_with_strong_decay_and_full_beta(rng):
    """Extreme gates: decays near 0 and 1, beta near 1 (the UT system is at its worst)."""
    q, k, v, _, _, s0 = gdn_inputs(rng, 130, hk=1, hv=3, dk=32, dv=16)
    g = np.stack([np.full(130, -1e-4), np.full(130, -8.0), rng.uniform(-3, 0, 130)],
                 axis=1).astype(np.float32)
    beta = np.full((130, 3), 0.999, np.float32)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0, 32 ** -0.5)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0, 32 ** -0.5)
    assert rel_err(o_c, o_r) < 5e-5
    assert rel_err(s_c, s_r) < 5e-5


def test_chunked_prefill_in_pieces_equals_one_shot(rng):
    q, k, v, g, beta, s0 = gdn_inputs(rng, 200)
    o_all, s_all = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0, 0.25)
    s, outs = s0, []
    for a, b in [(0, 7), (7, 71), (71, 72), (72, 200)]:
        o, s = gdn.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, 0.25)
        outs.append(o)
    assert rel_err(np.concatenate(outs), o_all) < 1e-5
    assert rel_err(s, s_all) < 1e-5


def test_step_is_batched_recurrence(rng):
    """A batched step over 3 sequences equals each sequence's own first step."""
    seqs = [gdn_inputs(rng, 1) for _ in range(3)]
    stack = [np.concatenate([s[i] for s in seqs]) for i in range(5)]
    states = np.stack([s[5] for s in seqs])
    o, st = gdn.gated_delta_rule_step(*stack, states, 0.25)
    for j, s in enumerate(seqs):
        o1, st1 = gdn.recurrent_gated_delta_rule(*s[:5], s[5], 0.25)
        np.testing.assert_allclose(o[j], o1[0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(st[j], st1, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["auto", "recurrent", "chunked"])
def test_ragged_gated_delta_rule_updates_slots(ops, rng, mode):
    lens = [1, 70, 1, 9]
    slots = np.array([4, 0, 2, 5], np.int32)
    seqs = [gdn_inputs(rng, n) for n in lens]
    pool = rng.standard_normal((6, 4, 16, 8)).astype(np.float32)
    for s, slot in zip(seqs, slots):
        pool[slot] = s[5]
    untouched = pool[[1, 3]].copy()
    cat = [np.concatenate([s[i] for s in seqs]) for i in range(5)]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out = ops.gated_delta_rule(*cat, pool, cu, slots, 0.25, mode=mode)
    assert out.shape == (81, 4, 8)
    for j, (s, slot) in enumerate(zip(seqs, slots)):
        o_ref, s_ref = gdn.recurrent_gated_delta_rule(*s[:5], s[5], 0.25)
        assert rel_err(out[cu[j]:cu[j + 1]], o_ref) < 1e-5
        assert rel_err(pool[slot], s_ref) < 1e-5
    np.testing.assert_array_equal(pool[[1, 3]], untouched)


def test_ragged_rejects_bad_batches(ops, rng):
    q, k, v, g, beta, _ = gdn_inputs(rng, 4)
    pool = np.zeros((3, 4, 16, 8), np.float32)
    with pytest.raises(ValueError, match="distinct"):
        ops.gated_delta_rule(q, k, v, g, beta, pool, np.array([0, 2, 4]), np.array([1, 1]), 1.0)
    with pytest.raises(ValueError, match="distinct"):
        ops.gated_delta_rule(q, k, v, g, beta, pool, np.array([0, 4]), np.array([3]), 1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.gated_delta_rule(q, k, v, g, beta, pool, np.array([0, 3]), np.array([0]), 1.0)
    with pytest.raises(ValueError, match="mode"):
        ops.gated_delta_rule(q, k, v, g, beta, pool, np.array([0, 4]), np.array([0]), 1.0,
                             mode="fast")


# ---------------------------------------------------------------------------------- conv

def conv_ref(x, w, history=None):
    """float64 causal depthwise conv + silu straight from the definition."""
    c, kc = w.shape
    u = np.concatenate([np.zeros((kc - 1, c)) if history is None else history, x]).astype(
        np.float64)
    t = x.shape[0]
    y = np.stack([(u[i:i + kc].T * w).sum(1) for i in range(t)])
    return y / (1 + np.exp(-y))


def test_conv_prefill_matches_float64(rng):
    x = rng.standard_normal((11, 24)).astype(np.float32)
    w = rng.standard_normal((24, 4)).astype(np.float32)
    y, st = gdn.conv1d_prefill(x, w, None)
    assert y.shape == (11, 24) and st.shape == (3, 24)
    assert rel_err(y, conv_ref(x, w)) < 1e-6
    np.testing.assert_array_equal(st, x[-3:])
    y2, _ = gdn.conv1d_prefill(x, w, None, activation=None)
    pre = np.stack([(np.concatenate([np.zeros((3, 24)), x])[i:i + 4].T * w).sum(1)
                    for i in range(11)])
    assert rel_err(y2, pre) < 1e-6


def test_conv_prefill_equals_repeated_steps(rng):
    x = rng.standard_normal((9, 40)).astype(np.float32)
    w = rng.standard_normal((40, 4)).astype(np.float32)
    st0 = rng.standard_normal((3, 40)).astype(np.float32)
    y_all, st_all = gdn.conv1d_prefill(x, w, st0)
    st = st0[None]
    for i in range(9):
        y, st = gdn.conv1d_step(x[i:i + 1], w, st)
        np.testing.assert_allclose(y[0], y_all[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(st[0], st_all)
    assert rel_err(y_all, conv_ref(x, w, st0)) < 1e-6


def test_conv_short_prefill_keeps_old_state_rows(rng):
    w = rng.standard_normal((8, 4)).astype(np.float32)
    st0 = rng.standard_normal((3, 8)).astype(np.float32)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    _, st = gdn.conv1d_prefill(x, w, st0)
    np.testing.assert_array_equal(st, np.concatenate([st0[2:], x]))


def test_ragged_conv_updates_slots(ops, rng):
    lens = [1, 6, 1, 2]
    slots = np.array([3, 1, 0, 2], np.int64)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    pool = rng.standard_normal((5, 3, 16)).astype(np.float32)
    before = pool.copy()
    x = rng.standard_normal((10, 16)).astype(np.float32)
    cu = np.cumsum([0] + lens)
    y = ops.causal_conv1d(x, w, pool, cu, slots)
    for j, slot in enumerate(slots):
        a, b = cu[j], cu[j + 1]
        y_ref, st_ref = gdn.conv1d_prefill(x[a:b], w, before[slot])
        np.testing.assert_allclose(y[a:b], y_ref, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(pool[slot], st_ref)
    np.testing.assert_array_equal(pool[4], before[4])


# ------------------------------------------------------------------------- norms and gates

def test_l2_norm_and_gated_rms_norm_match_float64(ops, rng):
    x = rng.standard_normal((5, 3, 32)).astype(np.float32) * 4
    z = rng.standard_normal((5, 3, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).sum(-1, keepdims=True) + 1e-6)
    assert rel_err(ops.l2_norm(x), ref) < 1e-6
    assert np.allclose(np.linalg.norm(ops.l2_norm(x), axis=-1), 1.0, atol=1e-5)
    z64 = z.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w * z64 / (1 + np.exp(-z64))
    assert rel_err(ops.gated_rms_norm(x, z, w, 1e-6), ref) < 1e-6


def test_gates_match_float64(ops, rng):
    a = (rng.standard_normal((6, 5)) * 10).astype(np.float32)
    a[0, 0] = 30.0  # softplus threshold branch
    b = rng.standard_normal((6, 5)).astype(np.float32) * 5
    A_log = rng.standard_normal(5).astype(np.float32)
    dt = rng.standard_normal(5).astype(np.float32)
    g, beta = ops.gdn_gates(a, b, A_log, dt)
    x = a.astype(np.float64) + dt
    ref_g = -np.exp(A_log.astype(np.float64)) * np.logaddexp(0, x)
    assert rel_err(g, ref_g) < 1e-6
    assert (g <= 0).all()
    assert rel_err(beta, 1 / (1 + np.exp(-b.astype(np.float64)))) < 1e-6


def test_sigmoid_mul(ops, rng):
    x = rng.standard_normal((4, 10)).astype(np.float32)
    gate = rng.standard_normal((4, 10)).astype(np.float32) * 8
    gate[0, 0] = -200.0  # exp overflow path -> exactly 0 gate
    ref = x.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64)))
    out = ops.sigmoid_mul(x, gate)
    assert rel_err(out, ref) < 1e-6
    assert out[0, 0] == 0.0


def test_sigmoid_mul_head_strided_gate(ops, rng):
    """The gate as the gate halves of per-head [query | gate] rows: (T, H, d), read in place."""
    t, h, d = 3, 4, 8
    qg = rng.standard_normal((t, h, 2 * d)).astype(np.float32) * 4
    x = rng.standard_normal((t, h * d)).astype(np.float32)
    out = ops.sigmoid_mul(x, qg[:, :, d:])
    ref = x.astype(np.float64) / (1 + np.exp(-qg[:, :, d:].reshape(t, h * d).astype(np.float64)))
    assert rel_err(out, ref) < 1e-6


# ---------------------------------------------------------- against HF transformers (torch)

@pytest.mark.slow
def test_against_transformers_torch_functions(rng):
    torch = pytest.importorskip("torch")
    m = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    t, hk, hv, dk, dv = 90, 2, 6, 32, 16
    q = rng.standard_normal((t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, hk, dk)).astype(np.float32)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g, beta = gdn.gdn_gates(rng.standard_normal((t, hv)).astype(np.float32),
                            rng.standard_normal((t, hv)).astype(np.float32),
                            np.zeros(hv, np.float32), np.ones(hv, np.float32))
    s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32) * 0.2
    tt = [torch.from_numpy(a)[None] for a in (q, k, v, g, beta)]
    o_hf, s_hf = m.torch_chunk_gated_delta_rule(
        *tt[:3], g=tt[3], beta=tt[4], initial_state=torch.from_numpy(s0)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = gdn.chunk_gated_delta_rule(gdn.l2_norm(q), gdn.l2_norm(k), v, g, beta, s0, dk ** -0.5)
    assert rel_err(o, o_hf[0].numpy()) < 1e-5
    assert rel_err(s, s_hf[0].numpy()) < 1e-5
    # conv: HF's single-step update against ours
    c = 24
    w = rng.standard_normal((c, 4)).astype(np.float32)
    st = rng.standard_normal((c, 4)).astype(np.float32)  # HF keeps Kc columns
    x = rng.standard_normal((1, c)).astype(np.float32)
    st_t = torch.from_numpy(st.copy())[None]
    y_hf = m.causal_conv1d_update(torch.from_numpy(x)[:, :, None], st_t, torch.from_numpy(w),
                                  None, "silu")
    y, new = gdn.conv1d_step(x, w, st[:, 1:].T[None].copy())
    assert rel_err(y, y_hf[0, :, 0].numpy()) < 1e-6
    np.testing.assert_array_equal(new[0], st_t[0, :, 1:].numpy().T)


def test_no_slot_sequences_start_from_zero_state_and_keep_none(ops, rng):
    """A sequence whose slot is ``NO_SLOT`` (a CUDA-graph bucket's padding) runs from zero conv
    and recurrent state, as a fresh slot would, and writes no slot of the pools."""
    lens, slots = [1, 3, 1], np.array([2, gdn.NO_SLOT, 0], np.int64)
    cu = np.cumsum([0] + lens)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    conv = rng.standard_normal((3, 3, 16)).astype(np.float32)
    before = conv.copy()
    y = ops.causal_conv1d(x, w, conv, cu, slots)
    y_fresh, _ = gdn.conv1d_prefill(x[1:4], w, np.zeros((3, 16), np.float32))
    np.testing.assert_allclose(y[1:4], y_fresh, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(conv[1], before[1])
    assert not np.array_equal(conv[0], before[0])   # the real slots advanced
    seqs = [gdn_inputs(rng, n) for n in lens]
    pool = rng.standard_normal((3, 4, 16, 8)).astype(np.float32)
    pool_before = pool.copy()
    cat = [np.concatenate([s[i] for s in seqs]) for i in range(5)]
    for mode in ("auto", "recurrent", "chunked"):
        p = pool_before.copy()
        out = ops.gated_delta_rule(*cat, p, cu, slots, 0.25, mode=mode)
        o_ref, _ = gdn.recurrent_gated_delta_rule(*seqs[1][:5], np.zeros((4, 16, 8), np.float32),
                                                  0.25)
        assert rel_err(out[1:4], o_ref) < 1e-5
        np.testing.assert_array_equal(p[1], pool_before[1])
    rec = np.zeros((3, 3, gdn.record_width(2, 4, 16, 8)), np.float32)
    p = pool_before.copy()
    out = ops.gated_delta_rule(*cat, p, cu, slots, 0.25, records=rec)
    assert rel_err(out[1:4], o_ref) < 1e-5
    np.testing.assert_array_equal(p, pool_before)   # (records: no slot moves until a commit)
    with pytest.raises(ValueError, match="distinct"):
        ops.gated_delta_rule(*cat, p, cu, np.array([2, -2, 0]), 0.25)


def test_records_keep_the_pool_and_advance_it_by_any_prefix(ops, rng):
    """With ``records`` the pool keeps the states from before the pass, and
    ``apply_records`` over a sequence's first n records gives the state the recurrent rule
    reaches after n tokens, bit for bit; the outputs are the recurrent ones."""
    lens, slots = [4, 1, 3], np.array([2, 0, 1], np.int64)
    cu = np.cumsum([0] + lens)
    seqs = [gdn_inputs(rng, n) for n in lens]
    cat = [np.concatenate([s[i] for s in seqs]) for i in range(5)]
    pool = rng.standard_normal((3, 4, 16, 8)).astype(np.float32)
    before = pool.copy()
    width = gdn.record_width(2, 4, 16, 8)
    rec = np.full((3, 4, width), np.nan, np.float32)
    out = ops.gated_delta_rule(*cat, pool, cu, slots, 0.25, records=rec)
    np.testing.assert_array_equal(pool, before)
    for s, n in enumerate(lens):
        st = before[slots[s]]
        for i in range(n):
            a = int(cu[s]) + i
            o, st1 = gdn.gated_delta_rule_step(*(x[a:a + 1] for x in cat), st[None], 0.25)
            st = st1[0]
            np.testing.assert_array_equal(out[a], o[0])
            np.testing.assert_array_equal(gdn.apply_records(before[slots[s]], rec[s], i + 1, 2),
                                          st)
    with pytest.raises(ValueError, match="records"):
        ops.gated_delta_rule(*cat, pool, cu, slots, 0.25, records=rec[:, :, 1:])
