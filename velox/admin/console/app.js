// The Velox console. No framework: a hash router, a poller per page, DOM built with
// textContent only (names come from operators and the configuration: never parsed as HTML).
"use strict";

const POLL_MS = 1000;          // Overview and Upstreams poll once a second
const KEYS_POLL_MS = 2000;     // the keys' usage
const KEEP = 900;              // 15 minutes of 1 s samples
const TOKEN = "velox.token";

// ---------------------------------------------------------------- helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);
const nf = new Intl.NumberFormat(undefined, { maximumFractionDigits: 1 });
const nf0 = new Intl.NumberFormat(undefined, { maximumFractionDigits: 0 });
const fmt = {
  rps: (v) => v == null ? "–" : `${nf.format(v)} req/s`,
  pct: (v) => v == null ? "–" : `${nf.format(v * 100)} %`,
  ms: (us) => us == null ? "–" : `${nf.format(us / 1000)} ms`,
  tpm: (v) => v == null ? "–" : `${nf0.format(v)} tok/min`,
  int: (v) => v == null ? "–" : nf0.format(v),
  time: (t) => new Date(t * 1000).toLocaleTimeString(),
  when: (iso) => iso ? new Date(iso).toLocaleString() : "never",
};

function table(target, headers, rows) {
  const head = el("tr", null, headers.map(([label, cls]) => el("th", { class: cls, scope: "col" }, label)));
  target.replaceChildren(el("thead", null, head), el("tbody", null, rows));
}

function bar(fraction, label) {
  const span = el("span");
  span.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  return el("div", { class: "bar", role: "img", "aria-label": label, title: label }, span);
}

// ---------------------------------------------------------------- the API

class Unauthorized extends Error {}

async function api(method, path, body) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.status === 401) throw new Unauthorized("the admin token was refused");
  return res;
}

async function json(method, path, body) {
  const res = await api(method, path, body);
  const text = await res.text();
  const doc = text ? JSON.parse(text) : null;
  if (!res.ok) {
    const msg = doc && doc.error ? doc.error.message : `HTTP ${res.status}`;
    const err = new Error(msg);
    err.status = res.status;
    throw err;
  }
  return doc;
}

// ---------------------------------------------------------------- charts (uPlot)

const charts = {};

function chart(id, series, opts = {}) {
  if (charts[id]) return charts[id];
  const node = $(id);
  const width = Math.max(260, node.clientWidth || 560);
  const colours = ["#1f5fbf", "#c2410c", "#15803d", "#7e22ce", "#0e7490", "#a16207"];
  const u = new uPlot({
    width, height: opts.height || 200,
    scales: { x: { time: true }, y: opts.y || {} },
    axes: [{}, { size: 60, values: opts.values }],
    legend: { live: true },
    series: [{}, ...series.map((s, i) => ({ stroke: colours[i % colours.length], width: 1.5, ...s }))],
  }, [[], ...series.map(() => [])], node);
  new ResizeObserver(() => u.setSize({ width: Math.max(260, node.clientWidth), height: opts.height || 200 }))
    .observe(node);
  charts[id] = u;
  return u;
}

// ---------------------------------------------------------------- Overview

const samples = [];
let lastT = 0;
window.veloxSamples = () => samples.length;  // what the browser tests wait on

async function pollSeries() {
  const doc = await json("GET", `/ui/api/series?after=${lastT}`);
  for (const s of doc.samples) samples.push(s);
  if (samples.length > KEEP) samples.splice(0, samples.length - KEEP);
  if (samples.length) lastT = samples[samples.length - 1].t;
  return doc;
}

async function overview() {
  const doc = await pollSeries();
  const last = samples[samples.length - 1];
  const total = last ? last.total : {};
  const cards = [
    ["Requests", fmt.rps(total.rps)], ["Error rate (5xx)", fmt.pct(total.error_rate)],
    ["Latency p50", fmt.ms(total.p50_us)], ["Latency p99", fmt.ms(total.p99_us)],
    ["Cache hit rate", total.cache_hit_rate == null ? "no lookups" : fmt.pct(total.cache_hit_rate)],
    ["Tokens", fmt.tpm(total.tokens_per_min)],
  ];
  $("cards").replaceChildren(...cards.map(([label, value]) =>
    el("div", { class: "card", "data-metric": label },
       el("div", { class: "label" }, label), el("div", { class: "value" }, value))));
  const t = samples.map((s) => s.t);
  const workers = doc.workers;
  const rps = chart("chart-rps", [{ label: "total req/s" },
    ...Array.from({ length: workers }, (_, i) => ({ label: `worker ${i}`, width: 1, dash: [4, 3] }))]);
  rps.setData([t, samples.map((s) => s.total.rps),
    ...Array.from({ length: workers }, (_, i) => samples.map((s) => (s.workers[i] || {}).rps))]);
  const ms = (v) => v == null ? null : v / 1000;
  chart("chart-latency", [{ label: "p50 ms" }, { label: "p99 ms" }],
        { values: (u, vals) => vals.map((v) => `${v} ms`), y: { range: (u, min, max) => [0, Math.max(1, max)] } })
    .setData([t, samples.map((s) => ms(s.total.p50_us)), samples.map((s) => ms(s.total.p99_us))]);
  chart("chart-errors", [{ label: "5xx %" }], { values: (u, vals) => vals.map((v) => `${v} %`),
                                                y: { range: (u, min, max) => [0, Math.max(1, max)] } })
    .setData([t, samples.map((s) => s.total.error_rate * 100)]);
  chart("chart-tokens", [{ label: "tokens/min" }]).setData([t, samples.map((s) => s.total.tokens_per_min)]);
  const rows = (last ? last.workers : []).map((w, i) => el("tr", null,
    el("td", null, `worker ${i}`), el("td", { class: "num" }, fmt.rps(w.rps)),
    el("td", { class: "num" }, fmt.pct(w.error_rate)), el("td", { class: "num" }, fmt.ms(w.p50_us)),
    el("td", { class: "num" }, fmt.ms(w.p99_us)), el("td", { class: "num" }, fmt.tpm(w.tokens_per_min))));
  table($("workers-table"), [["Worker"], ["Requests", "num"], ["Errors", "num"], ["p50", "num"],
    ["p99", "num"], ["Tokens", "num"]], rows);
}

// ---------------------------------------------------------------- Upstreams

const STATE_LEVEL = { closed: 0, half_open: 1, open: 2 };

async function upstreams() {
  const [doc] = await Promise.all([json("GET", "/ui/api/upstreams"), pollSeries()]);
  const rows = doc.upstreams.map((u) => el("tr", { "data-upstream": u.name },
    el("th", { scope: "row" }, u.name),
    el("td", null, el("span", { class: `badge state-${u.state}`, "data-state": u.state },
                      u.state.replace("_", "-"))),
    el("td", { class: "num" }, `${u.in_flight}${u.max_in_flight ? " / " + u.max_in_flight : ""}`),
    el("td", { class: "num" }, fmt.ms(u.latency.p50_us)), el("td", { class: "num" }, fmt.ms(u.latency.p99_us)),
    el("td", { class: "num" }, fmt.int(u.requests)),
    el("td", { class: "num" }, fmt.int(u.by_status_class["5xx"])),
    el("td", { class: "num" }, fmt.int(u.by_status_class["4xx"])),
    el("td", { class: "num" }, fmt.int(u.by_status_class.error)),
    el("td", { class: "num" }, fmt.int(u.open_count))));
  table($("upstreams-table"), [["Upstream"], ["Breaker"], ["In flight", "num"], ["p50", "num"],
    ["p99", "num"], ["Attempts", "num"], ["5xx", "num"], ["4xx", "num"], ["No answer", "num"],
    ["Openings", "num"]], rows);
  const names = doc.upstreams.map((u) => u.name);
  const c = chart("chart-breakers", names.map((n) => ({ label: n, paths: uPlot.paths.stepped({ align: 1 }) })),
                  { height: 160, y: { range: [0, 2.2] } });
  c.setData([samples.map((s) => s.t),
    ...names.map((n) => samples.map((s) => s.upstreams[n] ? STATE_LEVEL[s.upstreams[n].state] : null))]);
  $("transitions").replaceChildren(...doc.transitions.slice().reverse().map((tr) =>
    el("li", null, `${fmt.time(tr.t)} · ${tr.upstream}: ${tr.from.replace("_", "-")} → ${tr.to.replace("_", "-")}`)));
  if (!doc.transitions.length) $("transitions").replaceChildren(el("li", null, "none since the gateway started"));
  $("routes").replaceChildren(...doc.routes.map((r) => {
    const t = el("table");
    table(t, [["Target"], ["Picks", "num"], ["Share", "num"], ["", ""]], r.targets.map((x) =>
      el("tr", null, el("td", null, x.upstream + (x.model ? ` (${x.model})` : "")),
         el("td", { class: "num" }, fmt.int(x.picks)), el("td", { class: "num" }, fmt.pct(x.share)),
         el("td", null, bar(x.share, fmt.pct(x.share))))));
    return el("div", null, el("h3", null, `${r.model} · ${r.strategy}`), el("div", { class: "scroll" }, t));
  }));
}

// ---------------------------------------------------------------- Keys

// Use against a limit: the rate over the last poll (requests or tokens per minute, from the
// cumulative counts), as a bar of the limit. A bucket's level would read full under any load
// its refill keeps up with.
const lastCounts = new Map();

function rates(k) {
  const now = performance.now() / 1000;
  const u = k.usage;
  const prev = lastCounts.get(k.name);
  // Tokens its answers used (every key, file or run-time, with or without a tpm).
  const tokens = u.tokens_in + u.tokens_out;
  lastCounts.set(k.name, { t: now, requests: u.requests, tokens });
  if (!prev || now - prev.t < 0.5) return { rpm: null, tpm: null };
  const per = 60 / (now - prev.t);
  return { rpm: Math.max(0, (u.requests - prev.requests) * per),
           tpm: Math.max(0, (tokens - prev.tokens) * per) };
}

function use(limit, rate, unit) {
  if (rate == null) return limit ? `limit ${fmt.int(limit)} ${unit}` : "no limit";
  if (!limit) return `${fmt.int(rate)} ${unit}, no limit`;
  return [bar(rate / limit, `${fmt.int(rate)} of ${fmt.int(limit)} ${unit}`),
          `${fmt.int(rate)} / ${fmt.int(limit)} ${unit}`];
}

async function keys() {
  const doc = await json("GET", "/keys");
  const rows = doc.keys.map((k) => {
    const u = k.usage;
    const runtime = k.source === "runtime";
    const r = u ? rates(k) : { rpm: null, tpm: null };
    return el("tr", { "data-key": k.name },
      el("th", { scope: "row" }, k.name),
      el("td", null, runtime ? "run time" : "file (read-only)"),
      el("td", null, use(k.rpm, r.rpm, "req/min")),
      el("td", null, use(k.tpm, r.tpm, "tok/min")),
      el("td", null, k.max_parallel ? `${u ? u.active : "–"} / ${k.max_parallel}` : (u ? `${u.active} / no limit` : "no limit")),
      el("td", null, k.models ? k.models.join(", ") : "all"),
      el("td", null, runtime ? fmt.when(k.expires_at) : "–"),
      el("td", null, runtime && k.previous_secret_valid_until ? `old secret until ${fmt.when(k.previous_secret_valid_until)}` : ""),
      el("td", { class: "actions" }, runtime ? [
        el("button", { type: "button", class: "secondary", "data-action": "edit", onclick: () => editKey(k) }, "Edit"),
        el("button", { type: "button", class: "secondary", "data-action": "rotate", onclick: () => rotateKey(k) }, "Rotate"),
        el("button", { type: "button", class: "danger", "data-action": "revoke", onclick: () => revokeKey(k) }, "Revoke"),
      ] : []));
  });
  table($("keys-table"), [["Name"], ["Source"], ["Requests/min"], ["Tokens/min"], ["In flight"],
    ["Models"], ["Expires"], ["Rotation"], ["Actions"]], rows);
  const note = doc.keys.find((k) => k.usage_note);
  $("keys-note").textContent = note ? `Note: ${note.usage_note}.` : "";
}

function showSecret(secret) {
  $("secret-value").textContent = secret;
  $("secret-copied").textContent = "";
  $("secret-dialog").showModal();
}

function numberOr(form, name) {
  const v = form.elements[name].value.trim();
  return v === "" ? undefined : Number(v);
}

function modelsOf(form) {
  const v = form.elements.models.value.trim();
  return v === "" ? null : v.split(",").map((m) => m.trim()).filter(Boolean);
}

async function createKey(ev) {
  ev.preventDefault();
  const form = ev.target;
  const body = { name: form.elements.name.value.trim() };
  for (const f of ["rpm", "tpm", "max_parallel", "budget_usd"]) {
    const v = numberOr(form, f);
    if (v !== undefined) body[f] = v;
  }
  const models = modelsOf(form);
  if (models) body.models = models;
  if (form.elements.team.value.trim()) body.team = form.elements.team.value.trim();
  if (form.elements.expires_at.value) body.expires_at = new Date(form.elements.expires_at.value).toISOString();
  try {
    const doc = await json("POST", "/keys", body);
    $("create-error").textContent = "";
    form.reset();
    showSecret(doc.key);
    await keys();
  } catch (e) {
    if (e instanceof Unauthorized) return signOut(e.message);
    $("create-error").textContent = e.message;
  }
}

let editing = null;

function editKey(k) {
  editing = k;
  const form = $("edit-form");
  $("edit-h").textContent = `Edit ${k.name}`;
  for (const f of ["rpm", "tpm", "max_parallel"]) form.elements[f].value = k[f];
  form.elements.models.value = k.models ? k.models.join(", ") : "";
  $("edit-error").textContent = "";
  $("edit-dialog").showModal();
}

async function saveEdit(ev) {
  ev.preventDefault();
  const form = $("edit-form");
  const body = { models: modelsOf(form) };
  for (const f of ["rpm", "tpm", "max_parallel"]) body[f] = numberOr(form, f) ?? 0;
  try {
    await json("PATCH", `/keys/${encodeURIComponent(editing.name)}`, body);
    $("edit-dialog").close();
    await keys();
  } catch (e) {
    if (e instanceof Unauthorized) return signOut(e.message);
    $("edit-error").textContent = e.message;
  }
}

let confirming = null;

function confirmThen(title, text, withOverlap, action) {
  $("confirm-h").textContent = title;
  $("confirm-text").textContent = text;
  $("overlap-label").hidden = !withOverlap;
  $("confirm-error").textContent = "";
  confirming = action;
  $("confirm-dialog").showModal();
  $("confirm-no").focus();
}

async function confirmed(ev) {
  ev.preventDefault();
  try {
    await confirming();
    $("confirm-dialog").close();
    await keys();
  } catch (e) {
    if (e instanceof Unauthorized) return signOut(e.message);
    $("confirm-error").textContent = e.message;
  }
}

function rotateKey(k) {
  confirmThen(`Rotate ${k.name}?`, "A new secret is made and shown once; the old one keeps working for the overlap.", true,
    async () => {
      const doc = await json("POST", `/keys/${encodeURIComponent(k.name)}/rotate`, { overlap_s: Number($("overlap").value || 0) });
      $("confirm-dialog").close();
      showSecret(doc.key);
    });
}

function revokeKey(k) {
  confirmThen(`Revoke ${k.name}?`, "Requests presenting it will be refused. This cannot be undone.", false,
    () => json("DELETE", `/keys/${encodeURIComponent(k.name)}`));
}

// ---------------------------------------------------------------- Spend

async function spend() {
  const res = await api("GET", "/spend?since=7d&by=key");
  if (res.status === 404) {
    $("spend-state").textContent = "The usage ledger is not enabled on this gateway: there is no spend to show yet.";
    $("spend-figure").hidden = true;
    $("spend-table").replaceChildren();
    return;
  }
  const doc = await res.json();
  if (!res.ok) throw new Error(doc.error ? doc.error.message : `HTTP ${res.status}`);
  const rows = Array.isArray(doc) ? doc : [];
  $("spend-state").textContent = rows.length ? "Last 7 days, by key." : "No spend in the last 7 days.";
  const cols = rows.length ? Object.keys(rows[0]) : [];
  table($("spend-table"), cols.map((c) => [c]), rows.map((r) => el("tr", null, cols.map((c) => el("td", null, r[c])))));
  const money = cols.find((c) => /cost|usd|spend/i.test(c));
  $("spend-figure").hidden = !money;
  if (money) {
    const node = $("chart-spend");
    node.replaceChildren(...rows.map((r) => el("div", null, `${r[cols[0]]}: $${nf.format(r[money])}`,
      bar(r[money] / Math.max(...rows.map((x) => x[money] || 0), 1e-9), `$${nf.format(r[money])}`))));
  }
}

// ---------------------------------------------------------------- Profile

let profileUrl = null;

async function takeProfile(ev) {
  ev.preventDefault();
  const seconds = Math.min(30, Math.max(5, Number($("profile-seconds").value) || 5));
  const button = ev.target.querySelector("button");
  button.disabled = true;
  $("profile-state").textContent = `Profiling the workers for ${seconds} s…`;
  try {
    const res = await api("GET", `/debug/pprof/profile?seconds=${seconds}&format=svg`);
    if (!res.ok) {
      const doc = await res.json();
      throw new Error(doc.error ? doc.error.message : `HTTP ${res.status}`);
    }
    const blob = await res.blob();
    if (profileUrl) URL.revokeObjectURL(profileUrl);
    profileUrl = URL.createObjectURL(blob);
    const img = $("flamegraph");
    img.src = profileUrl;
    $("profile-download").href = profileUrl;
    $("profile-caption").textContent = `CPU profile of every worker, ${seconds} s, taken ${new Date().toLocaleTimeString()}`;
    $("profile-figure").hidden = false;
    $("profile-state").textContent = "Done.";
  } catch (e) {
    if (e instanceof Unauthorized) return signOut(e.message);
    $("profile-state").textContent = `The profile failed: ${e.message}`;
  } finally {
    button.disabled = false;
  }
}

// ---------------------------------------------------------------- router, polling, sign-in

const PAGES = { overview: [overview, POLL_MS], upstreams: [upstreams, POLL_MS], keys: [keys, KEYS_POLL_MS],
                spend: [spend, 0], profile: [null, 0] };
let timer = null;
let current = null;

async function tick(name) {
  const [fn, every] = PAGES[name];
  if (!fn || current !== name) return;
  try {
    await fn();
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (e instanceof Unauthorized) return signOut(e.message);
    $("status").textContent = `error: ${e.message}`;
  }
  if (every && current === name && !document.hidden) timer = setTimeout(() => tick(name), every);
}

function show(name) {
  if (!sessionStorage.getItem(TOKEN + ".in")) return showSignIn();
  if (!PAGES[name]) name = "overview";
  clearTimeout(timer);
  current = name;
  $("signin").hidden = true;
  $("signout").hidden = false;
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== `page-${name}`;
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page === name) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  document.title = `${name[0].toUpperCase()}${name.slice(1)} · Velox console`;
  $("main").focus();
  tick(name);
}

function route() { show((location.hash.match(/^#\/(\w+)/) || [])[1]); }

function showSignIn(message) {
  clearTimeout(timer);
  current = null;
  for (const p of document.querySelectorAll(".page")) p.hidden = true;
  $("signin").hidden = false;
  $("signout").hidden = true;
  $("signin-error").textContent = message || "";
  $("token").focus();
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN);
  sessionStorage.removeItem(TOKEN + ".in");
  showSignIn(message);
}

async function signIn(ev) {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN, $("token").value.trim());
  try {
    await json("GET", `/ui/api/series?after=${Date.now() / 1000}`);
  } catch (e) {
    return signOut(e instanceof Unauthorized ? "That token was refused." : e.message);
  }
  sessionStorage.setItem(TOKEN + ".in", "1");
  $("token").value = "";
  route();
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", () => signOut("Signed out."));
  $("create-form").addEventListener("submit", createKey);
  $("edit-form").addEventListener("submit", saveEdit);
  $("edit-cancel").addEventListener("click", () => $("edit-dialog").close());
  $("confirm-form").addEventListener("submit", confirmed);
  $("confirm-no").addEventListener("click", () => $("confirm-dialog").close());
  $("secret-close").addEventListener("click", () => { $("secret-value").textContent = ""; $("secret-dialog").close(); });
  $("secret-dialog").addEventListener("close", () => { $("secret-value").textContent = ""; });
  $("secret-copy").addEventListener("click", async () => {
    const text = $("secret-value").textContent;
    try {
      await navigator.clipboard.writeText(text);
      $("secret-copied").textContent = "Copied.";
    } catch {
      const range = document.createRange();
      range.selectNodeContents($("secret-value"));
      getSelection().removeAllRanges();
      getSelection().addRange(range);
      $("secret-copied").textContent = "Selected: press Ctrl+C (⌘C) to copy.";
    }
  });
  $("profile-form").addEventListener("submit", takeProfile);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && current) { clearTimeout(timer); tick(current); }
  });
  window.addEventListener("hashchange", route);
  route();
});
