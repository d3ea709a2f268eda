"""Speculative decoding with the Qwen3.5 MTP head in the engine (``EngineConfig(spec="mtp")``):
greedy output through the engine is identical with and without speculation (batched lanes,
chunked prefill, max_tokens inside an accepted run, stop tokens and stop strings), and the
acceptance accounting (``spec.round``, ``request.finished``, FinalOutput) is consistent.

Tiny random checkpoint built with transformers (as test_engine_hybrid) plus random ``mtp.*``
weights (transformers has no MTP module). Random drafts are almost never right, so acceptance
is exercised with an oracle drafter: the MTP head still runs (its KV stays filled), then its
drafts are replaced by the known greedy continuation, corrupted at random positions."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ninfer.engine.engine import Engine, EngineConfig, FinalOutput, Request, TokenOutput
from ninfer.engine.sampling import SamplingParams
from ninfer.engine.speculative import MtpSpeculator, accept_length
from ninfer.events.bus import EventBus
from ninfer.store.quant import QuantTensor
from test_engine import Records  # same folder
from test_qwen35_vs_transformers import (  # same folder
    VOCAB, byte_level_tokenizer, make_checkpoint)

pytestmark = pytest.mark.slow


def mtp_weights(c, rng) -> dict:
    """Random ``mtp.*`` tensors for config ``c`` (one full-attention MTP layer)."""
    h, inter, nh, nkv, hd = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                             c.num_key_value_heads, c.head_dim)
    m = lambda n, k: rng.standard_normal((n, k)) / k ** 0.5  # noqa: E731
    p = "mtp.layers.0."
    w = {"mtp.fc.weight": m(h, 2 * h),
         "mtp.pre_fc_norm_embedding.weight": rng.standard_normal(h) * 0.2,
         "mtp.pre_fc_norm_hidden.weight": rng.standard_normal(h) * 0.2,
         "mtp.norm.weight": rng.standard_normal(h) * 0.2,
         p + "input_layernorm.weight": rng.standard_normal(h) * 0.2,
         p + "post_attention_layernorm.weight": rng.standard_normal(h) * 0.2,
         p + "self_attn.q_proj.weight": m(2 * nh * hd, h),
         p + "self_attn.k_proj.weight": m(nkv * hd, h),
         p + "self_attn.v_proj.weight": m(nkv * hd, h),
         p + "self_attn.o_proj.weight": m(h, nh * hd),
         p + "self_attn.q_norm.weight": rng.standard_normal(hd) * 0.2,
         p + "self_attn.k_norm.weight": rng.standard_normal(hd) * 0.2,
         p + "mlp.gate_proj.weight": m(inter, h),
         p + "mlp.up_proj.weight": m(inter, h),
         p + "mlp.down_proj.weight": m(h, inter)}
    return {k: QuantTensor("f32", v.shape, data=np.ascontiguousarray(v, dtype=np.float32))
            for k, v in w.items()}


@pytest.fixture(scope="module")
def mtp_bundle(tmp_path_factory, backend):
    """(model with an MTP head, byte tokenizer, artifact, folder)."""
    from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model
    from ninfer.kernels import get_ops
    from ninfer.store.artifact import load_model_file
    folder = tmp_path_factory.mktemp("hybrid_mtp")
    make_checkpoint(folder, "l4_gqa2_hv2x", seed=5)
    art = load_model_file(folder)
    cfg = Qwen35Config.from_dict(art.config)
    weights = dict(art.tensors) | mtp_weights(cfg, np.random.default_rng(7))
    model = Qwen35Model(cfg, weights, get_ops(backend))
    assert model.mtp is not None and MtpSpeculator.supports(model)
    tok = byte_level_tokenizer()
    return model, tok, art, folder


@pytest.fixture(scope="module")
def mtp_model(mtp_bundle):
    return mtp_bundle[:2]


def make_engine(model, tok, bus, config: EngineConfig, cuda_graph: bool = True) -> Engine:
    """An engine as the server builds it: on the GPU the model runs under its decode runner
    (CUDA graphs for decode batches and whole speculative rounds)."""
    from ninfer.server import decode_model
    return Engine(decode_model(model, config, cuda_graph)[0], tok, bus, config)


def run(mtp_model, prompts, max_tokens=20, tok=None, oracle=None, stop=(), ignore_eos=True,
        cuda_graph=True, **cfg):
    """Serve ``prompts`` together; returns (token ids per request, finals, records, engine).
    ``oracle``: (truth token lists, rng[, p]): replace the MTP drafts by the truth, one draft
    corrupted with probability p (default 0.5)."""
    model, tok0 = mtp_model
    tok = tok or tok0
    bus = EventBus()
    rec = Records()
    bus.add_sink(rec)
    engine = make_engine(model, tok, bus, EngineConfig(**({"max_context": 512} | cfg)),
                         cuda_graph)
    if oracle is not None:
        truth, rng, p_bad = (*oracle, 0.5)[:3]
        def propose(lanes, drafts):  # the head runs as usual; its drafts are replaced
            out = []
            ks = [len(d) for d in drafts]
            for ln, k in zip(lanes, ks):
                i = int(ln.req.request_id[1:])
                d = (truth[i][ln.generated:ln.generated + k] + [0] * k)[:k]
                if k and p_bad and rng.random() < p_bad:
                    j = int(rng.integers(k))
                    d[j] = (d[j] + 1 + int(rng.integers(255))) % 256
                out.append(d)
            return out

        engine.spec.propose = propose
    outs = []
    for i, p in enumerate(prompts):
        outs.append([])
        engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens,
                              outs[-1].append, ignore_eos=ignore_eos, stop=stop))
    while engine.step():
        bus.flush()
        for ln in engine.lanes:  # the engine's and the model's frontiers agree after each step
            if ln.req is not None and ln.spec:
                assert engine.kv.lengths[ln.id] == ln.num_computed
                assert len(ln.tokens) == ln.num_computed + 1 or ln.prefilling
    bus.flush()
    assert engine.idle()
    engine.check_integrity()
    assert all(isinstance(o[-1], FinalOutput) for o in outs)
    ids = [[t.token_id for t in o if isinstance(t, TokenOutput)] for o in outs]
    return ids, [o[-1] for o in outs], rec, engine


def prompts_of(seed, lens=(37, 90, 5)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lens]


def check_accounting(rec, finals, k, max_tokens, lanes_of):
    """drafted per lane per round = min(k, tokens still to go - 1); accepted <= drafted;
    accepted_per_position non-increasing; per-request totals on FinalOutput and
    request.finished; scheduler.round of a spec round counts the committed tokens."""
    rounds = rec.kinds("spec.round")
    assert rounds
    gen = {lane: 1 for lane in lanes_of}  # the first token comes from prefill
    drafted = {lane: 0 for lane in lanes_of}
    accepted = {lane: 0 for lane in lanes_of}
    for r in rounds:
        assert len(r.lanes) == len(r.drafted) == len(r.accepted)
        assert len(r.accepted_per_position) == k
        assert all(a >= b for a, b in zip(r.accepted_per_position, r.accepted_per_position[1:]))
        assert r.accepted_per_position == [sum(a > j for a in r.accepted) for j in range(k)]
        for lane, d, a in zip(r.lanes, r.drafted, r.accepted):
            assert 0 <= a <= d == min(k, max_tokens - gen[lane] - 1)
            gen[lane] = min(gen[lane] + a + 1, max_tokens)
            drafted[lane] += d
            accepted[lane] += a
    done = {e.lane: e for e in rec.kinds("request.finished")}
    for f in finals:
        assert f.draft_n == drafted[f.lane] == done[f.lane].draft_n
        assert f.draft_n_accepted == accepted[f.lane] == done[f.lane].draft_n_accepted
        assert f.completion_tokens == gen[f.lane] == max_tokens
    sched = {r.round: r for r in rec.kinds("scheduler.round")}
    for r in rounds:
        assert sched[r.round].lanes == r.lanes
        assert sched[r.round].tokens <= sum(a + 1 for a in r.accepted)


def test_accept_length():
    assert accept_length([], [5]) == 0
    assert accept_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_length([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accept_length([7, 2], [1, 2, 3]) == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_spec_greedy_equals_plain_greedy(mtp_model, k):
    prompts = prompts_of(0)
    plain, _, _, eng = run(mtp_model, prompts, max_concurrency=3)
    assert eng.spec is None
    got, finals, rec, eng = run(mtp_model, prompts, max_concurrency=3, spec="mtp",
                                draft_tokens=k)
    assert eng.spec is not None and got == plain
    check_accounting(rec, finals, k, 20, [f.lane for f in finals])
    chunked, finals, rec, _ = run(mtp_model, prompts, max_concurrency=3, prefill_chunk=7,
                                  spec="mtp", draft_tokens=k)
    assert chunked == plain
    check_accounting(rec, finals, k, 20, [f.lane for f in finals])
    # one lane serving the requests one after another (state and MTP rows reset on admission)
    assert run(mtp_model, prompts, max_concurrency=1, spec="mtp", draft_tokens=k)[0] == plain


@pytest.mark.parametrize("k", [1, 3, 5])
def test_spec_with_accepted_drafts(mtp_model, k):
    """Oracle drafts (the true continuation, corrupted half the time): long accepted runs,
    max_tokens cutting inside them, chunked prefill, mixed batches."""
    prompts = prompts_of(1)
    truth, _, _, _ = run(mtp_model, prompts, max_tokens=40, max_concurrency=3)
    rng = np.random.default_rng(k)
    for max_tokens in (23, 17):
        for chunk in (512, 11):
            got, finals, rec, _ = run(mtp_model, prompts, max_tokens=max_tokens,
                                      oracle=(truth, rng), max_concurrency=3,
                                      prefill_chunk=chunk, spec="mtp", draft_tokens=k)
            assert got == [t[:max_tokens] for t in truth]
            check_accounting(rec, finals, k, max_tokens, [f.lane for f in finals])
            total_d = sum(f.draft_n for f in finals)
            total_a = sum(f.draft_n_accepted for f in finals)
            assert 0 < total_a < total_d  # both accepted and rejected drafts
            if k > 1:  # accepted runs longer than one token happened
                assert any(max(r.accepted) >= 2 for r in rec.kinds("spec.round"))


def test_spec_rounds_without_cuda_graphs(mtp_model):
    """--no-cuda-graph: the device rounds run eagerly over the same buffers (on the GPU), with
    the same tokens."""
    prompts = prompts_of(1)
    truth = run(mtp_model, prompts, max_concurrency=3)[0]
    got, finals, _, eng = run(mtp_model, prompts, max_concurrency=3, spec="mtp",
                              draft_tokens=3, oracle=(truth, np.random.default_rng(1)),
                              cuda_graph=False)
    assert got == truth and sum(f.draft_n_accepted for f in finals) > 0
    assert eng.runner.spec_rounds() is not None


@pytest.mark.parametrize("k", [2, 5])
def test_spec_stops_exactly_where_plain_decoding_stops(mtp_model, k):
    model, tok = mtp_model
    prompts = prompts_of(2)
    truth, _, _, _ = run(mtp_model, prompts, max_tokens=30, max_concurrency=3)
    # a stop token: the first occurrence of a token of the first request at an output index
    # that exact drafts reach in the middle of a round (rounds of k + 1 after the first token)
    i = next(i for i in range(3, 30) if truth[0][i] not in truth[0][:i] and i % (k + 1))
    stop_tok = copy.copy(tok)
    stop_tok.stop_ids = frozenset({truth[0][i]})
    plain, pf, _, _ = run(mtp_model, prompts, max_tokens=30, tok=stop_tok, ignore_eos=False,
                          max_concurrency=3)
    # the stop token ends the request (counted, never delivered as text)
    assert plain[0] == truth[0][:i] and pf[0].engine_reason == "stop_token"
    assert pf[0].completion_tokens == i + 1
    for oracle in (None, (truth, np.random.default_rng(k)), (truth, None, 0.0)):
        got, gf, rec, _ = run(mtp_model, prompts, max_tokens=30, tok=stop_tok, oracle=oracle,
                              ignore_eos=False, max_concurrency=3, spec="mtp", draft_tokens=k)
        assert got == plain
        assert [(f.engine_reason, f.completion_tokens, f.text) for f in gf] == \
            [(f.engine_reason, f.completion_tokens, f.text) for f in pf]
        if oracle is not None and oracle[-1] == 0.0:  # the last run went past the stop token
            lane = gf[0].lane
            produced = 1 + sum(a + 1 for r in rec.kinds("spec.round")
                               for ln, a in zip(r.lanes, r.accepted) if ln == lane)
            assert produced > gf[0].completion_tokens
    # a stop string taken from the middle of the second request's text
    text = tok.decode(truth[1], skip_special=True)
    stop = (text[8:10],)
    plain, pf, _, _ = run(mtp_model, prompts, max_tokens=30, stop=stop, max_concurrency=3)
    got, gf, _, _ = run(mtp_model, prompts, max_tokens=30, stop=stop, max_concurrency=3,
                        oracle=(truth, np.random.default_rng(k)), spec="mtp", draft_tokens=k)
    assert pf[1].engine_reason == "stop_string"
    assert got == plain
    assert [(f.engine_reason, f.completion_tokens, f.text) for f in gf] == \
        [(f.engine_reason, f.completion_tokens, f.text) for f in pf]


def test_spec_at_the_context_end(mtp_model):
    """Drafts are capped so that a round never computes past max_context."""
    prompts = prompts_of(4, (37, 50, 21))
    plain, pf, _, _ = run(mtp_model, prompts, max_tokens=200, max_concurrency=3,
                          page_size=8, max_context=80)
    truth = run(mtp_model, prompts, max_tokens=200, max_concurrency=3)[0]
    for oracle in (None, (truth, np.random.default_rng(0), 0.2)):
        got, gf, _, _ = run(mtp_model, prompts, max_tokens=200, oracle=oracle,
                            max_concurrency=3, page_size=8, max_context=80, spec="mtp",
                            draft_tokens=5)
        assert got == plain
        assert [f.engine_reason for f in gf] == ["context_capacity"] * 3
        assert [f.completion_tokens for f in gf] == [f.completion_tokens for f in pf]


def test_non_greedy_lanes_decode_normally_beside_spec_lanes(mtp_model):
    model, tok = mtp_model
    prompts = prompts_of(3)
    bus = EventBus()
    rec = Records()
    bus.add_sink(rec)

    def serve(spec):
        engine = Engine(model, tok, bus, EngineConfig(max_context=512, max_concurrency=3,
                                                      spec=spec))
        outs = [[] for _ in prompts]
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
                  SamplingParams(temperature=0.0)]
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.submit(Request(f"r{i}", p, sp, 16, outs[i].append, ignore_eos=True,
                                  logprobs=2 if i == 2 else None))
        while engine.step():
            bus.flush()
        assert engine.idle()
        return [[t.token_id for t in o if isinstance(t, TokenOutput)] for o in outs], \
            [o[-1] for o in outs]

    plain, _ = serve("none")
    got, finals = serve("mtp")
    again, _ = serve("mtp")
    # greedy lanes decode exactly as without drafts, the logprobs lane plainly; the seeded
    # sampled lane drafts by the rejection rule: other draws than plain sampling, the same
    # tokens for the same seed
    assert got[0] == plain[0] and got[2] == plain[2] and again == got
    assert finals[0].draft_n > 0 and finals[1].draft_n > 0 and finals[2].draft_n == 0
    assert len(got[1]) == 16


def test_spec_config_and_model_without_mtp(mtp_model):
    model, tok = mtp_model
    with pytest.raises(ValueError, match="draft_tokens"):
        EngineConfig(spec="mtp", draft_tokens=6)
    with pytest.raises(ValueError, match="spec"):
        EngineConfig(spec="eagle")
    no_mtp = copy.copy(model)
    no_mtp.mtp = None
    assert not MtpSpeculator.supports(no_mtp)
    assert Engine(no_mtp, tok, EventBus(), EngineConfig(max_context=64, spec="mtp")).spec is None


def test_http_timings_report_drafts_only_when_drafted():
    from ninfer.api.timings import llama_timings as _timings
    t = {"queue_s": 0.0, "prefill_s": 0.1, "decode_s": 0.2, "ttft_s": 0.1, "total_s": 0.3,
         "prefill_compute_s": 0.1}
    plain = FinalOutput("length", "output_limit", "", 0, 5, 0, 8, t)
    assert "draft_n" not in _timings([plain]) and "draft_n_accepted" not in _timings([plain])
    spec = FinalOutput("length", "output_limit", "", 0, 5, 0, 8, t, draft_n=12,
                       draft_n_accepted=5)
    out = _timings([spec])
    assert out["draft_n"] == 12 and out["draft_n_accepted"] == 5


def test_serve_flags():
    import argparse

    from ninfer.config import ServeConfig, add_serve_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--spec", "mtp", "--draft-tokens", "5"]))
    assert (cfg.spec, cfg.draft_tokens) == ("mtp", 5)
    assert (ServeConfig().spec, ServeConfig().draft_tokens) == ("none", 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--draft-tokens", "6"])


async def test_http_chat_reports_draft_timings(mtp_bundle, nursery):
    import httpx

    from ninfer.config import ServeConfig
    from ninfer.engine.chat_template import ChatTemplate
    from ninfer.server import DEFAULT_CHATML, Runtime, build_server, serve
    model, tok, art, folder = mtp_bundle
    rt = Runtime(folder, art, model, tok, ChatTemplate(DEFAULT_CHATML), 0.0, "tiny-mtp")
    body = {"messages": [{"role": "user", "content": "hello there"}], "temperature": 0,
            "max_tokens": 12}
    got = {}
    for spec in ("none", "mtp"):
        server = build_server(ServeConfig(port=0, max_context=256, spec=spec,
                                          draft_tokens=4), rt)
        rec = Records()
        server.state.bus.add_sink(rec)
        binds = await nursery.start(serve, server)
        async with httpx.AsyncClient(base_url=binds[0], timeout=120) as client:
            r = (await client.post("/v1/chat/completions", json=body)).json()
        got[spec] = r
        got[spec + "-metrics"] = await _spec_metrics(server, binds[0]), rec.kinds("spec.round")
    plain, spec = got["none"], got["mtp"]
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    assert spec["usage"] == plain["usage"]
    assert "draft_n" not in plain["timings"]
    assert spec["timings"]["draft_n"] > 0
    assert 0 <= spec["timings"]["draft_n_accepted"] <= spec["timings"]["draft_n"]
    # /metrics: vLLM's spec_decode counters, the request's drafts and the rounds' positions
    (m, rounds) = got["mtp-metrics"]
    assert m["ninfer:spec_decode_num_draft_tokens_total"] == spec["timings"]["draft_n"]
    assert m["ninfer:spec_decode_num_accepted_tokens_total"] == \
        spec["timings"]["draft_n_accepted"]
    assert m["ninfer:spec_decode_num_drafts_total"] == sum(r.drafted[0] > 0 for r in rounds)
    per = [m.get(f'ninfer:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)
           for i in range(1, 5)]
    assert per == [sum(r.accepted_per_position[i] for r in rounds
                       if i < len(r.accepted_per_position)) for i in range(4)]
    assert sum(per) == spec["timings"]["draft_n_accepted"]
    assert got["none-metrics"][0]["ninfer:spec_decode_num_drafts_total"] == 0


async def _spec_metrics(server, url: str) -> dict:
    """``/metrics`` of a server: sample values by name (with its labels)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    server.state.bus.flush()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        text = (await client.get("/metrics")).text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in smp.labels.items())
            samples[smp.name + (f"{{{labels}}}" if labels else "")] = smp.value
    return samples


def reference_drafts(model, tokens, n, k):
    """MTP drafts for a sequence whose first ``n`` tokens are computed and ``tokens[n]`` is
    pending, from scratch: main pass over ``tokens[:n]``, MTP pass over positions 0..n-1 with
    the next tokens ``tokens[1:n+1]``, then k-1 chained single-row passes."""
    from ninfer.engine.models.llama import ForwardBatch
    kv = model.new_kv_cache(64, 16, max_lanes=1)
    table = list(range(64))
    _, hidden = model.forward(ForwardBatch.from_sequences([tokens[:n]], [0], [table], 16,
                                                          state_slots=[0]), kv,
                              return_hidden=True)
    logits, h = model.mtp_forward(ForwardBatch.from_sequences([tokens[1:n + 1]], [0], [table],
                                                              16), hidden, kv)
    out = [int(np.argmax(logits[0, :VOCAB]))]
    h = h[-1:]
    for j in range(2, k + 1):
        logits, h = model.mtp_forward(ForwardBatch.from_sequences([[out[-1]]], [n + j - 2],
                                                                  [table], 16), h, kv)
        out.append(int(np.argmax(logits[0, :VOCAB])))
    return out[:k]


@pytest.mark.parametrize("chunk", [512, 13])
def test_mtp_drafts_equal_a_from_scratch_mtp_pass(mtp_model, chunk):
    """The MTP head's KV in the engine holds exactly the committed positions: every round's
    drafts equal those of a fresh MTP pass over the whole sequence (also after accepted runs,
    with the oracle replacing drafts)."""
    model, tok = mtp_model
    prompts = prompts_of(5, (30, 45))
    truth = run(mtp_model, prompts, max_tokens=30, max_concurrency=2)[0]
    seen = []
    engine = make_engine(model, tok, EventBus(), EngineConfig(
        max_context=512, max_concurrency=2, prefill_chunk=chunk, spec="mtp", draft_tokens=3))
    rng = np.random.default_rng(0)

    def propose(lanes, drafts):   # the head's drafts (device or host rounds), then replaced
        ks = [len(d) for d in drafts]
        for ln, k, d in zip(lanes, ks, drafts):
            seen.append((list(ln.tokens), ln.num_computed, k, list(d)))
        out = []
        for ln, k in zip(lanes, ks):  # mostly right drafts: rounds accept several tokens
            i = int(ln.req.request_id[1:])
            d = (truth[i][ln.generated:ln.generated + k] + [0] * k)[:k]
            if k and rng.random() < 0.3:
                d[-1] = (d[-1] + 1) % 256
            out.append(d)
        return out

    engine.spec.propose = propose
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), 30, lambda o: None,
                              ignore_eos=True))
    while engine.step():
        pass
    assert len(seen) > 10
    for tokens, n, k, d in seen:
        assert d == reference_drafts(model, tokens, n, k)
