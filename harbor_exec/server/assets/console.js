// harbor-exec's live console: polls console/data every 2 s and redraws; a rollout id
// opens its detail (rollouts/<id>). No library, no request beyond this server.
// A server with an API key answers 401 without it: the page then asks for the key (or
// takes it from the address's fragment, #key=..., which browsers never send), keeps it in
// this tab's sessionStorage only, and sends it as the Authorization header of its fetches.
"use strict";

const POLL_MS = 2000;
const KEY_ITEM = "harbor-exec-api-key";
let lastData = null;
let lastOk = 0;
let pollTimer = null;

function takeKeyFromFragment() {
  const match = /^#key=(.+)$/.exec(window.location.hash);
  if (!match) return false;
  sessionStorage.setItem(KEY_ITEM, decodeURIComponent(match[1]));
  // Off the address bar and the history at once.
  history.replaceState(null, "", window.location.pathname + window.location.search);
  return true;
}

function api(path) {
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  return fetch(path, { cache: "no-store", headers }).then((response) => {
    if (response.status === 401) askForKey(key ? "that key was refused" : "");
    return response;
  });
}

function askForKey(note) {
  if (note) sessionStorage.removeItem(KEY_ITEM);
  const form = document.getElementById("signin");
  document.getElementById("signin-note").textContent = note;
  if (form.hidden) {
    form.hidden = false;
    document.getElementById("signin-key").focus();
  }
}

function signIn(event) {
  event.preventDefault();
  const input = document.getElementById("signin-key");
  const key = input.value.trim();
  input.value = "";
  if (!key) return;
  sessionStorage.setItem(KEY_ITEM, key);
  document.getElementById("signin").hidden = true;
  clearTimeout(pollTimer);
  poll();
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function num(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  return digits === undefined ? String(value) : value.toFixed(digits);
}

function bytes(value) {
  if (!value) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (value >= 1024 && i < units.length - 1) { value /= 1024; i += 1; }
  return `${value.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function rolloutLink(id) {
  return el("a", { class: "rollout", "data-rollout": id, onclick: () => openDetail(id) }, id);
}

function table(id, headers, rows, empty) {
  const target = document.getElementById(id);
  const head = el("tr", {}, headers.map((h) => el("th", {}, h)));
  const body = rows.length
    ? rows.map((cells) => el("tr", {}, cells.map((c) =>
        c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c))))
    : [el("tr", {}, el("td", { class: "empty", colspan: String(headers.length) }, empty || "none"))];
  target.replaceChildren(el("thead", {}, head), el("tbody", {}, body));
}

function numCell(value, digits) {
  return el("td", { class: "num" }, num(value, digits));
}

function statusCell(status) {
  return el("td", { class: `status-${status}` }, status);
}

function spark(values) {
  const width = 90, height = 18, n = values.length;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  values.forEach((v, i) => {
    const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    const w = Math.max(1, width / Math.max(n, 1) - 1);
    const r = v === null ? 0 : Math.max(0, Math.min(1, v));
    const h = v === null ? 2 : Math.max(2, r * height);
    rect.setAttribute("x", (i * width) / Math.max(n, 1));
    rect.setAttribute("y", height - h);
    rect.setAttribute("width", w);
    rect.setAttribute("height", h);
    rect.setAttribute("fill", v === null ? "#b42318" : "#175cd3");
    svg.append(rect);
  });
  return svg;
}

function render(data) {
  const counts = data.counts || {};
  document.getElementById("counts").replaceChildren(
    ...["queued", "running", "grading", "success", "failure", "cancelled"].map((name) =>
      el("div", { class: "card", id: `count-${name}` },
        el("div", { class: "muted" }, name),
        el("div", { class: "n" }, num(counts[name] || 0))))
  );
  document.getElementById("running-total").textContent = `(${data.running_total})`;
  table("running", ["rollout", "task", "phase", "in phase s", "age s"],
    data.running.map((r) => [rolloutLink(r.rollout_id), r.task || "–",
      el("td", { class: `phase-${r.phase}` }, r.phase), numCell(r.phase_sec, 1),
      numCell(r.age_sec, 1)]), "nothing running");
  table("recent", ["rollout", "task", "status", "reward", "s", "reason"],
    data.recent.map((r) => [rolloutLink(r.rollout_id), r.task || "–", statusCell(r.status),
      numCell(r.reward, 3), numCell(r.seconds, 2),
      r.err_category ? `${r.err_category}: ${r.reason || ""}` : (r.reason || "")]));
  const failureRows = (origin) => data.failures
    .filter((f) => (origin === "infrastructure") === (f.origin === "infrastructure"))
    .map((f) => [f.category, f.origin, f.reason, numCell(f.count), rolloutLink(f.last_rollout_id)]);
  table("failures-infrastructure", ["category", "origin", "reason", "count", "last"],
    failureRows("infrastructure"));
  table("failures-agent", ["category", "origin", "reason", "count", "last"], failureRows("agent"));
  const phaseRows = (phases) => Object.entries(phases).map(([name, p]) =>
    [name, numCell(p.count), numCell(p.p50, 3), numCell(p.p95, 3), numCell(p.p99, 3)]);
  table("phases", ["phase", "n", "p50", "p95", "p99"], phaseRows(data.phases));
  const perNode = document.getElementById("node-phases");
  perNode.replaceChildren(...Object.entries(data.node_phases).map(([node, phases]) => {
    const holder = el("table", { id: `node-phases-${node}` });
    const wrap = el("div", {}, el("h2", {}, `node ${node}`), holder);
    perNode.append(wrap);
    table(holder.id, ["phase", "n", "p50", "p95", "p99"], phaseRows(phases));
    return wrap;
  }));
  document.getElementById("tasks-total").textContent = `(${data.tasks_total})`;
  table("tasks", ["task", "rollouts", "ok", "failed", "mean reward", "pass rate", "recent", ""],
    data.tasks.map((t) => [t.task, numCell(t.rollouts), numCell(t.success), numCell(t.failure),
      numCell(t.mean_reward, 3), numCell(t.pass_rate, 2), spark(t.recent_rewards),
      t.flag ? el("span", { class: `flag ${t.flag}` }, t.flag.replace("_", " ")) : ""]));
  table("groups", ["group", "task", "rollouts", "reward"],
    data.groups_all_equal.map((g) => [g.group, g.task || "–", numCell(g.rollouts),
      numCell(g.reward, 3)]), "none so far");
  const cache = data.package_cache || {};
  const served = (cache.hits || 0) + (cache.revalidated || 0);
  const asked = served + (cache.misses || 0);
  table("package-cache", ["figure", "value"], [
    ["hit rate", asked ? `${((100 * served) / asked).toFixed(1)} %` : "–"],
    ["requests", numCell(cache.requests || 0)],
    ["hits", numCell(cache.hits || 0)],
    ["misses", numCell(cache.misses || 0)],
    ["bytes from cache", bytes(cache.bytes_cache || 0)],
    ["bytes from upstream", bytes(cache.bytes_upstream || 0)],
    ["stored", bytes(cache.stored_bytes || 0)],
  ]);
  table("nodes", ["node", "address", "alive", "slots", "in use"],
    data.nodes.map((n) => [n.node, n.address, n.alive ? "yes" : "no", numCell(n.slots),
      numCell(n.in_use)]), "one machine");
}

async function openDetail(id) {
  const section = document.getElementById("detail");
  const body = document.getElementById("detail-body");
  document.getElementById("detail-id").textContent = id;
  section.hidden = false;
  body.replaceChildren(el("p", { class: "muted" }, "loading…"));
  const response = await api(`rollouts/${encodeURIComponent(id)}`);
  if (!response.ok) {
    body.replaceChildren(el("p", {}, `not found (${response.status})`));
    return;
  }
  const d = await response.json();
  const facts = [
    ["status", d.status], ["task", d.task], ["reward", num(d.reward, 3)],
    ["seconds", num(d.seconds, 2)], ["error", d.err_category ? `${d.err_category}: ${d.reason}` : d.reason],
    ["node", d.node], ["trial", d.trial], ["trial directory", d.trial_dir], ["ended in", d.phase],
    ["admitted", d.admitted_at], ["finished", d.finished_at],
  ].filter(([, v]) => v !== null && v !== undefined && v !== "–");
  body.replaceChildren(
    el("table", { id: "detail-facts" }),
    el("h2", {}, "phases"), el("table", { id: "detail-phases" }),
    el("h2", {}, "files"), el("table", { id: "detail-files" }),
    el("h2", {}, "metadata"), el("pre", {}, JSON.stringify(d.metadata, null, 2)),
    el("h2", {}, "metrics"), el("pre", {}, JSON.stringify(d.metrics, null, 2)),
  );
  table("detail-facts", ["", ""], facts);
  table("detail-phases", ["phase", "from", "seconds"],
    d.phases.map((p) => [p.name, p.source, numCell(p.seconds, 3)]));
  table("detail-files", ["file", "path"], d.files.map((f) => [
    f.url ? el("a", { class: "rollout", "data-file": f.name, onclick: () => openFile(f) }, f.name) : f.name,
    f.path,
  ]));
  body.append(el("pre", { id: "detail-file", hidden: "" }));
  section.scrollIntoView({ block: "nearest" });
}

async function openFile(file) {
  const shown = document.getElementById("detail-file");
  shown.hidden = false;
  shown.textContent = "loading…";
  const response = await api(file.url);
  shown.textContent = response.ok ? await response.text() : `not found (${response.status})`;
  shown.dataset.file = file.name;
}

async function poll() {
  try {
    const response = await api("console/data");
    if (response.ok) {
      document.getElementById("signin").hidden = true;
      lastData = await response.json();
      lastOk = Date.now();
      render(lastData);
    }
  } catch (error) {
    // The server is away: say so below and try again.
  }
  const updated = document.getElementById("updated");
  const signingIn = !document.getElementById("signin").hidden;
  updated.textContent = lastOk
    ? `updated ${new Date(lastOk).toLocaleTimeString()}`
    : signingIn ? "needs the API key" : "waiting for the server…";
  updated.dataset.polls = String(Number(updated.dataset.polls || 0) + 1);
  // Waiting for a key: no request until one is given.
  if (!signingIn) pollTimer = setTimeout(poll, POLL_MS);
}

takeKeyFromFragment();
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("signin").addEventListener("submit", signIn);
  // A #key=... given to the open page (pasted into its address bar).
  window.addEventListener("hashchange", () => {
    if (!takeKeyFromFragment()) return;
    document.getElementById("signin").hidden = true;
    clearTimeout(pollTimer);
    poll();
  });
  document.getElementById("detail-close").addEventListener("click", () => {
    document.getElementById("detail").hidden = true;
  });
  poll();
});
