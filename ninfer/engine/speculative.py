"""MTP speculative decoding for the engine (``--spec mtp --draft-tokens k``).

A speculative round over a set of lanes (``MtpSpeculator.round``; greedy ones as below,
sampled ones by the rejection rule of ``spec_sampling``):

1. **Draft.** The model's MTP head drafts up to k tokens per lane by chained
   ``mtp_forward`` passes. The first pass also fills the head's own KV with the positions the
   previous round (or the prefill) accepted: each lane carries ``mtp_pending`` (``MtpRows``:
   ``start``, ``hidden``), the main model's final-normed hidden states of positions
   ``start .. n - 1`` whose next tokens (``lane.tokens[start + 1 .. n]``) are committed,
   where ``n = lane.num_computed``.
   The last of those rows pairs the last computed position with the pending token and gives
   the first draft; each further pass feeds back the head's own hidden state and the drafted
   token.
2. **Verify.** One batched ``verify`` pass of the main model over ``[pending token, d_1 .. d_k]``
   at positions ``n .. n + k`` of every lane gives the target argmax after every prefix, the
   hidden states, and per-token GDN state records.
3. **Accept.** ``a`` = the longest prefix of drafts equal to the targets; the lane commits
   ``d_1 .. d_a`` and the target after them (``a + 1`` tokens). ``commit`` moves each lane's
   GDN state to exactly those ``a + 1`` tokens (KV entries past them are overwritten later),
   so ``lane.num_computed == kv.lengths[lane] == n + a + 1``, and the hidden rows of positions
   ``n .. n + a`` become the lane's new ``mtp_pending``.
4. **Commit.** The tokens go through ``Output.commit`` one by one, so stop tokens,
   stop strings, ``max_tokens`` and the context limit end the request exactly where plain
   decoding would (later tokens are discarded with the lane).

Greedy output is therefore identical with and without speculation. Drafts are capped per
lane so that a round never computes past ``max_tokens`` or ``max_context``.

Lanes with room for all k drafts (and pages for ``n + 2 k`` positions) take the round on the
device instead (``device_round``: ``ModelRunner.spec_round``, ``Qwen35Spec.spec_round``): one
pass verifies, accepts, moves the GDN state to the accepted prefix and drafts the next k
tokens, so a lane's ``mtp_pending`` then holds its last kept row and ``drafts``, which the next
device round verifies without drafting first.

Invariant between rounds, per speculative lane: the main KV and GDN state hold positions
``0 .. n - 1``, the MTP layer's KV holds positions ``0 .. start - 1`` and ``mtp_pending``
covers ``start .. n - 1``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .kv import OutOfPages
from .lanes import Lane, LanePool, MtpRows
from .output import Output
from .runner import ModelRunner, unwrap
from .spec_sampling import accept_sampled, sample_draft

MAX_DRAFT_TOKENS = 5


def accept_length(drafts, targets) -> int:
    """How many leading ``drafts`` equal ``targets`` (``targets[i]``: the model's choice after
    the first ``i`` drafts; ``len(targets) >= len(drafts)``)."""
    a = 0
    while a < len(drafts) and int(drafts[a]) == int(targets[a]):
        a += 1
    return a


@dataclass(frozen=True, slots=True)
class SpecOutcome:
    """What a speculative round did: per lane of ``lanes``, the drafts made and accepted;
    ``committed``: tokens committed in all (a finished lane's rest is discarded);
    ``accepted_per_position[j]``: lanes whose draft j + 1 was accepted; ``itl``: seconds since
    each lane's previous token; ``t1``: when the verify pass was done."""
    lanes: list
    drafted: list
    accepted: list
    accepted_per_position: list
    committed: int
    itl: list
    t1: float


class MtpSpeculator:
    """Speculative decoding with a model's MTP head.

    Args:
        runner: the ModelRunner (draft, verify and accept passes; argmax).
        lanes: the LanePool (pages for the drafted positions).
        output: where the accepted tokens are committed (and a lane without pages fails).
        draft_tokens: k, drafts per round (1..5).
    """

    def __init__(self, runner: ModelRunner, lanes: LanePool, output: Output,
                 draft_tokens: int):
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {draft_tokens}")
        self.runner, self.lanes, self.output = runner, lanes, output
        self.k = draft_tokens
        self.rounds = 0

    @staticmethod
    def supports(model) -> bool:
        """Whether ``model`` (or the model a decode runner wraps) has an MTP head and
        speculative verify / commit."""
        m = unwrap(model)
        return getattr(m, "mtp", None) is not None and hasattr(m, "verify") \
            and hasattr(m, "commit") and hasattr(m, "mtp_forward")

    @staticmethod
    def eligible(req) -> bool:
        """Requests decoded speculatively: no penalties, no logprobs, no thinking budget
        (those need the per-token sampling path); greedy ones, or sampled by the rejection
        rule (``spec_sampling``)."""
        p = req.params
        return not p.penalized and req.logprobs is None and req.think_budget is None

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, lane: Lane, a: int, b: int):
        """A prefill chunk ``[a, b)`` of a speculative lane: the main pass (keeping the hidden
        states), then the MTP head over the chunk's positions whose next token is a prompt
        token; the final chunk's rows wait as ``mtp_pending`` for the first sampled token.
        Returns the chunk's last-token logits ``(1, V)`` and its last hidden row ``(1, H)``
        (a checkpoint at ``b`` keeps it: ``Checkpoint.mtp_row``)."""
        logits, hidden = self.runner.forward_hidden(lane, a, b)
        if b < lane.prompt_len:
            self.runner.mtp_forward([lane.tokens[a + 1:b + 1]], [a], [lane], hidden)
            lane.mtp_pending = None
        else:
            lane.mtp_pending = MtpRows(a, hidden)
        return logits, hidden[b - a - 1:b - a].copy()   # (not a view keeping the chunk's)

    def resume(self, lane: Lane) -> None:
        """Continue a retained lane (prefix reuse at its exact frontier ``n``) for a new
        prompt: the pending MTP rows it kept (positions ``start .. n - 1``) enter the head's KV
        paired with the new prompt's tokens ``start + 1 .. n``, exactly as the first draft of
        a round would have flushed them, so the head's KV covers ``0 .. n - 1`` before the
        prompt's suffix is prefilled."""
        start, h = lane.mtp_pending.start, lane.mtp_pending.hidden
        n = lane.num_computed
        if start + h.shape[0] != n or len(lane.tokens) <= n:   # (a checkpoint's: n - 1, 1 row)
            raise RuntimeError(f"lane {lane.id}: MTP rows cover {start}..{start + h.shape[0]}"
                               f", {n} tokens computed, prompt of {len(lane.tokens)}")
        self.runner.mtp_forward([lane.tokens[start + 1:n + 1]], [start], [lane], h)
        lane.mtp_pending = None

    # -- one round ------------------------------------------------------------------------------
    def draft(self, lanes, ks) -> tuple[list[list[int]], list]:
        """MTP drafts: ``ks[i]`` tokens for lane i (chained ``mtp_forward``), the head's argmax
        or, for a sampled request, a draw from its filtered distribution; also flushes each
        lane's ``mtp_pending`` rows into the head's KV. Returns ``(drafts, dists)``:
        ``dists[i]`` the draft distributions of a sampled lane i (None for greedy)."""
        seqs, starts, hid = [], [], []
        for ln in lanes:
            start, h = ln.mtp_pending.start, ln.mtp_pending.hidden
            n = ln.num_computed
            if start + h.shape[0] != n:
                raise RuntimeError(f"lane {ln.id}: MTP rows cover {start}..{start + h.shape[0]}"
                                   f" but {n} tokens are computed")
            seqs.append(ln.tokens[start + 1:n + 1])
            starts.append(start)
            hid.append(h)
            ln.mtp_pending = None
        logits, mh = self.runner.mtp_forward(seqs, starts, lanes, self.runner.concat(hid))
        last = np.cumsum([len(s) for s in seqs]) - 1
        h = mh[last]  # row r: the head's output at lane rows[r]'s newest position
        dists = [None if ln.req.params.greedy else [] for ln in lanes]
        drafts = [[] for _ in lanes]
        rows = list(range(len(lanes)))
        self._choose(lanes, rows, ks, logits, drafts, dists, 1)
        for j in range(2, max(ks, default=0) + 1):
            keep = [r for r, i in enumerate(rows) if ks[i] >= j]
            if len(keep) < len(rows):
                h = h[np.asarray(keep, dtype=np.int64)]
                rows = [rows[r] for r in keep]
            # draft j-1 is the token at n + j - 1; it pairs with the state of position n + j - 2
            logits, h = self.runner.mtp_forward([[drafts[i][-1]] for i in rows],
                                                [lanes[i].num_computed + j - 2 for i in rows],
                                                [lanes[i] for i in rows], h)
            self._choose(lanes, rows, ks, logits, drafts, dists, j)
        return drafts, dists

    def _choose(self, lanes, rows, ks, logits, drafts, dists, j: int) -> None:
        """Draft j of each lane ``rows[r]`` (that wants one) from logits row r: the argmax, or
        a draw for a sampled lane (output index ``generated + j - 1``)."""
        ids = self.runner.argmax(logits)
        for r, i in enumerate(rows):
            if ks[i] < j:
                continue
            if dists[i] is None:
                drafts[i].append(int(ids[r]))
                continue
            ln = lanes[i]
            row = self.runner.host_row(logits, r)
            tok, dist = sample_draft(row, ln.req.params, ln.generated + j - 1)
            drafts[i].append(tok)
            dists[i].append(dist)

    def propose(self, lanes, drafts) -> list[list[int]]:
        """The drafts a round verifies, given the MTP head's: the head's own (tests and
        benchmarks put a known draft source here, e.g. the target's greedy tokens)."""
        return drafts

    def round(self, lanes) -> SpecOutcome | None:
        """One speculative round over ``lanes`` (decode-ready, speculative, each with
        ``mtp_pending``): draft, verify, accept, commit. Lanes with room for k drafts and 2 k
        positions run it on the device (``device_round``), the rest host-driven with their
        drafts capped (``host_round``). None when no lane could run."""
        max_context = self.runner.config.max_context
        ps = self.runner.config.page_size
        dev, ok, ks = [], [], []
        device = self.runner.spec_rounds() is not None
        for ln in lanes:
            n = ln.num_computed
            k = max(0, min(self.k, max_context - n - 1,
                           ln.req.max_tokens - ln.generated - 1))
            if device and ln.req.params.greedy and k == self.k and n + 2 * k <= max_context:
                try:
                    self.lanes.ensure_pages(ln, n + 2 * k)
                    dev.append(ln)
                    continue
                except OutOfPages:
                    pass
            try:
                self.lanes.ensure_pages(ln, n + k + 1)
            except OutOfPages:
                k = min(k, len(ln.pages) * ps - n - 1)  # as many drafts as held pages take
                if k < 0:
                    self.output.fail(ln, "kv_cache_full", "no free KV pages for this request")
                    continue
            ok.append(ln)
            ks.append(k)
        if not ok and not dev:
            return None
        runs = [self.device_round(dev), self.host_round(ok, ks)]
        lanes = dev + ok
        drafted = [x for r in runs for x in r[0]]
        accepted = [x for r in runs for x in r[1]]
        new_tokens = [x for r in runs for x in r[2]]
        t1 = time.monotonic()
        itl = [t1 - ln.last_token_t for ln in lanes]
        committed = 0
        for ln, d, a, toks in zip(lanes, drafted, accepted, new_tokens):
            ln.draft_n += d
            ln.draft_n_accepted += a
            for tok in toks:
                self.output.commit(ln, (tok, None), t1)
                committed += 1
                if ln.req is None:  # finished: the rest of the run is discarded
                    break
        self.rounds += 1
        return SpecOutcome(lanes=lanes, drafted=drafted, accepted=accepted,
                           accepted_per_position=[sum(a > j for a in accepted)
                                                  for j in range(self.k)],
                           committed=committed, itl=itl, t1=t1)

    def device_round(self, lanes) -> tuple[list, list, list]:
        """k drafts per lane verified, accepted and drafted again on the device
        (``ModelRunner.spec_round``); lanes without drafts from the previous device round draft
        first here. Returns per lane (drafts made, drafts accepted, tokens to commit)."""
        if not lanes:
            return [], [], []
        k = self.k
        need = [ln for ln in lanes if ln.mtp_pending.drafts is None]
        fresh = dict(zip((ln.id for ln in need), self.draft(need, [k] * len(need))[0])) \
            if need else {}
        drafts = []
        for ln in lanes:
            drafts.append(fresh[ln.id] if ln.id in fresh else list(ln.mtp_pending.drafts))
            ln.mtp_pending = None
        res = self.runner.spec_round(lanes, self.propose(lanes, drafts), k)
        accepted, new_tokens = [], []
        for i, ln in enumerate(lanes):
            a = int(res.acc[i]) - 1
            accepted.append(a)
            new_tokens.append([int(t) for t in res.targets[i, :a + 1]])
            ln.num_computed += a + 1
            ln.mtp_pending = MtpRows(ln.num_computed - 1, res.kept[i:i + 1],
                                     tuple(int(t) for t in res.drafts[i]))
        return [k] * len(lanes), accepted, new_tokens

    def host_round(self, lanes, ks) -> tuple[list, list, list]:
        """Drafts (``ks[i]`` for lane i), one verify pass, acceptance and the recurrent state's
        rollback driven from the host. Returns per lane (drafts made, drafts accepted, tokens
        to commit)."""
        if not lanes:
            return [], [], []
        drafts, dists = self.draft(lanes, ks)
        greedy = [i for i, dd in enumerate(dists) if dd is None]
        for i, d in zip(greedy, self.propose([lanes[i] for i in greedy],
                                             [drafts[i] for i in greedy])):
            drafts[i] = d
        logits, hidden, rec = self.runner.verify(
            [[ln.tokens[ln.num_computed]] + d for ln, d in zip(lanes, drafts)], lanes)
        targets = self.runner.argmax(logits)
        accepted, new_tokens, off = [], [], 0
        for ln, d, dd in zip(lanes, drafts, dists):
            if dd is None:
                tg = targets[off:off + len(d) + 1]
                a = accept_length(d, tg)
                toks = d[:a] + [int(tg[a])]
            else:
                rows = np.stack([self.runner.host_row(logits, off + r)
                                 for r in range(len(d) + 1)])
                a, toks = accept_sampled(d, dd, rows, ln.req.params, ln.generated)
            accepted.append(a)
            new_tokens.append(toks)
            ln.mtp_pending = MtpRows(ln.num_computed, hidden[off:off + a + 1])
            off += len(d) + 1
        self.runner.accept(rec, [a + 1 for a in accepted])
        for ln, a in zip(lanes, accepted):
            ln.num_computed += a + 1
        return [len(d) for d in drafts], accepted, new_tokens
