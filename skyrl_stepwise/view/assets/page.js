// The run viewer. Reads the JSON in #data (built by skyrl_stepwise/view/page.py) and draws on demand: the list of
// a step's trajectories at once, a trajectory's tokens only when it is opened (a page of 1,000 stays fast).
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const $ = (id) => document.getElementById(id);
const FLAGS = {F: "failed", T: "truncated", E: "context-edited", X: "tampering suspected"};
const state = {stage: null, sort: "group", filters: new Set(), open: null};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}
// a trajectory's samples arrive as a string of JSON, parsed the first time the trajectory is drawn
// (advantages as [value, count] runs, expanded here to one per token)
function samplesOf(t) {
  if (typeof t.samples !== "string") return t.samples;
  t.samples = JSON.parse(t.samples);
  for (const s of t.samples) if (s.advantages) s.advantages = s.advantages.flatMap(([v, n]) => Array(n).fill(v));
  return t.samples;
}
const fmt = (v, d = 3) => (v == null ? "n/a" : Number(v).toFixed(d));
const stageKey = (t) => t.step + "|" + t.stage;

// ---- header, legend, stage list ----
function drawHeader() {
  $("run").textContent = D.run;
  for (const [code, label] of Object.entries(D.roles)) $("legend").append(el("span", {class: "r-" + code, text: label}));
  const keys = [];
  for (const t of D.trajectories) if (!keys.includes(stageKey(t))) keys.push(stageKey(t));
  keys.sort((a, b) => Number(a.split("|")[0]) - Number(b.split("|")[0]) || a.localeCompare(b));
  for (const k of keys) {
    const [step, stage] = k.split("|");
    $("stage").append(el("option", {value: k, text: stage === "train" ? "step " + step + " (train)" : stage + " (as of step " + step + ")"}));
  }
  state.stage = keys.length ? keys[keys.length - 1] : null;
  const fromHash = decodeURIComponent(location.hash.slice(1)).split("#");
  if (keys.includes(fromHash[0])) state.stage = fromHash[0];
  $("stage").value = state.stage || "";
  for (const [code, name] of Object.entries(FLAGS)) {
    const box = el("input", {type: "checkbox", "data-flag": code});
    box.addEventListener("change", () => { box.checked ? state.filters.add(code) : state.filters.delete(code); drawList(); });
    $("filters").append(el("label", {}, box, " " + name + " ", el("span", {class: "count", "data-count": code})));
  }
}

// ---- timeline: inline SVG, one panel per series group ----
function panel(title, series, steps) {
  const W = 320, H = 150, L = 34, B = 18;
  const pts = series.map(([key]) => steps.filter((s) => s[key] != null).map((s) => [s.step, s[key]]));
  const all = pts.flat();
  const fig = el("figure", {}, el("figcaption", {text: title}));
  if (!all.length) { fig.append(el("div", {class: "hint", text: "not logged in this run"})); return fig; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const X = (x) => L + (W - L - 6) * (x - x0) / (x1 - x0), Y = (y) => H - B - (H - B - 6) * (y - y0) / (y1 - y0);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const add = (tag, attrs) => { const n = document.createElementNS(ns, tag); for (const k in attrs) n.setAttribute(k, attrs[k]); svg.append(n); return n; };
  add("line", {x1: L, y1: H - B, x2: W, y2: H - B, stroke: "#999"});
  add("line", {x1: L, y1: 0, x2: L, y2: H - B, stroke: "#999"});
  add("text", {x: 2, y: Y(y1) + 8}).textContent = fmt(y1, 2);
  add("text", {x: 2, y: Y(y0)}).textContent = fmt(y0, 2);
  add("text", {x: L, y: H - 4}).textContent = "step " + x0;
  add("text", {x: W - 44, y: H - 4}).textContent = "step " + x1;
  const colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"];
  series.forEach(([key, label], i) => {
    const p = pts[i];
    if (!p.length) return;
    add("polyline", {points: p.map(([x, y]) => X(x) + "," + Y(y)).join(" "), fill: "none", stroke: colours[i % 8],
                     "stroke-dasharray": key.startsWith("eval/") ? "4 3" : ""});
    for (const [x, y] of p) {
      const c = add("circle", {cx: X(x), cy: Y(y), r: 3, fill: colours[i % 8], "data-step": x});
      c.append(document.createElementNS(ns, "title"));
      c.lastChild.textContent = label + " at step " + x + ": " + fmt(y);
      c.addEventListener("click", () => pickStep(x));
    }
  });
  const legend = el("div", {});
  series.forEach(([key, label], i) => { if (pts[i].length) legend.append(el("span", {style: "color:" + colours[i % 8], text: "\u25CF " + label + "  "})); });
  fig.append(svg, legend);
  return fig;
}
function drawTimeline() {
  const steps = D.steps;
  const phases = [...new Set(steps.flatMap((s) => Object.keys(s).filter((k) => k.startsWith("timing/"))))].sort();
  $("timeline").append(
    panel("Reward, pass@n, eval", [["reward/mean", "reward"], ["reward/pass_at_n", "pass@n"], ["eval/reward/mean", "eval reward"]], steps),
    panel("Groups with signal", [["advantages/groups_with_signal", "signal groups"]], steps),
    panel("Phase times (s)", phases.map((k) => [k, k.slice(7, -2)]), steps));
  if (D.evals.length) {
    const box = el("figure", {}, el("figcaption", {text: "Eval stages"}));
    for (const e of D.evals) box.append(el("div", {text: e.stage + ": " + fmt(e.mean) + " [" + fmt(e.ci_low) + ", " + fmt(e.ci_high) + "] on " + e.scores.length + " prompts"}));
    $("timeline").append(box);
  }
  for (const p of D.paired) {
    const line = el("div", {class: "pair-line"}, p.from + " \u2192 " + p.to + ": ");
    for (const [kind, prompts] of [["fixed", p.fixed], ["broken", p.broken]]) {
      line.append(el("b", {text: prompts.length + " " + kind + " "}));
      const list = el("span", {class: "pairs", "data-kind": kind});
      for (const q of prompts) list.append(pairedPrompt(q));
      line.append(list, " ");
    }
    $("eval-pairs").append(line);
  }
}
// one paired prompt: its index and source, and a link to the eval trajectory that answered it at each stage
function pairedPrompt(q) {
  const node = el("span", {class: "paired", "data-prompt": q.prompt}, "#" + q.prompt + (q.source ? " (" + q.source + ")" : "") + " ");
  for (const side of ["before", "after"]) {
    if (q[side] == null) { node.append(el("span", {class: "hint", text: side + ": not recorded "})); continue; }
    const a = el("a", {href: "#", class: "open-" + side, text: side});
    a.addEventListener("click", (ev) => { ev.preventDefault(); openAt(q[side]); });
    node.append(a, " ");
  }
  return node;
}
// a trajectory of any step or stage: select its stage, then open it
function openAt(i) {
  const t = D.trajectories[i];
  state.stage = stageKey(t); $("stage").value = state.stage; drawList(); openTrajectory(i);
}
function pickStep(step) {
  const key = [...$("stage").options].map((o) => o.value).find((v) => v.startsWith(step + "|train")) ||
              [...$("stage").options].map((o) => o.value).find((v) => v.startsWith(step + "|"));
  if (key) { state.stage = key; $("stage").value = key; drawList(); }
}

// ---- the list of a stage's trajectories ----
function stageTrajectories() {
  return D.trajectories.map((t, i) => [t, i]).filter(([t]) => stageKey(t) === state.stage);
}
function visible() {
  let rows = stageTrajectories().filter(([t]) => !state.filters.size || [...state.filters].some((f) => t.flags.includes(f)));
  const num = (v, dir) => (v == null ? Infinity : dir * v);
  const by = {"reward-desc": (t) => num(t.reward, -1), "reward-asc": (t) => num(t.reward, 1),
              "adv-desc": (t) => num(t.advantage, -1), "adv-asc": (t) => num(t.advantage, 1)}[state.sort];
  if (by) rows = rows.slice().sort((a, b) => by(a[0]) - by(b[0]));
  return rows;
}
function drawList() {
  location.hash = encodeURIComponent(state.stage || "");
  const list = $("list");
  list.textContent = "";
  for (const code of Object.keys(FLAGS)) {
    const n = stageTrajectories().filter(([t]) => t.flags.includes(code)).length;
    document.querySelector('[data-count="' + code + '"]').textContent = "(" + n + ")";
  }
  const rows = visible();
  if (!rows.length) { list.append(el("p", {class: "hint", id: "empty", text: "No trajectory of this step matches."})); return; }
  let group = null;
  for (const [t, i] of rows) {
    if (state.sort === "group" && t.group !== group) { group = t.group; list.append(el("h3", {text: "group " + group})); }
    const row = el("div", {class: "row", "data-index": i, "data-key": t.key, "data-flags": t.flags},
      t.key + "  r=" + fmt(t.reward, 2) + "  adv=" + fmt(t.advantage, 2) + "  " + (t.stop_reason || ""),
      t.flags ? el("span", {class: "flag", text: " " + t.flags}) : null, t.samples ? null : " (text only)");
    row.addEventListener("click", () => openTrajectory(i));
    list.append(row);
  }
}

// ---- one trajectory: its samples token by token, then its decoded turns and tool calls ----
function tokenSpan(id, role, k, part, pos) {
  const span = el("span", {class: "tok r-" + role, "data-k": k, "data-part": part, "data-pos": pos});
  const text = D.texts[id];
  span.textContent = text == null ? "\u27E8" + id + "\u27E9" : text;
  return span;
}
function drawSample(t, s, k) {
  // advantages are recorded for the samples that went into the step's batch, and only those were trained
  const untrained = !s.advantages;
  const box = el("div", {class: "sample" + (untrained ? " untrained" : ""), "data-k": k});
  const trained = [...s.response_roles].filter((r) => r === "t").length;
  box.append(el("h4", {text: (s.steps.length ? "trained: merged " : "") + "sample " + (k + 1) + ": " + (s.prefix + s.prompt_ids.length) + " prompt tokens, " +
                               s.response_ids.length + " response tokens, " + trained + " in the loss mask" +
                               (s.boundaries.length ? ", merged: " + (s.boundaries.length + 1) + " steps" : "") +
                               (untrained ? " (NOT trained: an eval, or a sample outside the step's batch; " +
                                            "the colours show its loss mask)" : "")}));
  const tokens = el("div", {class: "tokens"});
  if (s.prefix) tokens.append(el("span", {class: "history r-h", text: "[" + s.prefix + " tokens of history, as above]\n"}));
  const frag = document.createDocumentFragment();
  s.prompt_ids.forEach((id, i) => frag.append(tokenSpan(id, s.prompt_roles[i], k, "p", i)));
  const bounds = new Set(s.boundaries);
  s.response_ids.forEach((id, i) => {
    if (bounds.has(i)) frag.append(el("span", {class: "boundary", title: "merge boundary: the next step's tokens start here"}));
    frag.append(tokenSpan(id, s.response_roles[i], k, "r", i));
  });
  tokens.append(frag);
  box.append(tokens);
  if (!s.steps.length) return box;
  // merged: the step-wise samples it was made of (as generated) beside it (as the trainer received it)
  const pair = el("div", {class: "pair"}, drawSteps(s, k), box);
  return pair;
}
// a merged sample's steps as generated: step j's prompt is the merged prompt + response[:start], its response the
// merged response's [start, end) (view/page.py step_ranges); the same recorded ids, masks and logprobs, sliced
function drawSteps(s, k) {
  const col = el("div", {class: "gen-steps", "data-k": k}, el("h4", {text: "generated: " + s.steps.length + " step-wise samples"}));
  let prevEnd = 0;
  s.steps.forEach(([a, b], j) => {
    const trained = [...s.response_roles.slice(a, b)].filter((r) => r === "t").length;
    const prompt = s.prefix + s.prompt_ids.length + a;
    const step = el("div", {class: "gen-step", "data-step": j},
      el("h5", {text: "step " + (j + 1) + ": " + prompt + " prompt tokens, " + (b - a) + " response tokens, " + trained + " in the loss mask"}));
    const tokens = el("div", {class: "tokens"});
    if (j === 0) {
      if (s.prefix) tokens.append(el("span", {class: "history r-h", text: "[" + s.prefix + " tokens of history, as above]\n"}));
      s.prompt_ids.forEach((id, i) => tokens.append(tokenSpan(id, s.prompt_roles[i], k, "p", i)));
    } else {
      tokens.append(el("span", {class: "history r-h", text: "[" + (s.prefix + s.prompt_ids.length + prevEnd) + " tokens: step " + j + "'s prompt + response, up to the merge boundary]\n"}));
      for (let i = prevEnd; i < a; i++) tokens.append(tokenSpan(s.response_ids[i], s.response_roles[i], k, "r", i));
    }
    for (let i = a; i < b; i++) tokens.append(tokenSpan(s.response_ids[i], s.response_roles[i], k, "r", i));
    step.append(tokens);
    col.append(step);
    prevEnd = b;
  });
  return col;
}
function drawSegments(t) {
  if (!t.segments.length) return null;
  const box = el("div", {}, el("h3", {text: t.samples ? "Tool calls" : "Decoded turns and tool calls"}));
  for (const seg of t.segments) {
    const node = el("div", {class: "segment"}, el("b", {text: "[" + seg.role + "] "}),
                    seg.text || (t.samples ? "(its text: the tokens above)" : ""));
    for (const call of seg.tool_calls || []) {
      node.append(el("div", {class: "call" + (call.verdict === "ok" ? "" : " bad"), "data-verdict": call.verdict,
        text: "tool call " + call.name + "(" + JSON.stringify(call.arguments) + ")  parser: " + call.verdict +
              (call.error ? " (" + call.error + ")" : "")}));
    }
    // the tool output the model read next (a text-only trajectory shows it as its next env turn anyway)
    if (t.samples && seg.tool_calls.length && seg.answer != null) node.append(el("div", {class: "answer", text: "answer: " + seg.answer}));
    box.append(node);
  }
  return box;
}
function openTrajectory(i, hit) {
  const t = D.trajectories[i];
  state.open = i;
  document.querySelectorAll("#list .row.open").forEach((r) => r.classList.remove("open"));
  const row = document.querySelector('#list .row[data-index="' + i + '"]');
  if (row) row.classList.add("open");
  const d = $("detail");
  d.textContent = "";
  d.append(el("h2", {text: t.key + " (" + t.stage + ", step " + t.step + ")"}),
    el("div", {class: "meta", text: "reward " + fmt(t.reward) + " | mean advantage " + fmt(t.advantage) + " | stop " +
      (t.stop_reason || "n/a") + " | " + t.turns + " turn(s) | pick " + (t.pick || "n/a") +
      (t.flags ? " | " + [...t.flags].map((f) => FLAGS[f]).join(", ") : "")}));
  if (t.failure) d.append(el("div", {class: "failure", text: "FAILED, not trained: " + t.failure}));
  for (const e of t.context_events) {
    d.append(el("div", {class: "meta", text: "context " + e.kind + " by " + e.policy + " before model turn " + (e.before_step + 1) + ": " + e.tokens_dropped + " tokens dropped; " + e.note}));
  }
  if (t.samples) samplesOf(t).forEach((s, k) => d.append(drawSample(t, s, k)));
  else d.append(el("p", {class: "hint", text: "No per-token record for this trajectory (logging.view_samples): its decoded text only."}));
  const segments = drawSegments(t);
  if (segments) d.append(segments);
  if (hit) {
    const span = d.querySelector('.sample .tok[data-k="' + hit[0] + '"][data-part="r"][data-pos="' + hit[1] + '"]');
    if (span) { span.classList.add("hit"); span.scrollIntoView({block: "center"}); }
  }
}

// ---- hover: the token's id, text, both logprobs, their difference and its advantage ----
function tipText(el_) {
  const t = D.trajectories[state.open], s = samplesOf(t)[Number(el_.dataset.k)], pos = Number(el_.dataset.pos);
  const response = el_.dataset.part === "r";
  const id = response ? s.response_ids[pos] : s.prompt_ids[pos];
  const role = response ? s.response_roles[pos] : s.prompt_roles[pos];
  const lines = ["token id   " + id, "text       " + JSON.stringify(D.texts[id] == null ? "" : D.texts[id]), "role       " + D.roles[role]];
  if (response) {
    const e = s.engine_logprobs ? s.engine_logprobs[pos] : null, tr = s.trainer_logprobs ? s.trainer_logprobs[pos] : null;
    lines.push("engine lp  " + (e == null ? "not recorded" : fmt(e, 5)), "trainer lp " + (tr == null ? "not recorded" : fmt(tr, 5)),
               "difference " + (e == null || tr == null ? "n/a" : fmt(tr - e, 5)),
               "advantage  " + (s.advantages ? fmt(s.advantages[pos], 4) : "not recorded (not trained)"));
  }
  return lines.join("\n");
}
function hover() {
  const tip = $("tip");
  $("detail").addEventListener("mouseover", (ev) => {
    const tok = ev.target.closest(".tok");
    if (!tok) { tip.hidden = true; return; }
    tip.textContent = tipText(tok);
    tip.hidden = false;
    const r = tok.getBoundingClientRect();
    tip.style.left = Math.min(r.left, window.innerWidth - 330) + "px";
    tip.style.top = (r.bottom + 4) + "px";
  });
  $("detail").addEventListener("mouseleave", () => { tip.hidden = true; });
}

// ---- the step's worst engine-vs-trainer agreement tokens ----
function drawWorst() {
  const worst = D.worst[state.stage] || [];
  const d = $("detail");
  d.textContent = "";
  d.append(el("h2", {text: "Worst engine-vs-trainer agreement, " + (state.stage || "no step recorded").replace("|", " ")}));
  const metrics = D.steps.find((r) => state.stage && state.stage.endsWith("|train") && r.step === Number(state.stage.split("|")[0]));
  if (metrics && metrics["agreement/logprob_abs_diff_max"] != null) {
    d.append(el("p", {class: "meta", id: "agreement", text: "over all the step's trained tokens (the loss): |trainer - engine| mean " +
      fmt(metrics["agreement/logprob_abs_diff_mean"], 5) + ", max " + fmt(metrics["agreement/logprob_abs_diff_max"], 5) +
      "; listed below: the tokens of the trajectories recorded per token (logging.view_samples)"}));
  }
  if (!worst.length) { d.append(el("p", {class: "hint", text: "No token of this step has both logprobs recorded."})); return; }
  const table = el("table", {class: "worst"}, el("tr", {}, el("th", {text: "|trainer - engine|"}), el("th", {text: "trajectory"}),
                                                   el("th", {text: "sample"}), el("th", {text: "token"})));
  for (const [ti, k, pos, diff] of worst) {
    const t = D.trajectories[ti];
    const row = el("tr", {}, el("td", {text: fmt(diff, 4)}), el("td", {text: t.key}), el("td", {text: String(k + 1)}),
                   el("td", {text: JSON.stringify(D.texts[samplesOf(t)[k].response_ids[pos]] || "")}));
    row.addEventListener("click", () => openTrajectory(ti, [k, pos]));
    table.append(row);
  }
  d.append(table);
}

// ---- --serve: reload when the run has written a newer page ----
function live() {
  if (!D.live) return;
  setInterval(() => {
    fetch("stamp", {cache: "no-store"}).then((r) => r.text()).then((s) => { if (s && s !== D.stamp) location.reload(); })
      .catch(() => {});
  }, 5000);
}

drawHeader();
drawTimeline();
drawList();
hover();
live();
$("stage").addEventListener("change", () => { state.stage = $("stage").value; drawList(); });
$("sort").addEventListener("change", () => { state.sort = $("sort").value; drawList(); });
$("worst-button").addEventListener("click", drawWorst);
window.viewerReady = performance.now();  // benchmarks/view_page.py: the page's own work is done
