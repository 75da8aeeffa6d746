// gpupool's dashboard: one page, routed by the URL's fragment (#/cluster, #/job/ID, ...). Every request is a
// fetch() to this worker's /api/* with the signed-in principal's token in the Authorization header; the worker
// answers what that principal may see (a tenant: its own jobs and bill; other tenants' jobs unnamed).
"use strict";

const session = {
  get name() { return sessionStorage.getItem("gpupool.name"); },
  get token() { return sessionStorage.getItem("gpupool.token"); },
  set(name, token) { sessionStorage.setItem("gpupool.name", name); sessionStorage.setItem("gpupool.token", token); },
  clear() { sessionStorage.removeItem("gpupool.name"); sessionStorage.removeItem("gpupool.token"); },
};
let who = null;
const charts = [];

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const url = path + (q.toString() ? "?" + q : "");
  const resp = await fetch(url, { headers: { Authorization: "Basic " + btoa(session.name + ":" + session.token) } });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) throw new HttpError(resp.status, (body && body.error) || resp.statusText);
  return body;
}

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v; else if (k === "text") el.textContent = v; else el.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}

const rowsOf = (doc) => doc.rows.map((r) => Object.fromEntries(doc.columns.map((c, i) => [c, r[i]])));
const when = (ms) => (ms && ms > 0 ? new Date(ms).toLocaleString() : "-");
const secs = (ms) => (ms < 120000 ? (ms / 1000).toFixed(1) + " s" : ms < 7200000 ? (ms / 60000).toFixed(1) + " min"
  : (ms / 3600000).toFixed(2) + " h");
const gib = (mib) => (mib / 1024).toFixed(mib % 1024 ? 1 : 0) + " GiB";
const gpus = (milli) => (milli / 1000).toFixed(2);
const jobLink = (id) => (id.includes("/") && canSee("job") ? h("a", { href: "#/job/" + encodeURIComponent(id), text: id }) : id);

// ---------------------------------------------------------------- pages, and who may see them

const PAGES = [
  ["cluster", "Cluster", ["tenant", "operator", "finance", "auditor", "service"]],
  ["utilization", "Utilization", ["tenant", "operator", "finance", "auditor", "service"]],
  ["queue", "Queue", ["tenant", "operator", "finance", "auditor", "service"]],
  ["tenants", "Tenants", ["tenant", "operator", "finance", "auditor"]],
  ["jobs", "Jobs", ["tenant", "operator", "finance", "auditor", "service"]],
  ["services", "Services", ["tenant", "operator", "auditor", "service"]],
];
const HIDDEN_PAGES = { job: ["tenant", "operator", "auditor", "service"], service: ["tenant", "operator", "auditor", "service"] };
const canSee = (page) => {
  const p = PAGES.find((x) => x[0] === page);
  return !!who && (p ? p[2] : HIDDEN_PAGES[page] || []).includes(who.role);
};

function nav(active) {
  const ul = document.getElementById("nav");
  ul.replaceChildren(...PAGES.filter((p) => canSee(p[0])).map((p) =>
    h("li", {}, h("a", { href: "#/" + p[0], class: p[0] === active ? "active" : null, id: "nav-" + p[0], text: p[1] }))));
  document.getElementById("who").textContent = who ? `${who.name} (${who.role}${who.tenant ? ", " + who.tenant : ""})` : "";
  document.getElementById("signout").hidden = !who;
}

function page(title, ...children) {
  const el = document.getElementById("page");
  el.replaceChildren(h("h2", { text: title }), ...children);
  el.dataset.ready = "1";
  return el;
}

function table(columns, rows, id) {
  return h("figure", {}, h("table", { class: "striped", id },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { text: c })))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((v) => h("td", {}, v)))))));
}

function chart(title, xs, series, opts) {
  // series: [{label, values, stroke}]
  const box = h("div", { class: "chart" }, h("h5", { text: title }));
  if (!xs.length) { box.append(h("p", { class: "muted", text: "no data yet (history is kept per minute)" })); return box; }
  const width = Math.min(1100, (document.getElementById("page").clientWidth || 1000) - 20);
  const palette = ["#3b6fd8", "#e8833a", "#2e9e5b", "#b4417d", "#7b5cc4", "#888"];
  const u = new uPlot({
    width, height: (opts && opts.height) || 220,
    series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: s.stroke || palette[i % palette.length], width: 2,
      points: { show: xs.length < 30 } }))],
    axes: [{}, { label: (opts && opts.unit) || "" }],
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
    hooks: opts && opts.marks ? { draw: [(u) => drawMarks(u, opts.marks)] } : {},
  }, [xs, ...series.map((s) => s.values)], box);
  charts.push(u);
  return box;
}

function drawMarks(u, marks) {
  const ctx = u.ctx;
  ctx.save();
  const at = new Map();  // actions at the same moment share one line and one label
  for (const m of marks) at.set(m.t, at.has(m.t) ? at.get(m.t) + " + " + m.label : m.label);
  let row = 0;
  for (const [t, label] of at) {
    const m = { t, label, row: row++ % 3 };
    const x = u.valToPos(m.t, "x", true);
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
    ctx.strokeStyle = "#b4417d"; ctx.setLineDash([4, 3]); ctx.lineWidth = 1.5;
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
    ctx.fillStyle = "#b4417d"; ctx.font = "11px sans-serif"; ctx.fillText(m.label, x + 3, u.bbox.top + 12 + 13 * m.row);
  }
  ctx.restore();
}

const minutesAgo = (n) => Date.now() - n * 60000;

// ---------------------------------------------------------------- cluster

function cardState(c) {
  if (!c.healthy) return "bad";
  const free = c.free_milli;
  if (c.mig.length) return c.mig.every((i) => i.holders.length) ? "full" : c.mig.some((i) => i.holders.length) ? "part" : "free";
  return free >= 1000 ? "free" : free <= 0 ? "full" : "part";
}

function cardBox(c) {
  const t = c.telemetry || {};
  const st = cardState(c);
  const box = h("div", { class: "card " + st, "data-uuid": c.uuid, title: c.uuid },
    h("b", { text: `#${c.index} ${c.model}` }), h("br"),
    h("span", { text: `${gib(c.memory_mib)} · gen ${c.generation}` }), h("br"),
    h("span", { text: c.healthy ? `util ${t.util_pct ?? "-"}% · ${t.temperature_c ?? "-"}°C` : "OUT: " + c.fault }));
  if (c.mig.length) {
    box.append(h("div", { class: "slices" }, c.mig.map((i) => h("div", { class: "slice " + (i.holders.length ? "full" : "free"),
      title: i.uuid }, h("span", { text: i.profile }), ...i.holders.map((j) => h("span", { class: "job", text: j }))))));
  } else {
    box.append(...c.holders.map((j) => h("span", { class: "job" }, jobLink(j))));
    if (st !== "free") box.append(h("span", { class: "muted", text: `${1000 - c.free_milli} of 1000 milli held` }));
  }
  return box;
}

async function pageCluster() {
  const [nodes, cl] = await Promise.all([api("/api/nodes"), api("/cluster/")]);
  const kpis = h("div", { class: "kpis" },
    [["nodes", cl.nodes], ["cards", cl.cards], ["allocated", `${gpus(cl.allocated_milli)} / ${gpus(cl.capacity_milli)} GPUs`],
      ["allocation", (cl.allocation_permille / 10).toFixed(1) + "%"], ["fragmentation", `${gpus(cl.fragmentation_milli)} GPUs (${(cl.fragmentation_permille / 10).toFixed(1)}% of free)`],
      ["unhealthy cards", cl.unhealthy_cards]].map(([k, v]) => h("div", { class: "kpi" }, h("span", { class: "muted", text: k }), h("b", { text: String(v) }))));
  const legend = h("p", { class: "legend" }, ["free", "part", "full", "bad"].map((s) =>
    h("span", { class: s, text: { free: "free", part: "partly held", full: "fully held", bad: "out of service" }[s] })));
  const grid = h("div", { class: "grid-nodes", id: "cluster-grid" }, nodes.nodes.map((n) =>
    h("div", { class: "node " + n.state, "data-node": n.node },
      h("h4", { text: `${n.node} — ${n.state}` }),
      h("div", { class: "meta", text: `${n.datacenter} / ${n.rack} · CPU ${n.free_cpu_milli / 1000} of ${n.cpu_milli / 1000} free · ${n.jobs.length} job(s)` }),
      h("div", { class: "cards" }, n.cards.map(cardBox)))));
  page("Cluster", kpis, legend, grid);
}

// ---------------------------------------------------------------- utilization over time

function pivot(rows, key, value) {
  const xs = [...new Set(rows.map((r) => r.minute_ms))].sort((a, b) => a - b);
  const groups = [...new Set(rows.map((r) => r[key]))].sort();
  const at = new Map(rows.map((r) => [r.minute_ms + "|" + r[key], r[value]]));
  return { xs: xs.map((x) => x / 1000), series: groups.map((g) => ({ label: String(g), values: xs.map((x) => at.get(x + "|" + g) ?? null) })) };
}

async function pageUtilization() {
  const since = minutesAgo(180);
  const [wl, tn, pool] = await Promise.all([api("/api/telemetry", { by: "workload", since }),
    api("/api/telemetry", { by: "tenant", since }), api("/api/pool", { since })]);
  const parts = [];
  if (wl.pool) {
    const pr = rowsOf(wl.pool);
    parts.push(chart("Pool utilization from telemetry (% of every card and MIG instance, per minute)", pr.map((r) => r.minute_ms / 1000),
      [{ label: "utilization %", values: pr.map((r) => r.util_pct) },
        { label: "memory used %", values: pr.map((r) => (r.mem_total_mib ? (100 * r.mem_used_mib) / r.mem_total_mib : 0)) }], { unit: "%" }));
  }
  const w = pivot(rowsOf(wl), "g", "util_pct");
  parts.push(chart("Training vs inference: utilization of the GPUs each workload held (%)", w.xs, w.series, { unit: "%" }));
  const wg = pivot(rowsOf(wl), "g", "gpus");
  parts.push(chart("Training vs inference: GPUs (cards or MIG instances) in use", wg.xs, wg.series, { unit: "GPUs" }));
  const t = pivot(rowsOf(tn), "g", "util_pct");
  parts.push(chart(who.role === "tenant" ? "Your tenant's utilization (%)" : "Utilization by tenant (%)", t.xs, t.series, { unit: "%" }));
  const pr = rowsOf(pool);
  parts.push(chart("Allocation and fragmentation (GPUs, per minute)", pr.map((r) => r.minute_ms / 1000),
    [{ label: "capacity", values: pr.map((r) => r.capacity_milli / 1000) }, { label: "allocated", values: pr.map((r) => r.allocated_milli / 1000) },
      { label: "fragmented (of free)", values: pr.map((r) => r.fragmentation_milli / 1000) }], { unit: "GPUs" }));
  page("Utilization", ...parts);
}

// ---------------------------------------------------------------- queue and wait by tier

const TIERS = ["inference", "online-training", "offline"];

async function pageQueue() {
  const [pool, pending] = await Promise.all([api("/api/pool", { since: minutesAgo(180) }), api("/api/jobs", { state: "pending" })]);
  const pr = rowsOf(pool);
  const xs = pr.map((r) => r.minute_ms / 1000);
  const qlen = chart("Jobs waiting, by tier", xs, TIERS.map((t) => ({ label: t, values: pr.map((r) => r.queue_by_tier[t] || 0) })), { unit: "jobs" });
  const qwait = chart("Longest wait, by tier (s)", xs, TIERS.map((t) => ({ label: t, values: pr.map((r) => (r.oldest_wait_ms_by_tier[t] || 0) / 1000) })), { unit: "s" });
  const rows = rowsOf(pending);
  const now = TIERS.map((t) => { const w = rows.filter((r) => r.tier === t); return [t, w.length, w.length ? Math.max(...w.map((r) => r.wait_s)).toFixed(1) + " s" : "-"]; });
  page("Queue", table(["tier", "waiting now", "longest wait"], now, "queue-now"), qlen, qwait,
    h("h4", { text: "Waiting jobs" }),
    table(["job", "tier", "compute (milli-CU)", "waiting", "rejections"], rows.map((r) => [jobLink(r.job_id), r.tier, r.compute_milli, r.wait_s + " s", r.rejections || "-"]), "queue-jobs"));
}

// ---------------------------------------------------------------- tenants' ledger

async function pageTenants() {
  const [quota, bill] = await Promise.all([api("/api/quota"), api("/api/billing", { by: "tenant", cost: 1 })]);
  // one bill row per tenant and currency (never summed across currencies; '' holds GPU time no price applied to)
  const cost = new Map();
  for (const r of rowsOf(bill)) {
    const b = cost.get(r.tenant) || { gpu_hours: 0, cost: [], borrowed_cost: [] };
    b.gpu_hours = Math.round((b.gpu_hours + (r.gpu_hours || 0)) * 10000) / 10000;
    if (r.currency) { b.cost.push(`${r.cost} ${r.currency}`); b.borrowed_cost.push(`${r.borrowed_cost} ${r.currency}`); }
    cost.set(r.tenant, b);
  }
  // an account known only by a refused quota.set (no quota, nothing held) is not shown
  const known = rowsOf(quota).filter((r) => r.quota_set_by || r.used_milli || r.reserved_milli || r.used_memory_mib);
  const rows = known.filter((r) => !r.project).map((r) => {
    const b = cost.get(r.tenant) || {};
    const q = r.quota_milli || 0, used = r.used_milli || 0;
    const bar = h("span", { class: "bar-bg" }, h("span", { class: "bar-fg" + (used > q ? " over" : ""), style: `width:${q ? Math.min(100, (100 * used) / q) : 0}%` }));
    return [r.tenant, (q / 1000).toFixed(1), h("span", {}, bar, " ", (used / 1000).toFixed(2)), ((r.reserved_milli || 0) / 1000).toFixed(2),
      ((r.borrowed_milli || 0) / 1000).toFixed(2), b.gpu_hours ?? 0, (b.cost || []).join(", ") || "0", (b.borrowed_cost || []).join(", ") || "0",
      h("span", {}, invoiceButton(r.tenant, "html"), " ", invoiceButton(r.tenant, "csv"))];
  });
  const now = new Date();
  const month = h("input", { type: "month", id: "invoice-month", style: "width: 14em; display: inline-block; margin: 0 .5em", value: `${now.getUTCFullYear()}-${String(now.getUTCMonth() + 1).padStart(2, "0")}` });
  const projects = known.filter((r) => r.project).map((r) => [r.tenant, r.project, r.quota_milli ? (r.quota_milli / 1000).toFixed(1) : "-", ((r.used_milli || 0) / 1000).toFixed(2), ((r.borrowed_milli || 0) / 1000).toFixed(2)]);
  page("Tenants", h("p", { class: "muted", text: "Quota, used, reserved and borrowed in compute units (1 = one A100's dense throughput); cost from the price book." }),
    h("p", {}, h("label", { for: "invoice-month", text: "Invoices for the month (UTC)", style: "display: inline" }), month, " ", h("span", { id: "invoice-status", class: "muted" })),
    table(["tenant", "quota (CU)", "used (CU)", "reserved", "borrowed", "GPU-hours", "cost", "of which borrowed", "invoice"], rows, "tenants-table"),
    projects.length ? h("h4", { text: "Projects" }) : null, projects.length ? table(["tenant", "project", "quota", "used", "borrowed"], projects, "projects-table") : null);
}

// a tenant's invoice for the chosen month (/api/invoice, the file `gpupool invoice` writes), downloaded with the
// signed-in principal's token: a tenant gets its own, finance every tenant's (docs/billing.md, "Invoices")
function invoiceButton(tenant, fmt) {
  const b = h("button", { type: "button", class: "invoice outline", style: "padding: .15em .6em; font-size: .85em; width: auto; margin: 0",
    "data-tenant": tenant, "data-format": fmt, text: fmt.toUpperCase() });
  b.addEventListener("click", () => downloadInvoice(tenant, fmt));
  return b;
}

async function downloadInvoice(tenant, fmt) {
  const status = document.getElementById("invoice-status");
  const month = document.getElementById("invoice-month").value;
  const q = new URLSearchParams({ tenant, month, format: fmt });
  const resp = await fetch("/api/invoice?" + q, { headers: { Authorization: "Basic " + btoa(session.name + ":" + session.token) } });
  if (!resp.ok) {
    let msg = resp.statusText;
    try { msg = (await resp.json()).error || msg; } catch (e) { /* not JSON */ }
    status.textContent = `invoice ${tenant} ${month}: ${resp.status} ${msg}`;
    return;
  }
  const found = /filename="([^"]+)"/.exec(resp.headers.get("Content-Disposition") || "");
  const name = found ? found[1] : `invoice-${tenant}-${month}.${fmt}`;
  const a = h("a", { href: URL.createObjectURL(await resp.blob()), download: name });
  document.body.append(a);
  a.click();
  a.remove();
  status.textContent = `${name} downloaded`;
}

// ---------------------------------------------------------------- jobs and one job

async function pageJobs() {
  const rows = rowsOf(await api("/api/jobs"));
  page("Jobs", table(["job", "state", "tier", "compute (milli-CU)", "cards", "nodes", "wait", "run"],
    rows.map((r) => [jobLink(r.job_id), r.state, r.tier, r.compute_milli, r.cards, r.nodes || "-", r.wait_s + " s", r.elapsed_s + " s"]), "jobs-table"));
}

// an epoch-milliseconds instant in a reason ("last at 1796128512698 ms", decided_ms=...) is shown as a local time
const times = (text) => String(text).replace(/\b(1\d{12})( ?ms)?\b/g, (_, ms) => when(Number(ms)));

function reasonLines(reasons) {
  return (reasons || []).map((r) => {
    const data = Object.entries(r.data || {}).map(([k, v]) => `${k}=${k.endsWith("_ms") ? times(v) : v}`).join(" ");
    const message = times(r.message || "");
    return h("span", { class: "reason", text: `${r.plugin ? "[" + r.plugin + "] " : ""}${r.code}${message || data ? ": " : ""}${[message, data].filter(Boolean).join(" ")}` });
  });
}

// a job's output as `gpupool logs` prints it (agents/cli/logs.py): a header where the run changes, the caps' cuts
// marked where they cut, a piece relayed twice shown once
const LOG_READERS = ["tenant", "operator"];
const LOG_TAIL = 500;

function logText(pieces) {
  let out = "", run = null, where = null, open = false;
  const seen = new Set();
  const nl = () => { if (open) { out += "\n"; open = false; } };
  for (const p of pieces) {
    const key = `${p.attempt}|${p.part}|${p.stream}|${p.seq}`;
    if (seen.has(key)) continue;
    seen.add(key);
    const r = `${p.attempt}|${p.part}`, w = `${r}|${p.stream}`;
    if (r !== run) { nl(); out += `==> attempt ${p.attempt}, part ${p.part} on ${p.node} <==\n`; run = r; }
    if (w !== where && (p.text || p.dropped_bytes)) nl();
    if (p.dropped_bytes) { nl(); out += `[... ${p.dropped_bytes} bytes dropped by the log cap ...]\n`; }
    if (p.text) { out += p.text; open = !p.text.endsWith("\n"); where = w; }
  }
  return out;
}

async function jobLogs(id) {
  if (!LOG_READERS.includes(who.role)) {
    return [h("h4", { text: "Logs" }), h("p", { class: "muted", id: "job-logs-note", text: "A job's output is shown to its tenant and to operators only." })];
  }
  const doc = await api("/api/logs", { job: id, tail: LOG_TAIL });
  const text = logText(doc.pieces);
  return [h("h4", { text: "Logs" }),
    h("p", { class: "muted", text: doc.pieces.length >= LOG_TAIL ? `The last ${LOG_TAIL} pieces of its output; \`gpupool logs ${id}\` prints all of it.` : "Its stdout and stderr, each run under its own header." }),
    h("pre", { class: "logs", id: "job-logs" }, text || "no output recorded yet")];
}

async function pageJob(id) {
  const [hist, nodes, listed] = await Promise.all([api("/api/history", { job: id }), api("/api/nodes"), api("/api/jobs", { job: id })]);
  const cards = new Map();
  for (const n of nodes.nodes) for (const c of n.cards) cards.set(c.uuid, { ...c, node: n.node });
  const ev = hist.events;
  if (!ev.length) { page("Job " + id, h("p", { text: "nothing recorded for this job" })); return; }
  const req = (ev.find((e) => e.kind === "job.requested") || {}).payload || {};
  const billed = ev.filter((e) => e.kind === "usage.accrued").reduce((a, e) => a + e.payload.gpu_milli_ms, 0);
  // where it stands: as its view's fold decided it (gpupool.jobs, docs/jobs.md "A job's state"), never re-derived here
  const [row] = rowsOf(listed);
  const facts = [["tier", req.tier], ["project", req.project], ["asked", `${req.compute_milli} milli-CU, ${gib(req.gpu_memory_mib || 0)} GPU memory`],
    ["isolation", req.isolation || "not stated"], ["state", row ? row.state + (row.nodes ? " on " + row.nodes : "") : "-"], ["billed so far", (billed / 1e6).toFixed(3) + " GPU-seconds"]];
  // placements: one block per placement decision (a gang's parts together)
  const places = new Map();
  for (const e of ev.filter((e) => e.kind === "cmd.place")) {
    const key = `${e.payload.attempt}|${e.time_ms}`;
    if (!places.has(key)) places.set(key, []);
    places.get(key).push(e);
  }
  const placeRows = [];
  let slowdown = null;
  for (const parts of places.values()) {
    for (const e of parts) {
      for (const r of e.reasons || []) if (r.data && r.data.slowdown_pct !== undefined) slowdown = r.data.slowdown_pct;
      for (const a of e.payload.assignments) {
        const c = cards.get(a.gpu_uuid) || {};
        placeRows.push([when(e.time_ms), `attempt ${e.payload.attempt}` + (e.payload.gang_size > 1 ? `, part ${e.payload.gang_index + 1}/${e.payload.gang_size}` : ""),
          e.payload.node, c.model || "?", c.generation ?? "?", a.mig_profile ? `MIG ${a.mig_profile}` : `${a.milli}/1000 of the card`, gib(a.memory_mib)]);
      }
    }
  }
  // timeline: each step with how long it took (placement -> start, preemption -> stop, migration -> start)
  const after = (i, kinds) => ev.slice(i + 1).find((x) => kinds.includes(x.kind));
  const items = ev.filter((e) => e.kind !== "usage.accrued" && !e.kind.startsWith("quota.")).map((e) => {
    const i = ev.indexOf(e);
    let took = "";
    if (e.kind === "cmd.place") { const s = after(i, ["job.started"]); if (s) took = `started ${secs(s.time_ms - e.time_ms)} later`; }
    if (e.kind === "cmd.preempt") { const s = after(i, ["job.stopped"]); if (s) took = `stopped ${secs(s.time_ms - e.time_ms)} later`; }
    if (e.kind === "cmd.migrate") { const s = after(i, ["job.started"]); if (s) took = `running again ${secs(s.time_ms - e.time_ms)} later`; }
    if (e.kind === "cmd.resize") took = "resized in place";
    return h("li", {}, h("span", { class: "muted", text: when(e.time_ms) + "  " }), h("span", { class: "kind", text: e.kind }),
      e.node ? h("span", { class: "tag", text: e.node }) : null, took ? h("span", { class: "tag", text: took }) : null, ...reasonLines(e.reasons));
  });
  const tel = rowsOf(await api("/api/telemetry", { job: id, by: "tier", since: 0 }));
  const logs = await jobLogs(id);
  page("Job " + id,
    table(["", ""], facts, "job-facts"),
    h("h4", { text: "Resources" }),
    table(["placed", "placement", "node", "model", "generation", "slice share", "GPU memory"], placeRows, "job-placements"),
    h("p", { id: "job-slowdown", text: slowdown ? `Estimated communication slowdown: ~${slowdown}% slower all-reduce (its parts are spread wider than its ideal placement)` : "Estimated communication slowdown: none (placed within its ideal topology)" }),
    chart("The job's utilization of its GPUs (%)", tel.map((r) => r.minute_ms / 1000), [{ label: "util %", values: tel.map((r) => r.util_pct) }], { unit: "%", height: 160 }),
    h("h4", { text: "Timeline" }), h("ol", { class: "timeline", id: "job-timeline" }, items), ...logs);
}

// ---------------------------------------------------------------- services

async function pageServices() {
  const rows = rowsOf(await api("/api/service"));
  page("Services", table(["service", "declared", "removed"], rows.map((r) => [h("a", { href: "#/service/" + encodeURIComponent(r.service_id), text: r.service_id }), when(r.declared_ms), r.removed ? "yes" : "no"]), "services-table"));
}

async function pageService(id) {
  const doc = await api("/api/service", { service: id });
  const xs = doc.loads.map((x) => x.time_ms / 1000);
  const marks = doc.actions.map((a) => ({ t: a.time_ms / 1000, label: a.action }));
  const fmt = (v) => (v === null || v === undefined ? "-" : String(v));
  page("Service " + id,
    h("p", { class: "muted", text: doc.declared ? `one replica: ${doc.declared.replica_compute_milli} milli-CU (boost +${doc.declared.boost_compute_milli}); p99 target ${doc.declared.latency_target_ms} ms; ${doc.declared.replica_qps} QPS a replica; ${doc.declared.min_replicas}..${doc.declared.max_replicas} replicas` : "" }),
    chart("Latency (ms), elastic actions marked", xs, [{ label: "p50", values: doc.loads.map((x) => x.p50_ms) }, { label: "p99", values: doc.loads.map((x) => x.p99_ms) }], { unit: "ms", marks }),
    chart("QPS", xs, [{ label: "QPS", values: doc.loads.map((x) => x.qps) }], { unit: "req/s", marks, height: 160 }),
    h("h4", { text: "Elastic actions" }),
    table(["when", "action", "replicas", "took", "p99 before → after (ms)", "p50 before → after", "QPS before → after", "why"],
      doc.actions.map((a) => [when(a.time_ms), a.action, a.replicas, a.took_ms ? secs(a.took_ms) : "-", `${fmt(a.before.p99_ms)} → ${fmt(a.after.p99_ms)}`,
        `${fmt(a.before.p50_ms)} → ${fmt(a.after.p50_ms)}`, `${fmt(a.before.qps)} → ${fmt(a.after.qps)}`, h("span", {}, ...reasonLines(a.reasons))]), "service-actions"));
}

// ---------------------------------------------------------------- routing and sign-in

async function route() {
  for (const c of charts.splice(0)) c.destroy();
  const el = document.getElementById("page");
  el.dataset.ready = "";
  if (!session.token) return showSignin();
  try {
    if (!who) who = await api("/api/whoami");
  } catch (e) {
    return showSignin(e.status === 401 ? "The worker did not accept that name and token." : e.message);
  }
  document.getElementById("signin").hidden = true;
  const [, name, arg] = (location.hash || "#/cluster").match(/^#\/([a-z]+)\/?(.*)$/) || [null, "cluster", ""];
  nav(name === "job" ? "jobs" : name === "service" ? "services" : name);
  if (!canSee(name)) { page("Not for your role", h("p", { text: `${who.role} may not open this page.` })); return; }
  const pages = { cluster: pageCluster, utilization: pageUtilization, queue: pageQueue, tenants: pageTenants, jobs: pageJobs,
    job: () => pageJob(decodeURIComponent(arg)), services: pageServices, service: () => pageService(decodeURIComponent(arg)) };
  try {
    await (pages[name] || pageCluster)();
  } catch (e) {
    if (e.status === 401) return showSignin("Signed out: the token is no longer valid.");
    page(e.status === 404 ? "Not found" : "Could not load this page", h("p", { class: "error", id: "page-error", text: `${e.status || ""} ${e.message}` }));
  }
}

function showSignin(message) {
  who = null;
  nav(null);
  document.getElementById("page").replaceChildren();
  document.getElementById("signin").hidden = false;
  document.getElementById("signin-error").textContent = message || "";
}

document.getElementById("signin-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  session.set(document.getElementById("signin-name").value.trim(), document.getElementById("signin-token").value.trim());
  who = null;
  if (!location.hash || location.hash === "#/") location.hash = "#/cluster"; else route();
});
document.getElementById("signout").addEventListener("click", (ev) => { ev.preventDefault(); session.clear(); who = null; showSignin(); });
window.addEventListener("hashchange", route);
route();
