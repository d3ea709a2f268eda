"""The model runner: the one part of the engine that knows the model and its backend. It owns
the KV cache, builds forward batches from lanes, runs prefill and decode passes (replayed as
CUDA graphs where the model is wrapped by a ``GraphReplayer``), samples, launches decode
rounds with the lookahead, and runs the MTP head's draft and verify passes for
``speculative.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from .lanes import Lane
from .sampling import apply_penalties, sample, top_logprobs


@runtime_checkable
class GraphReplayer(Protocol):
    """A decode runner wrapping a model (``kernels/gpu/graphs.CudaGraphDecoder``): ``forward``
    replays captured CUDA graphs for pure decode batches, and ``greedy`` replays one and
    chooses each sequence's token on the device (``feed=True``: from the previous replay's
    choice, before the host has read it)."""
    enabled: bool

    def forward(self, batch, kv, all_logits: bool = False): ...

    def greedy(self, batch, kv, feed: bool = False) -> Callable[[], np.ndarray] | None: ...


def unwrap(model):
    """The model itself when ``model`` is a decode runner wrapping it (``.model``)."""
    return getattr(model, "model", model)


def ops_of(model):
    """The ops backend of ``model`` or of the model a decode runner wraps (None: NumPy)."""
    return getattr(model, "ops", None) or getattr(getattr(model, "model", None), "ops", None)


@dataclass(slots=True)
class DecodeRound:
    """A launched decode round: its lanes, their requests then, the context length each lane
    has once the round is committed (``positions``) and the launch time; either the logits
    (sampled at commit) or ``result``, a function returning the chosen ids (``fed``: chosen
    on the device, so the next round may feed on them); ``ids`` once read."""
    lanes: list
    reqs: list
    positions: list
    t0: float
    logits: object = None
    result: Callable | None = None
    fed: bool = False
    ids: np.ndarray | None = None
    feed: bool = False     # launched ahead: its tokens are the previous round's choice


def greedy_lanes(lanes: list[Lane], recurrent: bool = False) -> bool:
    """Whether every lane takes the argmax with no penalties, logprobs or drafts (the
    lookahead's condition); ``recurrent``: nor a thinking budget, whose forced closing token
    would differ from the one a round ahead fed on (a recurrent state cannot drop it)."""
    return all(ln.req.params.greedy and not ln.req.params.penalized
               and ln.req.logprobs is None and not ln.spec
               and not (recurrent and ln.thinking) for ln in lanes)


class ModelRunner:
    """Runs ``model`` for one engine (execution thread only).

    Args:
        model: a model with ``forward(ForwardBatch, kv)``, ``new_kv_cache(pages, page_size)``
            and ``is_recurrent``, or a ``GraphReplayer`` wrapping one.
        config: EngineConfig (sizing, ``decode_lookahead``).
        vocab: ids the tokenizer knows (a model head may be padded wider: never sampled).
    """

    def __init__(self, model, config, vocab: int):
        from .models.llama import ForwardBatch  # the batch layout every model shares
        self._ForwardBatch = ForwardBatch
        self.model = model
        self.config = config
        self.ops = ops_of(model)
        self.vocab = vocab
        self.recurrent = model.is_recurrent
        # hybrid models (recurrent layers) keep one state slot per lane beside the paged KV
        kw = {"max_lanes": config.max_concurrency} if self.recurrent else {}
        self.kv = model.new_kv_cache(config.num_pages, config.page_size,
                                     kv_dtype=config.kv_dtype, **kw)
        self.graphs = model if isinstance(model, GraphReplayer) else None
        la = config.decode_lookahead
        self.lookahead = (la == "on" or (
            la == "auto" and self.graphs is not None and self.graphs.enabled
            and self.vocab == model.config.vocab_size))
        self._fed_ids: np.ndarray | None = None   # the ids a forward() launch feeds on
        self._spec_rounds = None   # spec_rounds(), made on first use (False: none)

    @property
    def on_device(self) -> bool:
        """Whether ``forward`` returns before the device is done (a GPU backend)."""
        return getattr(self.ops, "name", "numpy") != "numpy"

    def batch(self, lanes: list[Lane], spans: list[tuple[int, int]], tokens=None,
              state_slots: bool = True):
        """ForwardBatch for ``lanes``, lane i computing token positions ``spans[i] = (a, b)``
        (of its own tokens, or of ``tokens[i]``); ``state_slots``: the lanes' recurrent state
        slots (hybrid models; not for the MTP head)."""
        if tokens is None:
            tokens = [ln.tokens[a:b] for ln, (a, b) in zip(lanes, spans)]
        slots = [ln.id for ln in lanes] if self.recurrent and state_slots else None
        return self._ForwardBatch.from_sequences(
            tokens, [a for a, _ in spans], [ln.pages for ln in lanes], self.config.page_size,
            state_slots=slots)

    def forward(self, batch, **kw):
        """``model.forward`` over the engine's KV cache: last-token logits ``(S, V)``."""
        return self.model.forward(batch, self.kv, **kw)

    def prefill(self, lane: Lane, a: int, b: int):
        """Compute positions ``[a, b)`` of ``lane``; the last one's logits ``(1, V)``."""
        return self.forward(self.batch([lane], [(a, b)]))

    def sample(self, lanes: list[Lane], logits) -> list[tuple]:
        """One ``(token, logprobs)`` per lane from ``logits`` ``(len(lanes), V)``; each row
        uses only its own lane's parameters, penalty state and output position.

        ``logits`` may live on a device: when every lane is greedy without penalties or
        logprobs the argmax runs there and only the ids come back; otherwise the logits are
        copied to the host for the NumPy sampler."""
        logits = logits[:, :self.vocab]  # padded head columns are never sampled
        ops = getattr(self.model, "ops", None)
        if ops is not None:
            if hasattr(ops, "argmax") and all(
                    ln.req.params.greedy and not ln.req.params.penalized
                    and ln.req.logprobs is None for ln in lanes):
                return [(int(t), None) for t in ops.argmax(logits)]
            logits = ops.to_numpy(logits)
        out = []
        for i, ln in enumerate(lanes):
            p = ln.req.params
            row = apply_penalties(logits[i], ln.counts, ln.seen, p) if p.penalized \
                else logits[i]
            tok = sample(row, p, ln.generated)
            lp = top_logprobs(logits[i], tok, ln.req.logprobs) \
                if ln.req.logprobs is not None else None
            out.append((tok, lp))
        return out

    def launch(self, lanes: list[Lane], feed: bool) -> DecodeRound:
        """Launch a decode round of ``lanes`` at their next positions (``feed``: one further,
        with the tokens the previous round chose, which only the device knows yet). Where the
        lookahead applies (``greedy_lanes``) the round chooses its tokens as it runs
        (``GraphReplayer.greedy``, else ``forward`` and ``sample``) and is marked ``fed``:
        the next round may feed on it."""
        t0 = time.monotonic()
        d = 1 if feed else 0
        spans = [(ln.num_computed + d, ln.num_computed + d + 1) for ln in lanes]
        # (fed: the tokens are the device's; placeholders here)
        batch = self.batch(lanes, spans, [[0]] * len(lanes) if feed else None)
        r = DecodeRound(lanes, [ln.req for ln in lanes], [b for _, b in spans], t0, feed=feed)
        if not (feed or (self.lookahead and greedy_lanes(lanes, self.recurrent))):
            r.logits = self.forward(batch)
            return r
        if self.graphs is not None and self.vocab == self.model.config.vocab_size:
            r.result = self.graphs.greedy(batch, self.kv, feed=feed)
        if r.result is not None:
            self._fed_ids = None
        elif not feed and self.config.decode_lookahead != "on":   # (no replay: a plain round)
            r.logits = self.forward(batch)
            return r
        else:   # forward, then the host's choice (what the device would): "on", for tests
            if feed:
                if self._fed_ids is None:
                    raise RuntimeError("decode lookahead: no chosen ids to feed on")
                batch.token_ids[:] = self._fed_ids
            logits = self.forward(batch)
            ids = np.array([t for t, _ in self.sample(lanes, logits)], dtype=np.int64)
            self._fed_ids = ids.astype(np.int32)
            r.result = lambda: ids
        r.fed = True
        return r

    # -- speculative decoding (the model's MTP head) ------------------------------------------
    def argmax(self, logits) -> np.ndarray:
        """Row-wise argmax over the tokenizer's ids, on the host ``(S,)`` int64."""
        ops = unwrap(self.model).ops
        x = logits[:, :self.vocab]
        if hasattr(ops, "argmax"):
            return np.asarray(ops.argmax(x), dtype=np.int64)
        return np.argmax(ops.to_numpy(x), axis=-1).astype(np.int64)

    def host_row(self, logits, r: int) -> np.ndarray:
        """Row ``r`` of backend ``logits`` over the tokenizer's ids, on the host ``(V,)``."""
        return np.asarray(unwrap(self.model).ops.to_numpy(logits[r, :self.vocab]))

    def forward_hidden(self, lane: Lane, a: int, b: int):
        """``prefill`` that also returns the final-normed hidden states of ``[a, b)``."""
        return unwrap(self.model).forward(self.batch([lane], [(a, b)]), self.kv,
                                          return_hidden=True)

    def mtp_forward(self, seqs, starts, lanes: list[Lane], hidden):
        """The MTP head over ``seqs[i]`` at positions from ``starts[i]`` of ``lanes[i]``, fed
        ``hidden`` rows: ``(logits, head hidden)``."""
        batch = self.batch(lanes, [(s, s + len(q)) for q, s in zip(seqs, starts)], seqs,
                           state_slots=False)
        return unwrap(self.model).mtp_forward(batch, hidden, self.kv)

    def verify(self, seqs, lanes: list[Lane]):
        """One pass of the main model over ``seqs[i]`` (the pending token and the drafts) at
        each lane's frontier: ``(logits, hidden, state records)``, every position's logits."""
        batch = self._ForwardBatch.from_sequences(
            seqs, [ln.num_computed for ln in lanes], [ln.pages for ln in lanes],
            self.config.page_size, state_slots=[ln.id for ln in lanes])
        return unwrap(self.model).verify(batch, self.kv, return_hidden=True)

    def spec_rounds(self):
        """The runner of whole speculative rounds on the device (``Qwen35Spec.spec_round``;
        CUDA graphs per (lanes, k) where a decode runner has them), or None where the model
        has none or its head is wider than the tokenizer's ids (chosen on the device)."""
        if self._spec_rounds is None:
            m = unwrap(self.model)
            if (not hasattr(m, "spec_round") or self.vocab != m.config.vocab_size
                    or (self.on_device and self.graphs is None)):
                self._spec_rounds = False
            elif self.graphs is not None and hasattr(self.graphs, "spec_rounds"):
                self._spec_rounds = self.graphs.spec_rounds()
            else:
                from .models.qwen35_spec import SpecRounds
                self._spec_rounds = SpecRounds(m, -(-self.config.max_context
                                                    // self.config.page_size))
        return self._spec_rounds or None

    def spec_round(self, lanes: list[Lane], drafts, k: int):
        """A device round over ``lanes`` (each at its frontier ``n`` with its pending token
        ``tokens[n]``, ``drafts[i]`` its k drafts, pages for ``n + 2 k`` positions): the
        ``SpecResult``; each lane's state slot then holds its ``n + acc`` kept tokens."""
        rows = [([ln.tokens[ln.num_computed]] + list(d), ln.num_computed, ln.pages, ln.id)
                for ln, d in zip(lanes, drafts)]
        for ln in lanes:
            if int(self.kv.lengths[ln.id]) != ln.num_computed:
                raise RuntimeError(f"lane {ln.id}: state slot at {int(self.kv.lengths[ln.id])}"
                                   f" tokens, frontier {ln.num_computed}")
        res = self.spec_rounds().run(rows, k, self.kv)
        for ln, a in zip(lanes, res.acc):
            self.kv.lengths[ln.id] = ln.num_computed + int(a)
        return res

    def accept(self, records, counts: list[int]) -> None:
        """Move each verified lane's recurrent state to its first ``counts[i]`` tokens."""
        unwrap(self.model).commit(self.kv, records, counts)

    def concat(self, parts):
        """Concatenate hidden-row arrays of this backend along the first axis."""
        if len(parts) == 1:
            return parts[0]
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts)
        import cupy  # a device backend's arrays
        return cupy.concatenate(parts)
