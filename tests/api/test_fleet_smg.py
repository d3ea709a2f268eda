"""Scale-out end to end (issue 34, docs/scale-out.md): the SGLang model gateway ``smg`` (pinned in
pyproject's dev extra) in front of two SmolLM2 replicas, each with its own L3 namespace and
KV-event stream, all real processes on 127.0.0.1.

- discovery: smg registers both replicas and lists their model on ``GET /v1/models``;
- OpenAI Chat, Anthropic Messages and Responses requests through the gateway (official clients);
- six three-turn conversations: every later turn lands on the replica that served the turn
  before and reuses that turn's whole prompt (``cached_tokens``);
- each replica's KV-event stream, replayed from seq 0 and decoded as vLLM's format, holds what
  its ``/slots`` shows;
- a replica killed mid-stream: the client's stream ends with an error, its conversation goes
  on (cold) on the other replica, the gateway stops routing to the dead one; restarted on its
  L3 store, it takes traffic again;
- vllm-router's ``kv_aware`` policy in front of two replicas routes a conversation by their
  KV-event streams (it credits the cached prefix) and ``POST /tokenize``.
Waits are bounded generously and never asserted as times (CI shares 2 cores).
"""
from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest
from fleet_procs import Gateway, KvRouter, Replica, wait_until
from kv_reference import check_against_slots, index_of, replay

pytestmark = pytest.mark.slow

# distinct, long first turns: smg pins a request to a replica when the text it has seen there
# is at least --cache-threshold (0.3) of the request's, so a later turn (short follow-up,
# short answer) still matches its conversation, and two conversations share little text
QUESTIONS = [
    "Paris travel notes. I am planning three days in Paris in spring with two children and a "
    "modest budget, and I would like to see museums, parks and a market. What is the capital "
    "of France?",
    "Painting class. Our group of beginners mixes paints every Thursday evening and today we "
    "are learning about the colour wheel, warm and cool tones, and shading. Name three primary "
    "colours.",
    "Garden wildlife survey. Last weekend we counted insects, birds and small animals along "
    "the hedge at the bottom of the school garden and wrote everything down in a notebook. How "
    "many legs does a spider have?",
    "Arithmetic homework. My younger brother is practising sums before his test on Monday and "
    "asked me to check his answers one by one, slowly, using simple words he understands. What "
    "is two plus two?",
    "Astronomy club. Tonight the sky is clear over the hills, the telescope is set up on the "
    "terrace, and we want to find the planets that are visible after sunset this month. Which "
    "planet is called the red planet?",
    "Beekeeping course. The instructor showed us the hives, the frames, the smoker and the "
    "protective suits, and explained how a colony lives through the seasons of the year. What "
    "do bees make?"]
FOLLOW_UPS = ["Tell me one more fact about it.", "Say that again in five words.",
              "Thank you. Anything else?"]
TURN = {"temperature": 0, "max_tokens": 8}


class Fleet:
    """Two replicas behind smg, and the bookkeeping of who served what."""

    def __init__(self, model, tmp):
        self.a, self.b = Replica(model, tmp, "replica-a"), Replica(model, tmp, "replica-b")
        self.gw = Gateway([self.a, self.b], tmp)
        self.oai = openai.OpenAI(base_url=self.gw.url + "/v1", api_key="unused",
                                 max_retries=0, timeout=600)

    @property
    def replicas(self):
        return (self.a, self.b)

    def chat(self, history, up=None):
        """One chat turn through the gateway: ``(reply, the replica that served it)``; only
        replicas in ``up`` (default: both) are asked what they served."""
        up = self.replicas if up is None else up
        before = {r.name: r.requests_received() for r in up}
        reply = self.oai.chat.completions.create(model=self.model, messages=history, **TURN)
        served = [r for r in up if r.requests_received() > before[r.name]]
        assert len(served) == 1, [r.name for r in served]
        return reply, served[0]

    def stop(self):
        self.gw.stop()
        for r in self.replicas:
            r.stop()


def _turn(history, reply, follow_up):
    history += [{"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": follow_up}]


def test_smg_routes_two_replicas_by_cache_and_survives_losing_one(smollm2_gguf, tmp_path):
    fleet = Fleet(smollm2_gguf, tmp_path)
    try:
        a, b = fleet.a.start(), fleet.b.start()
        gw = fleet.gw.start(n_workers=2)
        # discovery: the gateway's model list is the replicas'
        listed = httpx.get(gw.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == [a.get("/v1/models")["data"][0]["id"]]
        fleet.model = model = listed[0]["id"]

        # the three protocols through the gateway
        chat = fleet.oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], **TURN)
        assert chat.choices[0].message.content
        claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0,
                                     timeout=600)
        msg = claude.messages.create(model=model, max_tokens=8,
                                     messages=[{"role": "user", "content": "Say hello."}])
        assert msg.content[0].text and msg.usage.output_tokens > 0
        resp = fleet.oai.responses.create(model=model, input="Say hello.", temperature=0,
                                          max_output_tokens=16)
        assert resp.output_text and resp.usage.output_tokens > 0

        # six conversations: a later turn lands where its prefix is and reuses all of it
        convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
        home, prompt = {}, {}
        for turn in range(3):
            for i, history in enumerate(convs):
                reply, served = fleet.chat(history)
                usage = reply.usage
                if turn:
                    assert served is home[i], (i, turn)
                    assert usage.prompt_tokens_details.cached_tokens >= prompt[i], (i, turn)
                home[i], prompt[i] = served, usage.prompt_tokens
                _turn(history, reply, FOLLOW_UPS[turn])
        assert set(home.values()) == {a, b}   # the gateway spread the conversations

        # each replica's KV events, as a gateway's index decodes them, match its /slots
        for r in fleet.replicas:
            index = index_of(replay(r.kv_replay))
            check_against_slots(index, r.get("/slots"), page_size=16)
            assert any(m == "DISK" for m, _, _ in index.blocks)   # L3 images announced

        # a replica killed mid-stream
        victim = home[0]
        survivor = b if victim is a else a
        stream = fleet.oai.chat.completions.create(model=model, messages=convs[0], stream=True,
                                                   temperature=0, max_tokens=200)
        with pytest.raises(openai.APIError):
            for n, _ in enumerate(stream):
                if n == 3:
                    victim.kill()
        # its conversation goes on, cold, on the other replica
        reply, served = fleet.chat(convs[0], up=(survivor,))
        assert served is survivor
        assert reply.usage.prompt_tokens_details.cached_tokens < prompt[0]
        wait_until(lambda: victim.url not in gw.healthy() and survivor.url in gw.healthy(),
                   "smg leaves the dead replica out")
        # nothing else is lost: the survivor's conversations still reuse their prefixes
        for i in [i for i in home if home[i] is survivor][:2]:
            reply, served = fleet.chat(convs[i], up=(survivor,))
            assert reply.usage.prompt_tokens_details.cached_tokens >= prompt[i]

        # restarted on its L3 store, it takes traffic again
        victim.start()
        wait_until(lambda: victim.url in gw.healthy(), "smg routes to the restarted replica")
        assert victim.get("/telemetry")["cache"]["l3"]["entries"] > 0
        took = False
        for i in [i for i in home if home[i] is victim and i != 0]:
            reply, served = fleet.chat(convs[i])
            if served is victim:   # its prefix comes back from L3
                assert reply.usage.prompt_tokens_details.cached_tokens >= prompt[i]
                took = True
                break
        for q in QUESTIONS * 2 if not took else []:
            _, served = fleet.chat([{"role": "user", "content": "Again: " + q}])
            if served is victim:
                took = True
                break
        assert took, "the restarted replica got no request"
    finally:
        fleet.stop()


def test_vllm_router_routes_by_the_replicas_kv_events(smollm2_gguf, tmp_path):
    """vllm-router's ``kv_aware`` policy, started before any traffic (a router that joins later
    never learns the blocks announced before it), credits each later turn of a conversation
    with the pages the replica announced on its KV-event stream, and sends the turn there."""
    fleet = Fleet(smollm2_gguf, tmp_path)
    kv = None
    try:
        fleet.a.start()
        fleet.b.start()
        model = fleet.model = fleet.a.get("/v1/models")["data"][0]["id"]
        kv = KvRouter(fleet.replicas, tmp_path, model).start()
        router = openai.OpenAI(base_url=kv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        history = [{"role": "user", "content": QUESTIONS[0]}]
        served = []
        for turn in range(3):
            before = {r.name: r.requests_received() for r in fleet.replicas}
            reply = router.chat.completions.create(model=model, messages=history, **TURN)
            served += [r for r in fleet.replicas if r.requests_received() > before[r.name]]
            if turn:
                assert reply.usage.prompt_tokens_details.cached_tokens >= prompt_before
            prompt_before = reply.usage.prompt_tokens
            _turn(history, reply, FOLLOW_UPS[turn])
            # the reply can reach us before the lane's pages are announced: wait for the lane
            # to hold the turn (lane.retained, published with it), then for the event to travel
            wait_until(lambda: any(s["retained"] and s["n_prompt_tokens"] >= prompt_before
                                   for s in served[-1].get("/slots")), "the turn retained")
            time.sleep(1.0)
        assert len(served) == 3 and served[1] is served[0] and served[2] is served[0]
        kv.stop()   # (its log is complete once it exits)
        # each decision credits the pages the conversation left on that replica
        credited = kv.credited_prefix_tokens()
        assert len(credited) == 3 and credited[0] < credited[1] < credited[2], credited
        assert credited[2] >= 16 * (prompt_before // 16) - 32, (credited, prompt_before)
    finally:
        if kv is not None:
            kv.stop()
        fleet.stop()
