"""``ninfer bench perplexity``: a model's perplexity over a text, scored as llama.cpp's
``llama-perplexity`` scores it, and with ``--kl`` how far this configuration's next-token
distributions are from the reference configuration's (the same model with the backend's
default KV storage and fp16 prefill GEMMs): the quality side of ``--kv-dtype`` and
``--prefill-gemm``, which ``ninfer bench prefill`` times.

The text is tokenized once and cut into windows of ``ctx`` tokens (each window's first token
BOS where the model's tokenizer adds one, as llama-perplexity does). Each window is prefilled
from position 0, in passes of ``chunk`` tokens as the engine prefills, and only the tokens of
its second half are scored, so every scored token has at least ``ctx / 2`` tokens of context.

``--prefill-gemm fp8`` puts every layer's GEMMs on fp8, even a model small enough that ``serve``
keeps fp16 copies of its weights (there fp8 has no effect): what fp8 costs a model. The output
head stays on fp16, as in serving (``GpuWeight.prefill_fp8``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ROWS = 64   # scored rows turned into float64 log-probabilities at a time (memory: ROWS x vocab)


def windows(ids: list[int], ctx: int, count: int, bos: int | None) -> list[list[int]]:
    """Up to ``count`` (0: all) consecutive windows of ``ctx`` tokens of ``ids``, as
    llama-perplexity cuts them: with a BOS id, of ``[bos] + ids`` and each window's first token
    replaced by BOS; a partial window at the end is dropped.

    Raises:
        ValueError: ``ctx`` < 4 (a window needs a context half and a scored half), or the
            text holds no whole window.
    """
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4, got {ctx}")
    seq = [bos] + ids if bos is not None else ids
    n = len(seq) // ctx
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {ctx} "
                         "(a longer --text, or a smaller --ctx)")
    n = min(n, count) if count else n
    wins = [seq[i * ctx:(i + 1) * ctx] for i in range(n)]
    return [[bos] + w[1:] for w in wins] if bos is not None else wins


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities of float logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def window_logits(bm, kv, window: list[int], chunk: int | None) -> np.ndarray:
    """(len(window) - 1 - first, vocab) float32 host logits of the scored rows of ``window``
    (rows ``first .. ctx - 2``, ``first = ctx // 2``: each predicts the next token), prefilled
    from position 0 into ``kv`` in passes of ``chunk`` tokens (None: one pass)."""
    from ninfer.bench.model import PAGE_SIZE, pages
    from ninfer.engine.models.llama import ForwardBatch

    ctx, first = len(window), len(window) // 2
    step = chunk or ctx
    table = list(range(pages(ctx)))
    slots = bm.slots(kv, 1)
    rows = []
    for a in range(0, ctx, step):
        batch = ForwardBatch.from_sequences([window[a:a + step]], [a], [table], PAGE_SIZE, slots)
        out = bm.base.forward(batch, kv, all_logits=True)
        lo, hi = max(first - a, 0), min(ctx - 1 - a, len(window[a:a + step]))
        if lo < hi:
            rows.append(np.asarray(bm.ops.to_numpy(out[lo:hi]), dtype=np.float32))
    return np.concatenate(rows)


@dataclass(slots=True)
class Scores:
    """Per scored token: ``nll`` (-log p of the text's token), and against the reference
    ``kl`` (KL(reference || this)), ``same_top`` (the argmax tokens agree) and ``ref_nll``."""
    nll: list[float]
    kl: list[float]
    same_top: list[bool]
    ref_nll: list[float]

    def add(self, logits: np.ndarray, targets: list[int], ref: np.ndarray | None) -> None:
        for a in range(0, len(targets), ROWS):
            lp = log_softmax(logits[a:a + ROWS])
            t = np.asarray(targets[a:a + ROWS])
            self.nll += (-lp[np.arange(len(t)), t]).tolist()
            if ref is None:
                continue
            rp = log_softmax(ref[a:a + ROWS])
            self.ref_nll += (-rp[np.arange(len(t)), t]).tolist()
            self.kl += np.maximum((np.exp(rp) * (rp - lp)).sum(axis=-1), 0.0).tolist()
            self.same_top += (rp.argmax(axis=-1) == lp.argmax(axis=-1)).tolist()


def ppl_summary(nll: list[float]) -> dict:
    """``ppl`` = exp(mean NLL) and its standard error (llama-perplexity's: ppl x the mean's
    standard error), over ``tokens`` scored tokens."""
    x = np.asarray(nll, dtype=np.float64)
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0
    ppl = math.exp(float(x.mean()))
    return {"ppl": round(ppl, 4), "ppl_se": round(ppl * se, 4), "mean_nll": float(x.mean()),
            "tokens": len(x)}


def kl_summary(s: Scores) -> dict:
    """Against the reference: KL divergence (mean, median, 99th percentile, max, in nats), the
    share of tokens whose top token agrees, and the reference's perplexity and ln(PPL / PPL
    reference)."""
    kl = np.asarray(s.kl, dtype=np.float64)
    ref = ppl_summary(s.ref_nll)
    return {"kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "same_top": round(float(np.mean(s.same_top)), 6), "ref_ppl": ref["ppl"],
            "ln_ppl_ratio": float(np.mean(s.nll)) - ref["mean_nll"]}


def measure(bm, wins: list[list[int]], *, chunk: int | None, ref=None, log=print) -> dict:
    """Perplexity of ``bm`` over the windows ``wins`` (``windows``) -> ``{"perplexity": {...}}``
    (``ppl_summary`` plus ``windows``, ``ctx``), with ``"kl"`` (``kl_summary``) when ``ref``
    (the reference configuration's model, same weights) is given."""
    ctx = len(wins[0])
    kv = bm.new_kv(1, ctx)
    ref_kv = ref.new_kv(1, ctx) if ref is not None else None
    s = Scores([], [], [], [])
    for i, w in enumerate(wins):
        got = window_logits(bm, kv, w, chunk)
        base = window_logits(ref, ref_kv, w, chunk) if ref is not None else None
        s.add(got, w[ctx // 2 + 1:], base)
        log(f"window {i + 1}/{len(wins)}: ppl so far {math.exp(float(np.mean(s.nll))):.4f}")
    out = {"perplexity": ppl_summary(s.nll) | {"windows": len(wins), "ctx": ctx}}
    if ref is not None:
        out["kl"] = kl_summary(s)
    return out


def run(cfg, backend: str, log=print) -> dict:
    """``ninfer bench perplexity`` for ``cfg`` (``cli.BenchConfig``) on ``backend``: the text
    tokenized and cut into windows first, then the model under test (``--kv-dtype``,
    ``--prefill-gemm``) and, with ``cfg.kl``, the reference (the backend's default KV storage,
    fp16 GEMMs) loaded beside it, from one reading of the file -> the result's fields.

    Raises:
        ValueError: the text file cannot be read, is not UTF-8, or holds no whole window
            (``windows``); the model's errors as ``bench.model.load``.
    """
    from pathlib import Path

    from ninfer.bench import model as bench_model
    from ninfer.engine import kv_dtypes
    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.server import prefill_gemm, resolve_model_path
    from ninfer.store.artifact import load_model_file

    try:
        text = Path(cfg.text).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {cfg.text}: not UTF-8 ({exc.reason} at byte {exc.start})")
    except OSError as exc:
        raise ValueError(f"--text {cfg.text}: {exc.strerror or exc}")
    art = load_model_file(resolve_model_path(cfg.model))
    tok = Tokenizer.from_dict(art.tokenizer)
    ids = tok.encode(text, parse_special=False)
    trained = art.config.get("max_position_embeddings")
    beyond = f"--ctx {cfg.ctx} is beyond the model's trained context ({trained})"
    try:
        wins = windows(ids, cfg.ctx, cfg.windows, tok.bos_id if tok.add_bos else None)
    except ValueError as exc:   # (say first the --ctx that no text of this model needs)
        raise ValueError(f"{beyond}; {exc}" if trained and cfg.ctx > trained else str(exc))
    if trained and cfg.ctx > trained:
        log(f"note: {beyond}")
    kw = dict(max_positions=cfg.ctx, max_batch=1, cuda_graph=False, artifact=art)
    fp8 = cfg.prefill_gemm == "fp8"   # (every layer's GEMMs: no fp16 copies kept to bypass it)
    bm = bench_model.load(cfg.model, backend, kv_dtype=kv_dtypes.resolve(cfg.kv_dtype, backend),
                          prefill_fp8=fp8, keep_f16=not fp8, **kw)
    ref = None
    if cfg.kl:
        ref = bench_model.load(cfg.model, backend, kv_dtype=kv_dtypes.resolve("auto", backend),
                               **kw)
    out = {"model": str(bm.path), "backend": bm.backend,
           "device": bench_model.device_name(bm.backend), "kv_dtype": bm.kv_dtype,
           **prefill_gemm(bm.ops), "load_s": round(bm.load_s, 1), "text": str(cfg.text),
           "text_tokens": len(ids), "chunk": cfg.chunk}
    if ref is not None:
        out["reference"] = {"kv_dtype": ref.kv_dtype, **prefill_gemm(ref.ops)}
    return out | measure(bm, wins, chunk=cfg.chunk, ref=ref, log=log)
