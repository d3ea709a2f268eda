"""Speculative decoding passes of the Qwen3.5 hybrid: ``verify`` / ``commit`` (host-driven,
any batch), the MTP head (``mtp_forward``) and ``spec_round``, a whole round on the device.

``spec_round`` runs over a ``SpecIO``, B lanes with k drafts each, fixed shapes and nothing
read back between its passes, so a CUDA graph per (B, k) captures it
(``kernels/gpu/spec_graphs.py``):

1. verify: the main model over each lane's ``[pending, d_1 .. d_k]`` at positions
   ``n .. n + k``, recording what every token does to the GDN state (the pool keeps the
   state from before the pass); attention sees the rows as
   ``B (k + 1)`` one-token sequences of context ``position + 1`` (causal, and the decode
   attention kernel runs it);
2. the targets (argmax of every row), ``acc`` (1 + the accepted drafts) and the GDN state
   advanced by the accepted prefix's records, per lane on the device;
3. the MTP head over the same rows, each paired with its target (the token after it): this
   fills the head's KV for the accepted positions (rows past them are rewritten later) and row
   ``acc - 1`` gives draft 1 of the next round; k - 1 chained passes give drafts 2 .. k.

Greedy output equals plain decoding: every committed token is a target of the main model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer.engine.models.llama import ForwardBatch
from ninfer.kernels.gdn import NO_SLOT, record_width


@dataclass(slots=True)
class SpecRecords:
    """Per-token GDN records of one verification pass, so that ``commit`` can advance each
    sequence's state by exactly its accepted prefix.

    Attributes:
        slots / starts / lens: (S,) int64 state slot, first position and token count of each
            sequence in the pass.
        ssm: per GDN layer, (S, L, W) backend array: ``[s, i]`` = what token i did to the
            state (``gdn.record_width``: deltas, k, decays; the pool keeps the state from
            before the pass until ``commit``).
        conv: per GDN layer, (S, Kc - 1 + L, conv_dim) backend array: the slot's conv state
            before the pass, then the pass's pre-conv inputs (the state after ``n`` tokens is
            rows ``n : n + Kc - 1``).
    """

    slots: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    ssm: list
    conv: list

    @classmethod
    def new(cls, model, slots, starts, lens, length: int) -> SpecRecords:
        c, zeros = model.config, model.ops.zeros
        n = len(slots)
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        width = record_width(c.linear_num_key_heads, hv, dk, dv)
        kc1 = c.linear_conv_kernel_dim - 1
        return cls(slots=np.asarray(slots, dtype=np.int64),
                   starts=np.asarray(starts, dtype=np.int64),
                   lens=np.asarray(lens, dtype=np.int64),
                   ssm=[zeros((n, length, width), dtype=np.float32) for _ in c.gdn_layers],
                   conv=[zeros((n, kc1 + length, c.conv_dim), dtype=np.float32)
                         for _ in c.gdn_layers])


class SpecIO:
    """The arrays of a device round of B lanes and k drafts, in one host buffer (so that a
    device mirror is filled by one copy and read back by one): the inputs the host fills
    (``fill``), the outputs it reads (targets, acc, drafts) and the chained passes' inputs
    that the round computes itself.

    Attributes:
        verify: ForwardBatch of the B lanes' ``k + 1`` rows (state slots ``NO_SLOT`` and KV
            slots -1 on padding lanes).
        targets: (B (k + 1),) the main model's argmax after every row.
        acc: (B,) tokens each lane keeps, 1 + its accepted drafts.
        drafts: k arrays (B,): the next round's drafts.
        chain: k - 1 ForwardBatch of the MTP head's chained passes (tokens ``drafts[j]``).
        records: the verify pass's GDN state records.
    """

    def __init__(self, model, b: int, k: int, max_pages: int, page_size: int):
        self.b, self.k, self.page_size = b, k, page_size
        t = b * (k + 1)
        i32, i64 = np.int32, np.int64
        # inputs, then the outputs read back, then the round's own
        layout = [("ids", (t,), i32), ("pos", (t,), i32), ("cu", (b + 1,), i32),
                  ("lens", (b,), i32), ("bt", (b, max_pages), i32), ("slot64", (t,), i64),
                  ("states", (b,), i32),
                  ("targets", (t,), i32), ("acc", (b,), i32), ("drafts", (k, b), i32),
                  ("ccu", (b + 1,), i32)]
        for j in range(2, k + 1):
            layout += [(f"cpos{j}", (b,), i32), (f"clens{j}", (b,), i32),
                       (f"cslot{j}", (b,), i64)]
        offs, o = {}, 0
        for name, shape, dt in layout:
            o = -(-o // 8) * 8
            offs[name] = (o, shape, dt)
            o += int(np.prod(shape)) * np.dtype(dt).itemsize
        self.h = np.zeros(o, dtype=np.uint8)
        self.a = {n: self.h[s:s + int(np.prod(sh)) * np.dtype(dt).itemsize].view(dt).reshape(sh)
                  for n, (s, sh, dt) in offs.items()}
        self.n_in = offs["targets"][0]    # bytes the host fills
        self.out = (offs["targets"][0], offs["ccu"][0])   # bytes read back
        a = self.a
        a["slot64"][:] = -1
        a["states"][:] = NO_SLOT
        a["cu"][:] = np.arange(b + 1) * (k + 1)
        a["ccu"][:] = np.arange(b + 1)
        a["lens"][:] = 1
        self.verify = ForwardBatch(a["ids"], a["pos"], a["cu"], a["lens"], a["bt"], a["slot64"],
                                   a["states"])
        self.targets, self.acc, self.drafts = a["targets"], a["acc"], list(a["drafts"])
        self.chain = [ForwardBatch(self.drafts[j - 2], a[f"cpos{j}"], a["ccu"], a[f"clens{j}"],
                                   a["bt"], a[f"cslot{j}"]) for j in range(2, k + 1)]
        self.records = SpecRecords.new(model, a["states"], np.zeros(b), np.full(b, k + 1), k + 1)
        self.records.slots = a["states"]   # (the filled array itself, not a copy)

    def fill(self, rows) -> int:
        """Set the inputs for ``rows``: per lane ``(tokens (k + 1), n, pages, state slot)``,
        the pending token and the drafts at positions ``n .. n + k``; the rest are padding.
        The pages must hold ``n + 2 k`` positions (the chained drafts reach ``n + 2 k - 1``).
        Returns the number of lanes."""
        a, k1, ps = self.a, self.k + 1, self.page_size
        s = len(rows)
        if s > self.b:
            raise ValueError(f"{s} lanes in a round of {self.b}")
        width = a["bt"].shape[1]
        for name in ("ids", "pos", "bt"):
            a[name][:] = 0
        a["slot64"][:] = -1
        a["states"][:] = NO_SLOT
        a["lens"][:] = k1
        for i, (toks, n, pages, slot) in enumerate(rows):
            if len(toks) != k1 or len(pages) > width or len(pages) * ps < n + 2 * self.k:
                raise ValueError(f"lane row {i}: {len(toks)} tokens, {len(pages)} pages")
            r = slice(i * k1, (i + 1) * k1)
            p = np.arange(n, n + k1)
            tb = np.asarray(pages, dtype=np.int64)
            a["ids"][r] = toks
            a["pos"][r] = p
            a["slot64"][r] = tb[p // ps] * ps + p % ps
            a["lens"][i] = n + k1
            a["bt"][i, :len(pages)] = pages
            a["bt"][i, len(pages):] = -1
            a["states"][i] = slot
        return s


class Qwen35Spec:
    """The speculative passes of ``Qwen35Model`` (a mixin: ``config``, ``ops``, ``mtp``,
    ``run``, ``_attention``, ``_head``, ``check_batch`` come from the model)."""

    __slots__ = ()

    def verify(self, batch: ForwardBatch, kv, return_hidden: bool = False):
        """A speculative verification pass: ``forward`` with logits for every token that also
        records what every token does to each sequence's GDN state.

        The recurrent states stay as they were (the conv states and KV advance over all T
        tokens); call ``commit`` with the number of tokens each sequence accepts to advance
        every slot by exactly that prefix (KV entries past it are simply overwritten later).

        Returns:
            ``(logits (T, V), records)`` or, with ``return_hidden``,
            ``(logits, hidden (T, H), records)``.

        Raises:
            ValueError: as ``forward``.
        """
        slots = np.asarray(batch.state_slots if batch.state_slots is not None else [],
                           dtype=np.int64)
        cu = np.asarray(batch.cu_seqlens_q, dtype=np.int64)
        lens = np.diff(cu)
        rec = SpecRecords.new(self, slots, np.asarray(batch.positions)[cu[:-1]], lens,
                              int(lens.max()) if lens.size else 0)
        out = self.forward(batch, kv, all_logits=True, return_hidden=return_hidden,
                           _records=rec)
        return (*out, rec) if return_hidden else (out, rec)

    def commit(self, kv, records: SpecRecords, accepted) -> None:
        """Keep the first ``accepted[s]`` tokens of each sequence of a ``verify`` pass.

        Raises:
            ValueError: a count out of ``[1, lens[s]]`` (nothing is changed).
        """
        acc = np.asarray(accepted, dtype=np.int64)
        if acc.shape != records.lens.shape or (acc < 1).any() or (acc > records.lens).any():
            raise ValueError(f"accepted {acc.tolist()} must be in [1, {records.lens.tolist()}]")
        self._commit_records(kv, records, acc.astype(np.int32))
        kv.lengths[records.slots] = records.starts + acc

    def _commit_records(self, kv, records: SpecRecords, acc) -> None:
        n = len(records.ssm)
        self.ops.gdn_commit(kv.ssm[:n], kv.conv[:n], records.ssm, records.conv, records.slots,
                            acc)

    def mtp_forward(self, batch: ForwardBatch, hidden, kv, all_logits: bool = False):
        """One MTP-head pass (spec A.8): draft logits for the token after each next token.

        Token ``j`` of ``batch`` pairs ``hidden[j]``, the main model's final-normed hidden state
        at position ``p = batch.positions[j]``, with ``batch.token_ids[j]``, the token at
        position ``p + 1``; the head's attention layer writes its K/V at position ``p`` (a
        separate KV layer, same paging), so its KV must hold positions before ``p``. Chained
        drafts feed the returned hidden state back with the drafted token at ``p + 1``.

        Returns:
            ``(logits (S or T, V), mtp_hidden (T, H))``: draft logits predict the token at
            ``p + 2``; ``mtp_hidden`` is the head's final-normed output for chaining.

        Raises:
            ValueError: the model has no MTP head, or inconsistent batch arrays.
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP head (no mtp.* weights)")
        t = batch.num_tokens
        if (hidden.shape != (t, self.config.hidden_size) or batch.positions.shape[0] != t
                or int(batch.cu_seqlens_q[-1]) != t):
            raise ValueError("inconsistent MTP batch: hidden rows, positions and "
                             "cu_seqlens_q must all count the T tokens")
        x = self._mtp_body(batch, hidden, kv)
        return self._head(x, self.mtp.norm, batch.cu_seqlens_q, all_logits, True)

    def _mtp_body(self, batch: ForwardBatch, hidden, kv):
        """The MTP head's block over ``batch``'s rows, before its final norm."""
        ops, m, eps = self.ops, self.mtp, self.config.rms_norm_eps
        e = ops.embedding(self.embed, batch.token_ids)
        x = ops.fused_linear(e, m.fc_e, norm=m.norm_e, eps=eps)
        x = ops.fused_linear(hidden, m.fc_h, norm=m.norm_h, eps=eps, residual=x)
        blk = m.block
        x = self._attention(blk.mixer, blk.index, x, blk.input_norm, batch, kv)
        return ops.swiglu_mlp(x, blk.post_norm, blk.gate_up, blk.down, eps)

    def spec_round(self, io: SpecIO, kv):
        """One speculative round over ``io`` (filled; each state slot at its lane's first
        verified position), on the device: verify, accept, roll back, draft. Writes
        ``io.targets``, ``io.acc`` and ``io.drafts``; the frontiers (``kv.lengths``) are the
        caller's to move once it has read ``acc``.

        Returns:
            (B, H) the main model's final-normed hidden state at each lane's last kept
            position (the MTP row a later pass pairs with the token after it).
        """
        ops, k, ps = self.ops, io.k, io.page_size
        vb = io.verify
        logits, hidden = self.run(vb, kv, vb.state_slots, all_logits=True, return_hidden=True,
                                  _records=io.records)
        ops.argmax_into(logits, io.targets)
        ops.spec_accept(vb.token_ids, io.targets, k, io.acc)
        self._commit_records(kv, io.records, io.acc)
        tgt = ForwardBatch(io.targets, vb.positions, vb.cu_seqlens_q, vb.context_lens,
                           vb.block_tables, vb.slot_mapping)
        x = ops.spec_rows(self._mtp_body(tgt, hidden, kv), io.acc, k)
        kept = ops.spec_rows(hidden, io.acc, k)
        for j in range(1, k + 1):
            if j > 1:
                cb = io.chain[j - 2]
                ops.spec_chain(vb.positions, vb.slot_mapping, io.acc, j, vb.block_tables, ps,
                               cb.positions, cb.slot_mapping, cb.context_lens)
                x = self._mtp_body(cb, h, kv)
            logits, h = self._head(x, self.mtp.norm, io.a["ccu"], False, True)
            ops.argmax_into(logits, io.drafts[j - 1])
        return kept


@dataclass(frozen=True, slots=True)
class SpecResult:
    """What a device round gave, per lane of its rows: ``targets`` (S, k + 1), ``acc`` (S,)
    and the next ``drafts`` (S, k) as host int64, and ``kept`` (S, H) backend rows (the main
    model's hidden state at each lane's last kept position; a copy)."""
    targets: np.ndarray
    acc: np.ndarray
    drafts: np.ndarray
    kept: object


class SpecRounds:
    """Device rounds run as they are (the NumPy backend), one ``SpecIO`` per (lanes, k)."""

    def __init__(self, model, max_pages: int):
        self.model, self.max_pages = model, max_pages
        self._io: dict[tuple[int, int], SpecIO] = {}

    def run(self, rows, k: int, kv) -> SpecResult:
        """One round over ``rows`` (``SpecIO.fill``'s) with ``k`` drafts each."""
        key = (len(rows), k)
        io = self._io.get(key)
        if io is None:
            io = self._io[key] = SpecIO(self.model, len(rows), k, self.max_pages, kv.page_size)
        s = io.fill(rows)
        kept = self.model.spec_round(io, kv)
        return SpecResult(io.targets.reshape(-1, k + 1)[:s].astype(np.int64),
                          io.acc[:s].astype(np.int64),
                          np.stack(io.drafts, axis=1)[:s].astype(np.int64), kept[:s].copy())
