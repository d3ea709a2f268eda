// ninfer dashboard. Renders what the server's folds return (GET /dashboard/state live, POST
// /dashboard/replay for an uploaded log); it never folds records itself, so live and offline
// views share one definition. /events only tells the page when something changed.
import uPlot from "./vendor/uPlot.esm.js";
import { tip } from "./glossary.js";

const $ = (id) => document.getElementById(id);
const fmt = (v, d = 1) => (v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(d));
const charts = {};
let offline = null;   // the replay result while viewing a log
let pending = false;

for (const h of document.querySelectorAll("[data-tip]")) h.title = tip(h.dataset.tip);

function chart(id, series, scales) {
  const el = $(id);
  const opts = {
    width: Math.max(el.clientWidth, 200), height: 170,
    scales: { x: { time: true }, ...scales },
    axes: [{}, { scale: series[0].scale || "y", size: 50 }],
    series: [{}, ...series],
    legend: { live: true },
  };
  if (Object.keys(scales).length > 1) opts.axes.push({ scale: Object.keys(scales)[1], side: 1, size: 50 });
  charts[id] = new uPlot(opts, [[], ...series.map(() => [])], el);
}

function makeCharts() {
  const dash = [[], [6, 4], [2, 3], [10, 3, 2, 3], [1, 2]];
  chart("c-throughput", [
    { label: "decode tok/s", stroke: "#0969da", width: 2, dash: dash[0], scale: "tok" },
    { label: "per-seq decode tok/s", stroke: "#1a7f37", dash: dash[1], scale: "tok" },
    { label: "prefill tok/s", stroke: "#bf3989", dash: dash[2], scale: "pre" },
  ], { tok: { auto: true }, pre: { auto: true } });
  chart("c-batch", [
    { label: "decode batch", stroke: "#0969da", width: 2, dash: dash[0] },
    { label: "running", stroke: "#1a7f37", dash: dash[1] },
    { label: "waiting", stroke: "#cf222e", dash: dash[2] },
  ], { y: { auto: true } });
  chart("c-worker", ["decode", "prefill", "admission", "upkeep", "idle"].map((k, i) => (
    { label: k, stroke: ["#0969da", "#bf3989", "#9a6700", "#57606a", "#8c959f"][i], dash: dash[i] })),
  { y: { auto: true } });
}

function setChart(id, xs, cols) {
  charts[id].setData([xs, ...cols]);
}

function kpi(key, label, value, digits, raw) {
  return `<div class="kpi" id="kpi-${key}" title="${tip(key).replaceAll('"', "&quot;")}" data-value="${raw ?? value ?? ""}">` +
    `<div class="v">${fmt(value, digits)}</div><div class="k">${label}</div></div>`;
}

function dl(rows) {
  return "<dl>" + rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("") + "</dl>";
}

function render(state) {
  const d = state.dashboard, t = state.telemetry, c = state.counters;
  const last = d.series.filter((s) => s.decode_tok_s !== null).slice(-1)[0] || {};
  const occ = (d.series.filter((s) => s.occupancy).slice(-1)[0] || {}).occupancy || {};
  $("model").textContent = t.model_id ? `${t.model_id} · ${t.environment.backend || ""}` : "";
  $("headline").innerHTML = [
    kpi("decode_tok_s", "decode tok/s (last interval)", last.decode_tok_s, 1),
    kpi("decode_tok_s_per_seq", "per-sequence decode tok/s", last.decode_tok_s_per_seq, 1),
    kpi("prefill_tok_s", "prefill tok/s (last)", (d.series.filter((s) => s.prefill_tok_s !== null).slice(-1)[0] || {}).prefill_tok_s, 0),
    kpi("running", `lanes busy / ${t.scheduler.max_concurrency}`, occ.running, 0),
    kpi("waiting", `queued / ${t.scheduler.max_pending_requests}`, occ.waiting, 0),
    kpi("ttft", "TTFT p50 (ms)", d.latency.ttft_p50_s === null ? null : d.latency.ttft_p50_s * 1000, 0),
    kpi("prefill_avoided", "% of prompt tokens that skipped prefill", d.prefill_avoided_share === null ? null : d.prefill_avoided_share * 100, 0),
    kpi("requests_finished", "requests finished", c.requests_finished, 0),
    kpi("tokens_predicted", "tokens generated (total)", c.tokens_predicted, 0),
    kpi("prompt_tokens", "prompt tokens computed (total)", c.prompt_tokens, 0),
  ].join("");
  const xs = d.series.map((s) => s.t);
  setChart("c-throughput", xs, [d.series.map((s) => s.decode_tok_s), d.series.map((s) => s.decode_tok_s_per_seq), d.series.map((s) => s.prefill_tok_s)]);
  setChart("c-batch", xs, [d.series.map((s) => s.decode_batch), d.series.map((s) => s.occupancy?.running ?? null), d.series.map((s) => s.occupancy?.waiting ?? null)]);
  const wk = ["decode", "prefill", "admission", "upkeep", "idle"];
  setChart("c-worker", xs, wk.map((k) => d.series.map((s) => (s.worker ? s.worker[k] / d.bucket_s : null))));
  const L = d.latency;
  $("latency").innerHTML = dl([
    ["requests finished", L.requests],
    ["TTFT p50 / p90 / p99 (ms)", [L.ttft_p50_s, L.ttft_p90_s, L.ttft_p99_s].map((v) => fmt(v === null ? null : v * 1000, 0)).join(" / ")],
    [`<span title="${tip("ttft_split")}">TTFT split queue / restore / prefill</span>`,
      L.requests ? [L.queue_share, L.restore_share, L.prefill_share].map((v) => `${fmt(v * 100, 0)} %`).join(" / ") : "–"],
  ]);
  $("cache").innerHTML = d.cache ? dl(Object.entries(d.cache)) :
    `<p class="live-only">No continuation-cache tiers in this build: nothing to show (not zero).</p>`;
  if (offline) {
    $("gpu").innerHTML = `<p class="live-only">live-only: board readings are shown on the live view.</p>`;
  } else if (!t.gpu || !t.gpu.available) {
    $("gpu").innerHTML = `<p class="live-only">No GPU: ${t.gpu ? t.gpu.reason : "no sample yet"}</p>`;
  } else {
    const g = t.gpu;
    $("gpu").innerHTML = dl([["name", g.name], ["utilisation", `${g.utilization_gpu_percent} %`],
      ["temperature", `${g.temperature_c} °C`], ["power", `${fmt(g.power_watts)} / ${fmt(g.power_limit_watts)} W`],
      ["SM clock", `${g.sm_clock_mhz} MHz`], ["memory", `${fmt(g.memory_used_bytes / 2 ** 30)} / ${fmt(g.memory_total_bytes / 2 ** 30)} GiB`],
      ["throttle", (g.throttle_reasons || []).join(", ") || "none"]]);
  }
  const m = t.memory || {};
  const mib = (v) => (v === undefined || v === null ? "–" : `${fmt(v / 2 ** 20)} MiB`);
  const budget = [["weights", m.weights_bytes ?? m.weights_stored_bytes],
    ["KV pool", m.kv_pool_bytes ?? m.kv_cache_bytes], ["workspace", m.workspace_bytes],
    ["CUDA-graph allowance", m.cuda_graph_bytes], ["total planned", m.total_bytes],
    ["device capacity", m.capacity_bytes], ["headroom", m.headroom_bytes]]
    .filter(([, v]) => v !== undefined && v !== null).map(([k, v]) => [k, mib(v)]);
  $("vram").innerHTML = dl([...budget,
    [`<span title="${tip("kv_pages")}">KV pages free / total</span>`, offline ? `<span class="live-only">live-only</span>` : `${m.kv_free_pages ?? "–"} / ${m.kv_total_pages ?? "–"}` + (m.kv_retained_pages ? ` (${m.kv_retained_pages} held by idle lanes for reuse)` : "")],
    ["max context", m.max_context]]);
  const rows = d.requests.map((r) => `<tr><td>${r.id}</td><td>${r.state}</td><td>${r.prompt_tokens ?? "–"}</td>` +
    `<td>${r.cached_tokens ?? "–"}</td><td>${r.reuse ?? "–"}</td><td>${r.completion_tokens ?? "–"}</td><td>${fmt(r.queue_s === undefined ? null : r.queue_s * 1000, 0)}</td>` +
    `<td>${fmt(r.ttft_s === undefined ? null : r.ttft_s * 1000, 0)}</td><td>${fmt(r.decode_tok_s, 1)}</td><td>${r.finish_reason ?? ""}</td></tr>`);
  $("requests").innerHTML = `<table><thead><tr><th>request</th><th>state</th><th>prompt</th><th>cached</th><th title="${tip("reuse")}">reuse</th>` +
    `<th>generated</th><th>queue ms</th><th>TTFT ms</th><th>decode tok/s</th><th>finish</th></tr></thead>` +
    `<tbody>${rows.join("")}</tbody></table>`;
}

async function refreshLive() {
  if (offline || pending) return;
  pending = true;
  try {
    // levels from /telemetry (authoritative), series and requests from the dashboard fold
    const [tr, dr] = await Promise.all([fetch("/telemetry"), fetch("/dashboard/state")]);
    if (tr.ok && dr.ok) {
      const state = await dr.json();
      state.telemetry = await tr.json();
      if (offline) return;  // a log was opened while this refresh was in flight
      render(state);
      $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    }
  } catch (e) {
    if (!offline) $("status").textContent = `server unreachable (${e.message})`;
  } finally { pending = false; }
}

async function openLog(file) {
  $("status").textContent = `replaying ${file.name}…`;
  // (a typed body: the server refuses untyped or text/plain POSTs, which any page could send)
  const r = await fetch("/dashboard/replay", { method: "POST", body: await file.arrayBuffer(),
    headers: { "Content-Type": "application/x-ndjson" } });
  const body = await r.json();
  if (!r.ok) { $("status").textContent = `cannot replay: ${body.error.message}`; return; }
  offline = body;
  $("mode").textContent = "offline"; $("mode").classList.add("offline");
  $("go-live").hidden = false;
  const rp = body.replay;
  $("status").textContent = `${file.name}: ${rp.records} records` +
    (rp.torn_lines ? `, ${rp.torn_lines} torn line skipped` : "") +
    (rp.skipped_unknown ? `, ${rp.skipped_unknown} unknown records skipped` : "");
  render(body);
}

makeCharts();
$("open-log").addEventListener("change", (e) => e.target.files[0] && openLog(e.target.files[0]));
$("go-live").addEventListener("click", () => {
  offline = null; $("mode").textContent = "live"; $("mode").classList.remove("offline");
  $("go-live").hidden = true; refreshLive();
});
const events = new EventSource("/events");
events.onmessage = () => refreshLive();
for (const kind of ["request.finished", "telemetry.sample", "request.received"]) {
  events.addEventListener(kind, () => refreshLive());
}
setInterval(refreshLive, 1000);
refreshLive();
