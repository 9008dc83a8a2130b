// The tridens dashboard: three pages drawn from the JSON API, polled every POLL_MS (no reload).
"use strict";

const POLL_MS = 2000;
const main = document.getElementById("main");
const enc = encodeURIComponent;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

async function api(path) {
  const res = await fetch(path, {cache: "no-store"});
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v === "number") return Number.isInteger(v) ? v.toLocaleString("en") : v.toPrecision(4);
  return typeof v === "string" ? v : JSON.stringify(v);
}
function fmtShort(v) { return typeof v === "number" ? String(Number(v.toPrecision(3))) : fmt(v); }
function fmtSeconds(s) { return s === null || s === undefined ? "-" : s < 120 ? s.toFixed(1) + " s" : (s / 60).toFixed(1) + " min"; }
function sampleText(sample) { return Object.entries(sample).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", "); }
function statusCell(s) { return el("td", {class: "status-" + s, text: s}); }
function lastLine(text) { const lines = (text || "").trim().split("\n"); return lines[lines.length - 1]; }
// finished trials against the trial limit; a run without one (one-shot, a strategy that ends itself) shows the count
function progressText(e) { return e.max_trials === null ? `${e.finished}` : `${e.finished}/${e.max_trials}`; }
// a warm start as a sentence: the zoo model it started from and the match score
function warmText(w, name) {
  if (!w) return "-";
  if (w.parent === null || w.parent === undefined) return "cold (no zoo model matched)";
  const from = w.parent_number === null || w.parent_number === undefined ? `zoo entry ${w.parent}`
    : (w.parent_experiment && w.parent_experiment !== name ? `${w.parent_experiment} ` : "") + "#" + w.parent_number;
  return `from ${from}` + (typeof w.score === "number" ? ` (match score ${w.score.toFixed(2)})` : "");
}
// a one-shot trial's role: the supernet, a subnet scored with its weights, or an architecture retrained from scratch
const ROLES = {supernet: "supernet", subnet: "supernet-scored", retrain: "retrained"};
function oneshotText(o) {
  if (!o) return "-";
  const role = ROLES[o.role] || o.role || "-";
  if (o.role === "subnet") return `${role} (weights inherited from the supernet${o.supernet !== undefined ? " #" + o.supernet : ""})`;
  if (o.role === "retrain") return `${role} from scratch${o.of !== undefined ? " (the architecture of #" + o.of + ")" : ""}`;
  return role;
}

function section(id, title, ...children) {
  return el("section", {id}, el("h2", {text: title}), ...children);
}

function setLive(ok, text) {
  const live = document.getElementById("live");
  live.textContent = ok ? "live · updated " + new Date().toLocaleTimeString() : "not updated: " + text;
}

function poll(fn) {
  let stopped = false;
  async function tick() {
    try { await fn(); setLive(true); } catch (err) { setLive(false, err.message); }
    if (!stopped) setTimeout(tick, POLL_MS);
  }
  tick();
  return () => { stopped = true; };
}

const layoutBase = {margin: {l: 50, r: 10, t: 10, b: 40}, font: {size: 11}, legend: {orientation: "h", y: -0.25}};
const config = {displaylogo: false, responsive: true};

// ---------------------------------------------------------------- experiments list

function experimentsPage() {
  document.getElementById("where").textContent = "experiments";
  const table = el("table", {id: "experiments-table"});
  const plot = el("div", {id: "best-over-time", class: "plot"});
  main.append(section("experiments", "Experiments", table), section("best", "Best so far over time", plot));
  poll(async () => {
    const data = await api("/api/experiments");
    if (!data.exists) {
      table.replaceChildren(el("tr", {}, el("td", {id: "waiting", class: "muted",
        text: `no store at ${data.store} yet: its experiments appear here once a run creates it`})));
      return;
    }
    const head = el("tr", {}, ...["experiment", "status", "progress", "trials", "by status", "best", "objective", "strategy"]
      .map(h => el("th", {text: h})));
    const rows = data.experiments.map(e => {
      const pct = e.progress === null ? null : Math.round(100 * e.progress);
      return el("tr", {"data-name": e.name},
        el("td", {}, el("a", {href: "/experiments/" + enc(e.name), text: e.name})),
        e.damaged ? el("td", {class: "status-failed damaged", title: e.damaged, text: "damaged"}) : statusCell(e.status),
        el("td", {}, el("span", {class: "bar"}, el("span", {style: `width:${pct || 0}%`})),
          " " + progressText(e)),
        el("td", {class: "num", text: e.trials}),
        el("td", {text: Object.entries(e.by_status).map(([k, v]) => `${k} ${v}`).join(", ")}),
        el("td", {class: "num", text: fmt(e.best)}),
        el("td", {text: `${e.objective.metric} (${e.objective.mode})`}),
        el("td", {class: "sample", text: e.strategy || "-"}));
    });
    table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
    const traces = [];
    for (const e of data.experiments.slice(0, 10)) {
      const detail = await api("/api/experiments/" + enc(e.name));
      const pts = detail.best_over_time;
      traces.push({x: pts.map(p => new Date(p.time * 1000)), y: pts.map(p => p.best), name: e.name,
                   mode: "lines+markers", line: {shape: "hv"}});
    }
    Plotly.react(plot, traces, {...layoutBase, yaxis: {title: {text: "best"}}}, config);
  });
}

// ---------------------------------------------------------------- one experiment

function experimentPage(name) {
  document.getElementById("where").textContent = "/ " + name;
  const state = {offset: 0, limit: 50, sort: "number", desc: false, statuses: new Set(), filters: {},
                 selected: new Set(), metric: null, evaluator: "ped-anova", finished: -1, labels: []};
  const summary = el("div", {id: "summary"});
  const bestPlot = el("div", {id: "best-plot", class: "plot", style: "height:220px"});
  const statusBoxes = el("span", {id: "status-filter"});
  const labelSelect = el("select", {id: "label-filter-label"});
  const labelValue = el("input", {id: "label-filter-value", placeholder: "value", size: 10});
  const filterText = el("span", {id: "filters", class: "muted"});
  const pager = el("span", {id: "pager"});
  const table = el("table", {id: "trials-table"});
  const metricSelect = el("select", {id: "metric-select"});
  const curves = el("div", {id: "curves", class: "plot"});
  const parcoords = el("div", {id: "parcoords", class: "plot"});
  const scatters = el("div", {id: "scatters", class: "grid"});
  const hparamsNote = el("div", {class: "muted", id: "hparams-note"});
  const evaluatorSelect = el("select", {id: "importance-evaluator"},
    el("option", {value: "ped-anova", text: "PED-ANOVA"}), el("option", {value: "fanova", text: "fANOVA"}));
  const importance = el("div", {id: "importance"});
  const importanceNote = el("div", {class: "muted", id: "importance-note"});
  const paretoPlot = el("div", {id: "pareto", class: "plot"});
  const paretoNote = el("div", {class: "muted", id: "pareto-note"});
  const plan = el("div", {id: "plan"});
  const oneshot = el("div", {id: "oneshot"});
  const stageTree = el("div", {id: "stage-tree"});

  function refreshTable() { tableTick().catch(err => setLive(false, err.message)); }
  const applyFilter = el("button", {text: "add filter", onclick: () => {
    if (labelSelect.value && labelValue.value !== "") { state.filters[labelSelect.value] = labelValue.value; state.offset = 0; refreshTable(); }
  }});
  const clearFilter = el("button", {text: "clear filters", onclick: () => { state.filters = {}; state.offset = 0; refreshTable(); }});
  for (const s of ["completed", "stopped", "failed", "running", "pending", "duplicate"]) {
    const box = el("input", {type: "checkbox", value: s, onchange: () => {
      box.checked ? state.statuses.add(s) : state.statuses.delete(s); state.offset = 0; refreshTable(); }});
    statusBoxes.append(el("label", {}, box, " " + s));
  }
  metricSelect.addEventListener("change", () => { state.metric = metricSelect.value; curvesTick(); });
  evaluatorSelect.addEventListener("change", () => { state.evaluator = evaluatorSelect.value; state.finished = -1; state.slowAt = 0; slowTick(); });

  main.append(
    section("overview", "Overview", summary, bestPlot),
    section("trials", "Trials", el("div", {class: "controls"}, "status: ", statusBoxes),
      el("div", {class: "controls"}, "label ", labelSelect, " = ", labelValue, " ", applyFilter, " ", clearFilter, " ", filterText),
      el("div", {class: "controls"}, pager), table),
    section("learning-curves", "Learning curves", el("div", {class: "controls"}, "metric ", metricSelect,
      el("span", {class: "muted", text: "  tick trials in the table (default: the 5 best); solid: completed, dashed + ×: stopped early, ▲: promoted past a step where others were stopped, dotted: failed"})), curves),
    section("hyperparameters", "Hyperparameters", hparamsNote, el("h2", {text: "Parallel coordinates"}), parcoords,
      el("h2", {text: "Objective vs each label"}), scatters),
    section("importance-section", "Hyperparameter importance (optuna.importance)", el("div", {class: "controls"}, "evaluator ", evaluatorSelect), importanceNote, importance),
    section("pareto-section", "Pareto front", paretoNote, paretoPlot),
    section("plan-section", "Cross-model plan", plan),
    section("stages-section", "Stage tree", stageTree),
    section("oneshot-section", "One-shot", oneshot));

  let info = null;

  async function summaryTick() {
    info = await api("/api/experiments/" + enc(name));
    const pct = info.progress === null ? 0 : Math.round(100 * info.progress);
    summary.replaceChildren(
      el("div", {}, el("b", {text: name}), " ", el("span", {class: "status-" + info.status, text: info.status}),
        " · ", el("span", {class: "bar"}, el("span", {style: `width:${pct}%`})),
        ` ${progressText(info)} finished · best ${info.objective.metric} `,
        el("b", {id: "best-value", text: fmt(info.best)}), ` (${info.objective.mode})`),
      el("div", {class: "muted", text: `strategy ${info.strategy || "-"} · evaluator ${info.evaluator || "-"}`}),
      el("div", {class: "muted", text: "by status: " + Object.entries(info.by_status).map(([k, v]) => `${k} ${v}`).join(", ")}));
    const pts = info.best_over_time;
    Plotly.react(bestPlot, [{x: pts.map(p => new Date(p.time * 1000)), y: pts.map(p => p.best), mode: "lines+markers",
      line: {shape: "hv"}, name: "best so far", text: pts.map(p => "trial id " + p.trial)}],
      {...layoutBase, height: 220, yaxis: {title: {text: "best " + info.objective.metric}}}, config);
    if (JSON.stringify(info.labels) !== JSON.stringify(state.labels)) {
      state.labels = info.labels;
      labelSelect.replaceChildren(...info.labels.map(l => el("option", {value: l, text: l})));
    }
    const metrics = info.metrics;
    if (!state.metric || !metrics.includes(state.metric)) {
      state.metric = metrics.includes(info.objective.metric) ? info.objective.metric : metrics[0] || null;
    }
    if (metricSelect.options.length !== metrics.length) {
      metricSelect.replaceChildren(...metrics.map(m => el("option", {value: m, text: m})));
    }
    metricSelect.value = state.metric || "";
  }

  let lastRows = [];
  async function tableTick() {
    const params = new URLSearchParams({offset: state.offset, limit: state.limit, sort: state.sort, desc: state.desc ? "1" : "0"});
    if (state.statuses.size) params.set("status", [...state.statuses].join(","));
    for (const [k, v] of Object.entries(state.filters)) params.set("label." + k, v);
    const page = await api(`/api/experiments/${enc(name)}/trials?${params}`);
    lastRows = page.rows;
    filterText.textContent = Object.entries(state.filters).map(([k, v]) => `${k} = ${v}`).join(", ");
    const roles = page.rows.some(t => t.role);  // a one-shot run: supernet-scored or retrained
    const columns = [["", null], ["trial", "number"], ["status", "status"], ...(roles ? [["role", null]] : []),
      [info ? info.objective.metric : "metric", "metric"],
      ["epochs", "epochs"], ["params", "params"], ["FLOPs", "flops"], ["seed", "seed"], ["duration", "duration"],
      ["group", "group"], ["sample", null], ["error", null]];
    const head = el("tr", {}, ...columns.map(([title, key]) => {
      if (!key) return el("th", {text: title});
      const arrow = state.sort === key ? (state.desc ? " ▼" : " ▲") : "";
      return el("th", {class: "sortable", "data-sort": key, text: title + arrow, onclick: () => {
        state.desc = state.sort === key ? !state.desc : key === "metric" && info && info.objective.mode === "max";
        state.sort = key; state.offset = 0; refreshTable(); }});
    }));
    const rows = page.rows.map(t => {
      const box = el("input", {type: "checkbox", class: "select-trial", "data-id": t.id, onchange: () => {
        box.checked ? state.selected.add(t.id) : state.selected.delete(t.id); curvesTick(); }});
      box.checked = state.selected.has(t.id);
      const error = t.damaged ? el("span", {class: "status-failed damaged", text: "damaged row: " + t.damaged})
        : t.error ? el("details", {}, el("summary", {text: lastLine(t.error)}), el("pre", {text: t.error})) : "";
      return el("tr", {"data-trial-id": t.id, "data-number": t.number},
        el("td", {}, box),
        el("td", {}, el("a", {href: `/experiments/${enc(name)}/trials/${t.number}`, text: "#" + t.number})),
        statusCell(t.status), roles ? el("td", {class: "role", text: t.role || "-"}) : null,
        el("td", {class: "num", text: fmt(t.metric)}), el("td", {class: "num", text: t.epochs}),
        el("td", {class: "num", text: fmt(t.params)}), el("td", {class: "num", text: fmt(t.flops)}),
        el("td", {class: "num", text: t.seed}), el("td", {class: "num", text: fmtSeconds(t.duration)}),
        el("td", {class: "num", text: fmt(t.group)}), el("td", {class: "sample", text: sampleText(t.sample)}),
        el("td", {class: "sample"}, error));
    });
    table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
    const last = Math.min(page.offset + page.limit, page.total);
    pager.replaceChildren(
      el("button", {text: "◀ previous", disabled: page.offset === 0 ? "" : null,
        onclick: () => { state.offset = Math.max(0, state.offset - state.limit); refreshTable(); }}),
      ` ${page.total ? page.offset + 1 : 0}-${last} of `, el("span", {id: "total", text: page.total}), " ",
      el("button", {text: "next ▶", disabled: last >= page.total ? "" : null,
        onclick: () => { state.offset += state.limit; refreshTable(); }}));
  }

  async function curvesTick() {
    if (!state.metric) { Plotly.react(curves, [], {...layoutBase}, config); return; }
    let ids = [...state.selected];
    const numbers = Object.fromEntries(lastRows.map(r => [r.id, r.number]));
    if (!ids.length) {
      const best = await api(`/api/experiments/${enc(name)}/trials?limit=5&sort=metric&desc=${info && info.objective.mode === "max" ? 1 : 0}`);
      ids = best.rows.map(r => r.id);
      for (const r of best.rows) numbers[r.id] = r.number;
    }
    if (!ids.length) { Plotly.react(curves, [], {...layoutBase}, config); return; }
    const data = await api(`/api/experiments/${enc(name)}/curves?ids=${ids.join(",")}&metric=${enc(state.metric)}`);
    const stopSteps = new Set(info ? info.stop_steps : []);
    const traces = ids.filter(id => data[id] && data[id].metrics[state.metric]).map(id => {
      const c = data[id], s = c.metrics[state.metric];
      const dash = c.status === "stopped" ? "dash" : c.status === "failed" ? "dot" : "solid";
      // promoted: went on past a step at which the strategy stopped other trials (a rung)
      const last = s.steps[s.steps.length - 1];
      const promotedAt = s.steps.filter(step => stopSteps.has(step) && step < last);
      const symbols = s.steps.map((step, i) => c.status === "stopped" && i === s.steps.length - 1 ? "x"
        : promotedAt.includes(step) ? "triangle-up" : "circle");
      const label = numbers[id] !== undefined ? "#" + numbers[id] : "id " + id;
      const promoted = promotedAt.length ? `, promoted at step ${promotedAt.join(", ")}` : "";
      return {x: s.steps, y: s.values, mode: "lines+markers", name: `${label} (${c.status}${promoted})`,
              line: {dash}, marker: {symbol: symbols, size: symbols.map(m => m === "circle" ? 5 : 11)}};
    });
    // a vertical legend beside the plot scrolls when it holds more curves than fit (40 ticked trials)
    Plotly.react(curves, traces, {...layoutBase, showlegend: true, legend: {orientation: "v", x: 1.02, y: 1, font: {size: 10}},
      margin: {...layoutBase.margin, r: 180}, xaxis: {title: {text: "step (epoch)"}}, yaxis: {title: {text: state.metric}}}, config);
  }

  // Hyperparameter views, importance, Pareto front and plan: when trials finished, at most every 10 s.
  async function slowTick() {
    if (!info || info.finished === state.finished || Date.now() - (state.slowAt || 0) < 10000) return;
    state.finished = info.finished;
    state.slowAt = Date.now();
    const h = await api(`/api/experiments/${enc(name)}/hparams`);
    const metric = info.objective.metric;
    hparamsNote.textContent = h.sampled ? `${h.values.length} of ${h.total} finished trials: the ${h.best} best and a uniform sample of the others` : "";
    const logs = new Set(h.log_labels || []);
    const dims = h.labels.map(label => {
      const vals = h.samples.map(s => s[label]);
      if (logs.has(label) && vals.every(v => (typeof v === "number" && v > 0) || v === undefined)) {
        // parallel coordinates have no log axis: the axis is log10 of the value, ticked at powers of ten
        const present = vals.filter(v => v !== undefined);
        const lo = Math.floor(Math.log10(Math.min(...present))), hi = Math.ceil(Math.log10(Math.max(...present)));
        const ticks = [...Array(hi - lo + 1).keys()].map(i => lo + i);
        return {label: label + " (log)", values: vals.map(v => v === undefined ? NaN : Math.log10(v)),
                tickvals: ticks, ticktext: ticks.map(t => String(Number((10 ** t).toPrecision(1))))};
      }
      if (vals.every(v => typeof v === "number" || v === undefined)) return {label, values: vals.map(v => v === undefined ? NaN : v)};
      const cats = [...new Set(vals.map(v => JSON.stringify(v)))];
      return {label, values: vals.map(v => cats.indexOf(JSON.stringify(v))), tickvals: cats.map((_, i) => i), ticktext: cats};
    });
    dims.push({label: metric, values: h.values});
    Plotly.react(parcoords, h.values.length ? [{type: "parcoords", line: {color: h.values, colorscale: "Viridis", showscale: true},
      dimensions: dims}] : [], {...layoutBase, margin: {l: 60, r: 60, t: 40, b: 20}}, config);
    scatters.replaceChildren();
    for (const label of h.labels) {
      const div = el("div", {class: "scatter", "data-label": label});
      scatters.append(div);
      const xs = h.samples.map(s => typeof s[label] === "number" || s[label] === undefined ? s[label] : JSON.stringify(s[label]));
      Plotly.react(div, [{x: xs, y: h.values, mode: "markers", type: h.values.length > 2000 ? "scattergl" : "scatter",
        text: h.numbers.map(n => "#" + n), marker: {size: 5, opacity: 0.7}}],
        {...layoutBase, height: 240, xaxis: {title: {text: label}, type: logs.has(label) ? "log" : "-"},
         yaxis: {title: {text: metric}}}, config);
    }
    const imp = await api(`/api/experiments/${enc(name)}/importance?evaluator=${state.evaluator}`);
    importanceNote.textContent = imp.message || `${imp.trials} trials (${imp.basis || "completed trials"}), ${state.evaluator}`;
    const entries = Object.entries(imp.importances).reverse();
    Plotly.react(importance, entries.length ? [{type: "bar", orientation: "h", x: entries.map(e => e[1]), y: entries.map(e => e[0])}] : [],
      {...layoutBase, margin: {...layoutBase.margin, l: 140}, height: 60 + 30 * Math.max(entries.length, 1),
       xaxis: {title: {text: "importance"}}}, config);
    const p = await api(`/api/experiments/${enc(name)}/pareto`);
    paretoNote.textContent = p.message || (p.sampled ? `${p.ids.length} of ${p.total} finished trials: the Pareto front and a uniform sample of the others` : "");
    if (!p.message) {
      const idx = (on) => p.ids.map((_, i) => i).filter(i => p.front[i] === on);
      const trace = (on, nm) => ({x: idx(on).map(i => p.second[i]), y: idx(on).map(i => p.values[i]), mode: "markers",
        name: nm, text: idx(on).map(i => "#" + p.numbers[i]), marker: {size: on ? 9 : 5}});
      Plotly.react(paretoPlot, [trace(false, "dominated"), trace(true, "Pareto front")],
        {...layoutBase, xaxis: {title: {text: `${p.second_objective.metric} (${p.second_objective.mode})`}},
         yaxis: {title: {text: `${p.objective.metric} (${p.objective.mode})`}}}, config);
    } else {
      paretoPlot.style.display = "none";
    }
    await planTick();
  }

  async function planTick() {
    const p = await api(`/api/experiments/${enc(name)}/plan`);
    const nums = (list) => list.map(n => n === null ? "?" : "#" + n).join(" ");
    const secs = (v) => v === null || v === undefined ? "-" : v.toFixed(2);
    const note = p.units_recorded ? "" :
      "This store records no execution units (which trials trained fused or shared a pipeline); shown: the TrialGroups, their training seconds, and warm starts, parents and duplicates as recorded.";
    const speedText = (u) => u.speedups.map(e => `${e.speedup.toFixed(2)}x ${e.fused ? "fused" : "separate"} (${nums(e.trials)})`).join("; ") || "-";
    const units = el("table", {id: "plan-units"}, el("tr", {}, ...["unit", "trials", "shared", "why", "measured speed-up", "training s", "epochs (tree / alone)", "saved s (estimate)"]
      .map(h => el("th", {text: h}))),
      ...p.units.map(u => el("tr", {"data-kind": u.kind}, el("td", {class: "kind-" + (u.kind || "").replace(/ /g, "-"), text: u.kind || "-"}),
        el("td", {class: "sample", text: nums(u.trials)}), el("td", {class: "sample", text: u.shared.join("; ") || "-"}),
        el("td", {class: "sample", text: u.reason || "-"}), el("td", {class: "sample", text: speedText(u)}),
        el("td", {class: "num", text: secs(u.train_seconds)}),
        el("td", {class: "num", text: u.epochs_trained === null ? "-" : `${u.epochs_trained} / ${u.trial_epochs}`}),
        el("td", {class: "num", text: u.saved_seconds === null ? "not measured" : secs(u.saved_seconds)}))));
    const groups = el("table", {id: "plan-groups"}, el("tr", {}, ...["group", "trials", "training seconds"].map(h => el("th", {text: h}))),
      ...p.groups.map(g => el("tr", {}, el("td", {text: fmt(g.group)}), el("td", {class: "num", text: g.trials}),
        el("td", {class: "num", text: secs(g.train_seconds)}))));
    const link = (n) => n === null || n === undefined ? "-" : el("a", {href: `/experiments/${enc(name)}/trials/${n}`, text: "#" + n});
    const rel = el("table", {id: "plan-relations"}, el("tr", {}, ...["trial", "parent", "warm start", "forked from (PBT)", "duplicate of", "one-shot"].map(h => el("th", {text: h}))),
      ...p.relations.map(r => el("tr", {}, el("td", {}, link(r.trial)), el("td", {}, link(r.parent)),
        el("td", {class: "sample", text: warmText(r.warm_start, name)}),
        el("td", {}, ...(r.exploits.length ? r.exploits.flatMap(e => [link(e.from), ` at epoch ${e.epoch} `]) : ["-"])),
        el("td", {}, link(r.duplicate_of)),
        el("td", {class: "sample", text: oneshotText(r.oneshot)}))));
    const saved = p.saved_seconds === null ? "not measured" : p.saved_seconds.toFixed(2);
    plan.replaceChildren(el("div", {class: "muted", text: note}),
      el("div", {id: "plan-totals", text: `training seconds in all: ${secs(p.train_seconds)} · saved by the plan (estimate): ${saved}`}),
      el("div", {class: "muted", text: "saved: a stage tree's trial-epochs it did not train, at its measured seconds per epoch; a fused unit's measured speed-up, where recorded"}),
      el("h2", {text: "Execution units"}), p.units.length ? units : el("div", {class: "muted", text: "none recorded"}),
      el("h2", {text: "Relations"}), p.relations.length ? rel : el("div", {class: "muted", text: "no warm starts, forks, parents or duplicates recorded"}),
      el("h2", {text: "TrialGroups"}), groups);
    await stagesTick();
    const o = await api(`/api/experiments/${enc(name)}/oneshot`);
    if (!o.supernets.length && !o.subnets.length) {
      oneshot.replaceChildren(el("div", {class: "muted", text: "not a one-shot experiment (no supernet recorded)"}));
      return;
    }
    const plotDiv = el("div", {class: "plot", id: "supernet-curves"});
    const traces = [];
    for (const s of o.supernets) for (const [m, c] of Object.entries(s.metrics))
      traces.push({x: c.steps, y: c.values, name: `supernet #${s.number}: ${m}`, mode: "lines+markers"});
    const subs = el("table", {id: "subnets"}, el("tr", {}, ...["trial", "status", "role", info ? info.objective.metric : "metric", "sample"].map(h => el("th", {text: h}))),
      ...o.subnets.map(s => el("tr", {"data-role": ROLES[s.oneshot.role] || s.oneshot.role}, el("td", {}, link(s.number)), statusCell(s.status),
        el("td", {class: "role", text: oneshotText(s.oneshot)}), el("td", {class: "num", text: fmt(s.metric)}),
        el("td", {class: "sample", text: sampleText(s.sample)}))));
    const retrained = o.subnets.filter(s => s.oneshot.role === "retrain").length;
    oneshot.replaceChildren(el("h2", {text: "Supernet training"}), plotDiv,
      el("h2", {text: `Subnets (${o.subnets.length - retrained} scored with the supernet's weights` +
        (retrained ? `, ${retrained} retrained from scratch: these rank first` : "") + ")"}), subs);
    Plotly.react(plotDiv, traces, {...layoutBase, margin: {...layoutBase.margin, b: 70}, showlegend: true,
      xaxis: {title: {text: "step (epoch)"}}}, config);
  }

  async function stagesTick() {
    const t = await api(`/api/experiments/${enc(name)}/stages`);
    if (!t.stages.length) {
      stageTree.replaceChildren(el("div", {class: "muted", text: "no stage tree (no trials shared a training prefix)"}));
      return;
    }
    const children = new Map();
    const ids = new Set(t.stages.map(s => s.id));
    for (const s of t.stages) {
      const parent = ids.has(s.parent) ? s.parent : null;
      if (!children.has(parent)) children.set(parent, []);
      children.get(parent).push(s);
    }
    const lrText = (lr) => !lr.length ? "" : lr[0] === lr[lr.length - 1] ? `lr ${fmtShort(lr[0])}` : `lr ${fmtShort(lr[0])}→${fmtShort(lr[lr.length - 1])}`;
    const branch = (parent) => el("ul", {}, ...(children.get(parent) || []).map(s => el("li", {"data-stage": s.id},
      el("span", {class: "stage-" + s.status, text: `${s.label} · epochs ${s.epochs[0]}–${s.epochs[1]}`}),
      ` · ${lrText(s.lr)}${s.batch_size.length ? " · bs " + s.batch_size.join("/") : ""} · trials ${s.trials.map(n => "#" + n).join(" ")}`,
      s.status === "failed" ? el("span", {class: "status-failed", text: ` · failed: ${s.error || ""}`}) : "",
      !s.checkpoint && s.status !== "failed" ? el("span", {class: "muted", text: " · checkpoint removed"}) : "",
      s.experiment !== name ? el("span", {class: "muted", text: ` · from ${JSON.stringify(s.experiment)}`}) : "",
      children.has(s.id) ? branch(s.id) : "")));
    stageTree.replaceChildren(el("div", {id: "stage-totals", text: `${t.total} stages · ${t.epochs_here} epoch(s) trained here` +
      (t.epochs_reused ? ` · ${t.epochs_reused} reused from other experiments` : "") + (t.total > t.stages.length ? ` · first ${t.stages.length} shown` : "")}),
      branch(null));
  }

  poll(async () => {
    await summaryTick();
    await tableTick();
    await curvesTick();
    await slowTick();
  });
}

// ---------------------------------------------------------------- one trial

function trialPage(name, number) {
  document.getElementById("where").textContent = `/ ${name} / trial #${number}`;
  const facts = el("table", {id: "trial-facts"});
  const metricsTable = el("table", {id: "trial-metrics"});
  const plot = el("div", {id: "trial-curves", class: "plot"});
  const error = el("div", {id: "trial-error"});
  const arch = el("div", {id: "architecture"});
  main.append(el("p", {}, el("a", {href: "/experiments/" + enc(name), text: "← " + name})),
    section("trial", `Trial #${number}`, facts), section("trial-metrics-section", "Per-epoch metrics", plot, metricsTable),
    section("error-section", "Error", error), section("architecture-section", "Architecture", arch));
  let archShown = false;
  poll(async () => {
    const t = await api(`/api/experiments/${enc(name)}/trials/${number}`);
    const link = (n) => n === null || n === undefined ? "-" : el("a", {href: `/experiments/${enc(name)}/trials/${n}`, text: "#" + n});
    const rows = [["status", el("span", {class: "status-" + t.status, text: t.status})], ["metric", fmt(t.metric)],
      ["sample", el("pre", {text: JSON.stringify(t.sample, null, 2)})], ["seed", String(t.seed)],
      ["fingerprint", t.fingerprint || "-"], ["params", fmt(t.params)], ["FLOPs", fmt(t.flops)],
      ["epochs", String(t.epochs)], ["duration", fmtSeconds(t.duration)], ["store id", String(t.id)],
      ["group", t.group === null ? "-" : `${t.group} (with ${t.group_members.filter(n => n !== t.number).map(n => "#" + n).join(", ") || "no other trial"})`],
      ["parent (warm start / inherited from)", link(t.parent_number)],
      ["children", t.children.length ? el("span", {}, ...t.children.flatMap(c => [link(c), " "])) : "-"],
      ["warm start", warmText(t.info.warm_start, name)],
      ...(t.info.oneshot ? [["one-shot role", el("span", {id: "trial-role", text: oneshotText(t.info.oneshot)})]] : []),
      ["exploits (PBT)", t.info.exploits ? el("span", {}, ...t.info.exploits.flatMap(e => [`epoch ${e.epoch}: copied `,
        link(e.from_number), `, then ${JSON.stringify(e.sample)}`, el("br")])) : "-"],
      ["execution unit", t.info.unit ? el("span", {id: "trial-unit"}, `${t.info.unit.kind} unit with `,
        ...t.unit_members.flatMap(n => [link(n), " "]), t.info.unit.reason ? `· ${t.info.unit.reason}` : "",
        ...(t.info.unit.speedups || []).map(e => ` · measured ${e.speedup.toFixed(2)}x, ${e.fused ? "fused" : "trained separately"}`))
        : "not recorded"],
      ["stages (stage tree)", t.stages.length ? el("span", {id: "trial-stages"}, t.stages.map(s =>
        `${s.label} · epochs ${s.epochs[0]}–${s.epochs[1]}` + (s.lr.length ? ` · lr ${fmtShort(s.lr[0])}` : "")
        + (s.experiment !== name ? ` (trained by ${JSON.stringify(s.experiment)})` : "")
        + (s.status === "failed" ? " (failed)" : "")).join("  →  ")) : "-"],
      ["checkpoints", Object.keys(t.checkpoints).length ? Object.entries(t.checkpoints).map(([k, p]) => `${k}: ${p}`).join("\n") : "-"],
      ["info", el("pre", {text: JSON.stringify(t.info, null, 2)})]];
    facts.replaceChildren(...rows.map(([k, v]) => el("tr", {}, el("th", {text: k}), el("td", {class: "sample"}, v))));
    const names = Object.keys(t.metrics);
    const steps = Math.max(0, ...names.map(n => t.metrics[n].steps.length));
    metricsTable.replaceChildren(el("tr", {}, el("th", {text: "step"}), ...names.map(n => el("th", {text: n}))),
      ...[...Array(steps).keys()].map(i => el("tr", {}, el("td", {class: "num", text: i}),
        ...names.map(n => el("td", {class: "num", text: fmt(t.metrics[n].values[i])})))));
    Plotly.react(plot, names.map(n => ({x: t.metrics[n].steps, y: t.metrics[n].values, name: n, mode: "lines+markers"})),
      {...layoutBase, xaxis: {title: {text: "step (epoch)"}}}, config);
    error.replaceChildren(t.error ? el("pre", {text: t.error}) : el("span", {class: "muted", text: "no error"}));
    if (!archShown) {
      archShown = true;
      const a = await api(`/api/experiments/${enc(name)}/trials/${number}/architecture`);
      arch.replaceChildren(a.available ? el("pre", {id: "graph-text", text: a.text}) :
        el("div", {}, el("div", {class: "muted", id: "architecture-reason", text: a.reason}),
          el("pre", {text: `fingerprint ${a.fingerprint}\nsample ${JSON.stringify(a.sample)}`})));
    }
  });
}

// ---------------------------------------------------------------- routing

(function route() {
  const parts = location.pathname.split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "experiments" && parts.length === 2) experimentPage(parts[1]);
  else if (parts[0] === "experiments" && parts[2] === "trials" && parts.length === 4) trialPage(parts[1], parts[3]);
  else experimentsPage();
})();
