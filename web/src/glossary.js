// One glossary for every reading on the page: what it measures, and what it means when it moves.
export const GLOSSARY = {
  decode_tok_s: ["Aggregate decode rate: tokens committed by decode rounds per second of round time.",
    "Falls when rounds get slower (longer contexts, bigger batches on a saturated device) or when prefill steals turns."],
  decode_tok_s_per_seq: ["Per-sequence decode rate: aggregate decode tok/s divided by the mean decode batch.",
    "What one client sees. It drops as more lanes share each round."],
  prefill_tok_s: ["Prefill rate: prompt tokens computed per second of prefill compute.",
    "Falls with long prompts (attention grows with context) or small prefill chunks."],
  decode_batch: ["Mean decode batch: lanes advanced per decode round.",
    "Higher means better device utilisation; capped by --max-concurrency."],
  running: ["Lanes holding a request (prefilling or decoding).",
    "At --max-concurrency the server is full and new requests queue."],
  waiting: ["Requests received but still waiting for a lane.",
    "Growing queue = offered load above capacity; queue time adds straight to TTFT."],
  worker: ["Execution-thread wall clock split by activity over each interval (seconds per second).",
    "Idle near 1 means spare capacity; admission or upkeep growing means overhead outside the model."],
  ttft: ["Time to first token: request received to first token sampled (nearest-rank percentiles).",
    "Rises with queueing (waiting lanes) or long prefills."],
  ttft_split: ["TTFT decomposition: share spent queueing, restoring cached state, and prefilling.",
    "A large queue share means add lanes or shed load; a large prefill share means long prompts without prefix reuse."],
  prefill_avoided: ["Share of prompt tokens that skipped prefill thanks to cached prefixes.",
    "Higher is better for multi-turn agents: a continued conversation reuses its lane's prefix (see the cache panel)."],
  cache: ["Continuation-cache fill per tier (L1 lanes, L2 host, L3 disk) against configured capacity, and churn.",
    "L1 only in this build: an idle lane keeps its last request's prefix, and a request whose prompt starts with it skips recomputing it (cache.lookup records say which path was taken)."],
  gpu: ["NVML board readings: utilisation, temperature, power against its limit, clocks, memory, throttle reasons.",
    "Throttle reasons other than gpu_idle mean the board is limiting clocks (power or thermal)."],
  vram: ["Memory budget reported at start: weights, KV cache and the rest.",
    "KV bytes bound how many tokens all lanes can hold at once."],
  kv_pages: ["KV pages in use out of the pool.",
    "Near the total, new tokens cannot be stored and requests fail or wait."],
  requests_finished: ["Requests that completed normally (same value as ninfer:requests_total{finish=\"finished\"}).",
    "Compare with failed and cancelled counts on /metrics when it stalls."],
  tokens_predicted: ["Generated tokens in total (same value as llamacpp:tokens_predicted_total).",
    "Its slope over time is the aggregate decode rate."],
  prompt_tokens: ["Prompt tokens computed by prefill in total, cache hits excluded (llamacpp:prompt_tokens_total).",
    "Grows by the uncached part of each prompt; prefix reuse makes it grow slower."],
  requests: ["Recent requests with their tokens, TTFT, decode rate and finish reason.",
    "Look here for the slow one: queue time vs prefill time vs decode rate."],
};

export function tip(key) {
  const g = GLOSSARY[key];
  return g ? `${g[0]}\nWhen it moves: ${g[1]}` : "";
}
