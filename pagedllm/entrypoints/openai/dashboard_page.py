"""The dashboard page: one HTML document with its script and styles inline (kept in a Python string so it
ships in the wheel with no package-data rule; nothing is fetched from elsewhere).

Each event (see dashboard.py) holds every replica's KVMapMsg with its gauges of the same step, and the
engine-wide totals now (for throughput). A KVMapRequest arrives as an array:
[req_id, state, priority, num_prompt_tokens, num_tokens, num_computed_tokens, block_ids].
The grid draws one cell per block, coloured by its state:
    free       dark grey
    cached     blue outline: held by nobody, holds a cached prefix (reclaimable)
    owned      the owner's colour, filled from the bottom as far as its slots hold KV
    shared     purple, darker the more sequences hold it
With --kv-disk-cache, the totals add the disk tier's rows (blocks and bytes on disk, prompt tokens served by
memory, by disk, and computed, load and store times): the fields /metrics exports as pagedllm_kv_disk_cache_*.
A request waiting for its blocks to be read from disk is listed as "loading".
The canvas carries data-num-blocks and data-num-used (blocks drawn as owned or shared) for tests.
"""

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pagedllm KV cache</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<style>
  body { font: 13px/1.4 system-ui, sans-serif; margin: 12px; background: #fafafa; color: #222; }
  h1 { font-size: 16px; margin: 0 0 8px; }
  h2 { font-size: 14px; margin: 12px 0 4px; }
  #status { color: #666; margin-left: 8px; font-weight: normal; }
  .replica { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; margin-bottom: 12px; }
  .row { display: flex; gap: 16px; flex-wrap: wrap; align-items: flex-start; }
  .grid { border: 1px solid #ccc; image-rendering: pixelated; }
  .legend span { display: inline-block; margin-right: 12px; }
  .legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px; }
  table { border-collapse: collapse; font-size: 12px; }
  td, th { padding: 1px 6px; text-align: right; border-bottom: 1px solid #eee; }
  td:first-child, th:first-child { text-align: left; }
  .counters td { text-align: left; }
  .queue { max-height: 260px; overflow-y: auto; }
</style>
</head>
<body>
<h1>pagedllm KV cache<span id="status">connecting…</span></h1>
<div class="legend">
  <span><i style="background:#555"></i>free</span>
  <span><i style="background:#fff;outline:2px solid #3b82f6;outline-offset:-2px"></i>cached (reclaimable)</span>
  <span><i style="background:hsl(30,70%,50%)"></i>owned by one request (height = slots filled)</span>
  <span><i style="background:#7c3aed"></i>shared (darker = more holders)</span>
</div>
<div class="row">
  <table class="counters" id="totals"></table>
  <div><h2>Tokens computed per second</h2><canvas id="throughput" width="420" height="120"></canvas></div>
</div>
<div id="replicas"></div>
<script>
"use strict";
const REQ = { id: 0, state: 1, priority: 2, prompt: 3, tokens: 4, computed: 5, blocks: 6 };
const rateHistory = [];  // [time, tokens computed in all] of the totals
const MAX_HISTORY = 240;

function hue(reqId) {
  let h = 0;
  for (const c of reqId) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return h % 230;  // red to blue: purple is for shared blocks
}

function apiKey() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) {
    sessionStorage.setItem("pagedllm-key", decodeURIComponent(m[1]));
    window.history.replaceState(null, "", location.pathname);  // the key leaves the address bar
  }
  return sessionStorage.getItem("pagedllm-key");
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function replicaSection(replica) {
  let sec = document.getElementById("replica-" + replica);
  if (sec) return sec;
  sec = el("div", { class: "replica", id: "replica-" + replica });
  sec.appendChild(el("h2", {}, "Replica " + replica));
  const row = el("div", { class: "row" });
  const canvas = el("canvas", { class: "grid", "data-replica": replica });
  row.appendChild(canvas);
  const side = el("div");
  side.appendChild(el("table", { class: "counters" }));
  side.appendChild(el("h2", {}, "Running"));
  side.appendChild(el("div", { class: "queue running" }));
  side.appendChild(el("h2", {}, "Waiting"));
  side.appendChild(el("div", { class: "queue waiting" }));
  row.appendChild(side);
  sec.appendChild(row);
  document.getElementById("replicas").appendChild(sec);
  return sec;
}

function drawGrid(canvas, map) {
  const n = map.ref_cnts.length;
  const cols = Math.max(8, Math.ceil(Math.sqrt(n * 2)));
  const rows = Math.ceil(n / cols);
  const cell = Math.max(3, Math.min(14, Math.floor(640 / cols)));
  canvas.width = cols * cell;
  canvas.height = rows * cell;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const owner = new Array(n);
  for (const r of map.requests) for (const b of r[REQ.blocks]) if (owner[b] === undefined) owner[b] = r[REQ.id];
  const cached = new Set(map.cached_block_ids);
  const bs = map.block_size;
  const gap = cell > 4 ? 1 : 0;
  let used = 0;
  for (let b = 0; b < n; b++) {
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell, s = cell - gap;
    const ref = map.ref_cnts[b];
    if (ref === 0) {
      if (cached.has(b)) {
        ctx.fillStyle = "#dbeafe"; ctx.fillRect(x, y, s, s);
        ctx.strokeStyle = "#3b82f6"; ctx.strokeRect(x + 0.5, y + 0.5, s - 1, s - 1);
      } else {
        ctx.fillStyle = "#555"; ctx.fillRect(x, y, s, s);
      }
      continue;
    }
    used++;
    const fill = Math.min(1, map.num_tokens[b] / bs);
    const base = ref > 1 ? "hsl(265,70%," + Math.max(25, 62 - 8 * ref) + "%)"
                         : "hsl(" + hue(owner[b] || "?") + ",70%,50%)";
    ctx.fillStyle = ref > 1 ? "#e9d5ff" : "#eee";
    ctx.fillRect(x, y, s, s);
    ctx.fillStyle = base;
    const h = Math.max(1, Math.round(s * fill));
    ctx.fillRect(x, y + s - h, s, h);
  }
  canvas.dataset.numBlocks = String(n);
  canvas.dataset.numUsed = String(used);
  canvas.title = n + " blocks, " + used + " held";
}

function queueTable(requests, bs) {
  const t = el("table");
  const head = el("tr");
  for (const h of ["request", "state", "prio", "tokens", "computed", "blocks", "fill"]) head.appendChild(el("th", {}, h));
  t.appendChild(head);
  for (const r of requests.slice(0, 200)) {
    const tr = el("tr");
    const nb = r[REQ.blocks].length;
    const fill = nb ? Math.round(100 * r[REQ.computed] / (nb * bs)) + "%" : "";
    const name = el("td", {}, r[REQ.id]);
    name.style.borderLeft = "6px solid hsl(" + hue(r[REQ.id]) + ",70%,50%)";
    tr.appendChild(name);
    for (const v of [r[REQ.state], r[REQ.priority], r[REQ.tokens], r[REQ.computed], nb, fill]) tr.appendChild(el("td", {}, String(v)));
    t.appendChild(tr);
  }
  if (requests.length > 200) t.appendChild(el("tr", {}, "… " + (requests.length - 200) + " more"));
  return t;
}

function counters(table, rows) {
  table.replaceChildren();
  for (const [k, v] of rows) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, k));
    tr.appendChild(el("td", {}, String(v)));
    table.appendChild(tr);
  }
}

function pct(a, b) { return b ? (100 * a / b).toFixed(1) + "%" : "–"; }

function drawReplica(replica, map) {
  const sec = replicaSection(replica);
  drawGrid(sec.querySelector("canvas"), map);
  const used = map.ref_cnts.filter(r => r > 0).length;
  const filled = map.num_tokens.reduce((a, n, b) => a + (map.ref_cnts[b] ? n : 0), 0);
  counters(sec.querySelector("table.counters"), [
    ["blocks held / cached / free", used + " / " + map.cached_block_ids.length + " / " +
      (map.ref_cnts.length - used - map.cached_block_ids.length)],
    ["slots filled / allocated", filled + " / " + used * map.block_size + " (" + pct(filled, used * map.block_size) + ")"],
    ["shared blocks", map.ref_cnts.filter(r => r > 1).length],
    ["prefix-cache hits", map.prefix_cache_hits + " of " + map.prefix_cache_queries + " tokens (" +
      pct(map.prefix_cache_hits, map.prefix_cache_queries) + ")"],
    ["preemptions / swap-outs", map.num_preemptions + " / " + map.num_swap_outs],
    ["steps", map.num_steps],
    ["map built in", (1000 * map.build_time_s).toFixed(2) + " ms"],
  ]);
  const running = map.requests.filter(r => r[REQ.state] === "running");
  const waiting = map.requests.filter(r => r[REQ.state] !== "running");
  sec.querySelector(".running").replaceChildren(queueTable(running, map.block_size));
  sec.querySelector(".waiting").replaceChildren(queueTable(waiting, map.block_size));
}

function drawThroughput() {
  const c = document.getElementById("throughput");
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  const rates = [];
  for (let i = 1; i < rateHistory.length; i++) {
    const dt = rateHistory[i][0] - rateHistory[i - 1][0];
    if (dt > 0) rates.push([rateHistory[i][0], (rateHistory[i][1] - rateHistory[i - 1][1]) / dt]);
  }
  if (!rates.length) return;
  const max = Math.max(1, ...rates.map(r => r[1]));
  const t0 = rates[0][0], t1 = rates[rates.length - 1][0];
  ctx.strokeStyle = "#2563eb";
  ctx.beginPath();
  rates.forEach(([t, r], i) => {
    const x = t1 > t0 ? (t - t0) / (t1 - t0) * (c.width - 40) + 38 : 38;
    const y = c.height - 4 - r / max * (c.height - 16);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#444";
  ctx.fillText(Math.round(max) + "/s", 2, 12);
  ctx.fillText("0", 2, c.height - 4);
}

function sumStats(list) {
  const total = {};
  for (const s of list) for (const [k, v] of Object.entries(s)) if (typeof v === "number") total[k] = (total[k] || 0) + v;
  return total;
}

function mib(bytes) { return (bytes / 2 ** 20).toFixed(1) + " MiB"; }

function diskRows(s) {  // the disk tier (--kv-disk-cache): what /metrics exports as pagedllm_kv_disk_cache_*
  const fromDisk = s.kv_disk_hit_tokens, fromMemory = s.prefix_cache_hits - fromDisk;
  return [
    ["disk tier: blocks / bytes", s.kv_disk_blocks + " / " + mib(s.kv_disk_bytes) + " of " + mib(s.kv_disk_max_bytes)],
    ["prompt tokens: memory / disk / computed", fromMemory + " / " + fromDisk + " / " +
      (s.prefix_cache_queries - s.prefix_cache_hits)],
    ["disk blocks missed / corrupt", s.kv_disk_miss_blocks + " / " + s.kv_disk_corrupt_blocks],
    ["disk loads: time / requests waiting", s.kv_disk_load_seconds.toFixed(3) + " s / " + s.kv_disk_num_loading],
    ["disk stores: blocks / time", s.kv_disk_stored_blocks + " / " + s.kv_disk_store_seconds.toFixed(3) + " s"],
  ];
}

function onEvent(ev) {
  // The table: the replicas' gauges taken with their maps (so they agree with the grids), summed.
  const s = ev.replicas.length ? sumStats(ev.replicas.map(r => r.stats)) : ev.stats;
  if (s) {
    counters(document.getElementById("totals"), [
      ["requests running / waiting", s.num_running + " / " + s.num_waiting],
      ["KV usage (blocks held)", pct(s.kv_num_used_blocks, s.kv_num_blocks)],
      ["slots filled / allocated", s.kv_num_filled_slots + " / " + s.kv_num_allocated_slots],
      ["blocks cached (reclaimable)", s.kv_num_cached_blocks],
      ["sharing saves", s.kv_num_saved_blocks + " blocks, " + (s.kv_saved_bytes / 2 ** 20).toFixed(1) + " MiB"],
      ["swapped-out blocks", s.kv_num_swapped_blocks + " of " + s.kv_num_host_blocks],
      ["preemptions / swap-outs", s.num_preemptions + " / " + s.num_swap_outs],
      ...(s.kv_disk_max_bytes ? diskRows(s) : []),
    ]);
  }
  if (ev.stats) {  // throughput from the engine-wide totals now
    rateHistory.push([ev.time, ev.stats.num_scheduled_tokens]);
    if (rateHistory.length > MAX_HISTORY) rateHistory.shift();
    drawThroughput();
  }
  for (const r of ev.replicas) drawReplica(r.replica, r.map);
  document.getElementById("status").textContent = " live, " + new Date(ev.time * 1000).toLocaleTimeString();
}

async function connect() {
  const headers = {};
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  const status = document.getElementById("status");
  try {
    const resp = await fetch(location.pathname.replace(/\/+$/, "") + "/events", { headers });
    if (resp.status === 401) {
      status.textContent = " needs an API key: open /dashboard#key=<your key>";
      return;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const chunk = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = chunk.split("\n").filter(l => l.startsWith("data: ")).map(l => l.slice(6)).join("\n");
        if (data) onEvent(JSON.parse(data));
      }
    }
    status.textContent = " disconnected; retrying…";
  } catch (e) {
    status.textContent = " disconnected (" + e.message + "); retrying…";
  }
  setTimeout(connect, 2000);
}

connect();
</script>
</body>
</html>
"""
