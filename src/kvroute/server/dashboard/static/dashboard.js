// kvroute dashboard: polls dashboard/data.json every 2 s and draws it. No dependencies, no build step.
// Everything from the server is put in the page as text (never as HTML): worker ids and reasons are
// data, not markup.
"use strict";

(function () {
  const POLL_MS = 2000;
  const STALE_MS = 10000;
  const params = new URLSearchParams(window.location.search);
  const token = params.get("token");
  const dataUrl = "dashboard/data.json";
  let lastOk = 0;

  if (token) {
    // Keep the token on the raw-data link too, so following it works on a protected router.
    document.getElementById("data-link").href = dataUrl + "?token=" + encodeURIComponent(token);
  }

  // ---- formatting -------------------------------------------------------------------------------
  const fmtInt = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
  const fmtPct = (v, digits = 1) => (v === null || v === undefined ? "–" : (v * 100).toFixed(digits) + "%");
  function fmtSec(v) {
    if (v === null || v === undefined) return "–";
    if (v === 0) return "0";
    if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 1 : 0) + " ms";
    return v.toFixed(v < 10 ? 2 : 1) + " s";
  }
  function fmtRate(v) {
    if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (v >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
    return v.toFixed(v < 10 && v !== 0 ? 1 : 0);
  }
  const pad = (n) => String(n).padStart(2, "0");
  function clock(t, seconds = true) {
    const d = new Date(t * 1000);
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + (seconds ? ":" + pad(d.getSeconds()) : "");
  }
  function since(t, now) {
    const d = new Date(t * 1000);
    const today = new Date(now * 1000).toDateString() === d.toDateString();
    return (today ? "" : d.toISOString().slice(0, 10) + " ") + clock(t);
  }
  function span(seconds) {
    if (seconds < 120) return Math.round(seconds) + " s";
    if (seconds < 3540) return Math.round(seconds / 60) + " min";
    if (seconds < 3660) return "hour";
    return (seconds / 3600).toFixed(1) + " h";
  }

  // ---- DOM helpers ------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "class") node.className = v;
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) node.dataset[dk] = dv;
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }
  const setText = (id, text) => { document.getElementById(id).textContent = text; };

  function bar(fraction, cls) {
    if (fraction === null || fraction === undefined) return el("span", { class: "muted" }, "–");
    const pct = Math.max(0, Math.min(1, fraction));
    const fill = el("div", { class: "fill " + (cls || "") + (cls ? "" : pct > 0.9 ? " high" : "") });
    fill.style.width = (pct * 100).toFixed(1) + "%";
    return el("div", { class: "bar" }, el("div", { class: "track" }, fill), el("span", { class: "pct" }, fmtPct(fraction)));
  }

  function chip(label, value, cls, title) {
    return el("span", { class: "chip " + (cls || ""), title }, label + " ", el("b", {}, value));
  }

  // ---- rendering --------------------------------------------------------------------------------
  function render(data) {
    const now = data.generated_at;
    const r = data.router;
    setText("t-replicas", r.workers ? r.healthy + " / " + r.workers : "0");
    setText("t-inflight", fmtInt(r.inflight));
    setText("t-sessions", fmtInt(r.sessions));
    setText("t-index", r.index_blocks === null ? "–" : fmtInt(r.index_blocks));

    let cached = 0, prompt = 0;
    for (const m of data.models) { cached += m.tokens.cached_tokens; prompt += m.tokens.prompt_tokens; }
    const windowText = "last " + span(data.window.end - data.window.start);
    setText("t-hits", prompt ? fmtPct(cached / prompt) : "–");
    setText("t-hits-note", prompt ? fmtInt(cached) + " of " + fmtInt(prompt) + " tokens, " + windowText : windowText);
    const t = data.ttfb;
    setText("t-ttfb", t.count ? fmtSec(t.window_p50) + " / " + fmtSec(t.window_p95) : "–");
    setText("t-ttfb-note", fmtInt(t.count) + " requests, " + windowText);

    document.getElementById("empty").hidden = data.models.length > 0;
    renderModels(data, now);
    renderDecisions(data.decisions, now);

    drawChart(document.getElementById("ttfb-chart"), {
      window: data.window,
      series: [
        { values: t.p50, color: "--p50", label: "p50" },
        { values: t.p95, color: "--p95", label: "p95" },
      ],
      kind: "line",
      yFormat: fmtSec,
      empty: "No requests through the router yet",
    });
  }

  function renderModels(data, now) {
    const box = document.getElementById("models");
    const existing = new Map([...box.children].map((s) => [s.dataset.model, s]));
    const template = document.getElementById("model-template");
    const keep = new Set();
    data.models.forEach((m, i) => {
      let section = existing.get(m.name);
      if (!section) {
        section = template.content.firstElementChild.cloneNode(true);
        section.dataset.model = m.name;
        for (const canvas of section.querySelectorAll("canvas.chart")) {
          canvas.addEventListener("mousemove", hover);
          canvas.addEventListener("mouseleave", hover);
        }
      }
      if (box.children[i] !== section) box.insertBefore(section, box.children[i] || null);
      keep.add(m.name);
      fillModel(section, m, data, now);
    });
    for (const [name, section] of existing) if (!keep.has(name)) section.remove();
  }

  function fillModel(section, m, data, now) {
    section.querySelector(".model-name").textContent = m.name;
    const p = m.policy;
    // replaceChildren writes a null argument as the text "null": leave absent chips out.
    section.querySelector(".policy").replaceChildren(...[
      chip("policy", p.name),
      chip("stickiness", p.sticky ? "on" : "off", p.sticky ? "on" : "off"),
      chip("overflow", p.overflow === "auto" ? "auto" : String(p.overflow), "", p.overflow_rule),
      chip("slack steps", p.slack_steps.map((s) => fmtRate(s)).join(" / ") + " tokens", "",
        "A cached replica may carry one more request in flight than the freest per step the prompt reaches"),
      p.name === "auto" ? chip("stay margin", fmtInt(p.stay_tokens) + " tokens", "", p.overflow_rule) : null,
    ].filter((c) => c !== null));

    const body = section.querySelector("tbody");
    body.replaceChildren(...m.replicas.map((w) => replicaRow(w, now)));
    fillGuardWarnings(section.querySelector(".guard-warnings"), m.replicas);
    const tt = m.totals;
    section.querySelector("tfoot").replaceChildren(el("tr", { class: "totals" },
      el("td", {}, "Total (" + tt.replicas + " replicas)"),
      el("td", {}, tt.healthy + " healthy"),
      el("td", {}),
      el("td", { class: "num" }, fmtInt(tt.requests_total)),
      el("td", { class: "num" }, fmtInt(tt.requests.sticky)),
      el("td", { class: "num" }, fmtInt(tt.requests.overflow)),
      el("td", { class: "num" }, fmtPct(tt.sticky_share, 0)),
      el("td", { class: "num" }, fmtInt(tt.sessions)),
      el("td", { class: "num" }, fmtInt(tt.inflight)),
      el("td", { class: "num" }, fmtInt(tt.running)),
      el("td", { class: "num" }, fmtInt(tt.waiting)),
      el("td", {}, bar(tt.kv_usage)),
      el("td", {}, bar(tt.hit_share, "hits")),
    ));

    fillQueue(section, m.queue, data);

    const tok = m.tokens;
    section.querySelector(".share").textContent = tok.hit_share === null
      ? "no prompt tokens counted yet"
      : fmtPct(tok.hit_share) + " from cache over the last " + span(data.window.end - data.window.start);
    drawChart(section.querySelector(".tokens-chart"), {
      window: data.window,
      series: [
        { values: tok.cached, color: "--cached", label: "from cache" },
        { values: tok.computed, color: "--computed", label: "computed" },
      ],
      kind: "stacked",
      yFormat: (v) => fmtRate(v) + "/s",
      empty: "No prompt tokens counted yet (the engine's /metrics has no prefix-cache counters, or no traffic)",
    });
  }

  // Flow control's queue for one model: figures now and over the window, and two charts; when flow
  // control is off for the model, only a plain notice saying so.
  function fillQueue(section, q, data) {
    const box = section.querySelector(".queue");
    box.dataset.flow = q.flow_control ? "on" : "off";
    section.querySelector(".flow-off").hidden = q.flow_control;
    section.querySelector(".queue-charts").hidden = !q.flow_control;
    const figures = section.querySelector(".queue-figures");
    if (!q.flow_control) {
      figures.replaceChildren();
      return;
    }
    const windowText = "over the last " + span(data.window.end - data.window.start);
    const shed = Object.entries(q.shed).map(([reason, n]) => reason + " " + n).join(", ");
    const figure = (field, label, value, cls, title) => {
      const c = chip(label, value, cls, title);
      c.dataset.field = field;
      return c;
    };
    // Only the classes with something queued: "(high 1, normal 2)".
    const classes = Object.entries(q.classes).filter(([, c]) => c.depth > 0)
      .map(([cls, c]) => cls + " " + fmtInt(c.depth)).join(", ");
    const fleet = q.saturated
      ? "saturated · placing for the fleet" + (q.thrashing ? " · session admission on" : "")
      : "has room";
    const chips = [
      figure("saturation", "fleet", fleet, q.saturated ? "warn" : "",
        "Saturated: no replica could start a request at once for a while (kvroute_fleet_saturated). "
        + "Placement then keeps each prefix on its holders and the gate (flow_control = "
        + JSON.stringify(q.flow_control) + ") is " + (q.gate ? "on" : "off") + " (docs/saturation.md)"),
      figure("queued", "queued now", fmtInt(q.depth) + " requests · " + fmtInt(q.tokens) + " tokens"
        + (classes ? " (" + classes + ")" : ""),
        q.depth ? "warn" : "", "Requests waiting at the router for an admissible replica, their estimated prompt tokens, and how many of each priority class (x-kvroute-priority)"),
      figure("wait", "wait p50 / p95", q.wait.count ? fmtSec(q.wait.p50) + " / " + fmtSec(q.wait.p95) : "–", "",
        fmtInt(q.wait.count) + " requests waited " + windowText),
      figure("at-once", "admitted at once", fmtInt(q.admitted.at_once), "", "Since the router started"),
      figure("after-wait", "after a wait", fmtInt(q.admitted.after_wait), "", "Since the router started"),
      figure("shed", "shed", fmtInt(q.shed_total) + (shed ? " (" + shed + ")" : ""), q.shed_total ? "bad" : "",
        "Answered with the API's overload error (429 / 529), by reason, since the router started"),
    ];
    if (q.tenants.length) {
      // The largest shares first; the full list on hover.
      const pct = (t) => t.tenant + " " + (100 * t.share).toFixed(1) + " %";
      const more = q.tenants.length > 3 ? " (+" + (q.tenants.length - 3) + " more)" : "";
      chips.push(figure("tenants", "tokens served by tenant", q.tenants.slice(0, 3).map(pct).join(", ") + more, "",
        "Share of the tokens served through the gate (the engine's prompt + output tokens), by tenant " +
        "(x-kvroute-tenant, the fairness header or the API key's hash), since the router started:\n" +
        q.tenants.map((t) => pct(t) + " (" + fmtInt(t.tokens) + ")").join("\n")));
    }
    if (q.sessions) {
      chips.push(figure("sessions", "sessions admitted / at the door",
        fmtInt(q.sessions.admitted) + " / " + fmtInt(q.sessions.waiting), q.sessions.waiting ? "warn" : "",
        "Session admission: sessions whose caches the fleet keeps, and new sessions whose first turn waits until the fleet's KV can hold them"));
    }
    figures.replaceChildren(...chips);
    drawChart(section.querySelector(".queue-chart"), {
      window: data.window,
      series: [{ values: q.series.depth, color: "--queued", label: "requests queued" }],
      kind: "line",
      yFormat: fmtInt,
      empty: "Nothing has waited at the router " + windowText,
    });
    drawChart(section.querySelector(".queue-tokens-chart"), {
      window: data.window,
      series: [{ values: q.series.tokens, color: "--queued-tokens", label: "tokens queued" }],
      kind: "line",
      yFormat: (v) => fmtRate(v),
      empty: "Nothing has waited at the router " + windowText,
    });
  }

  // The fleet guard (docs/fleet-guard.md): the doctor's findings at the replica's epoch, as
  // "severity code: title" lines, worst first.
  function findingLines(doctor, severities) {
    if (!doctor) return [];
    return doctor.findings.filter((f) => severities.includes(f.severity))
      .map((f) => f.severity + " " + f.code + ": " + f.title + (f.fix ? " (fix: " + f.fix + ")" : ""));
  }

  // A flag beside the status: the doctor's worst finding (warning or error) and the drift alarm.
  function guardFlags(w) {
    const flags = [];
    const d = w.doctor;
    if (d && (d.worst === "error" || d.worst === "warning")) {
      const n = d.findings.filter((f) => f.severity === d.worst).length;
      flags.push(el("span", { class: "flag doctor " + d.worst, data: { flag: "doctor" },
        title: findingLines(d, ["error", "warning"]).join("\n") + (d.held ? "\nheld out of rotation until a clean check at a new epoch" : "") },
        "doctor: " + n + " " + d.worst + (n > 1 ? "s" : "")));
    }
    const drift = w.cache_drift;
    if (drift && drift.alarm) {
      flags.push(el("span", { class: "flag drift", data: { flag: "drift" },
        title: "the engine reports far fewer cached tokens than the prefix index predicted: realisation "
          + fmtPct(drift.realisation, 0) },
        "cache drift"));
    }
    return flags;
  }

  // One line per replica whose cache drifted, with the doctor's findings beside it.
  function fillGuardWarnings(box, replicas) {
    const lines = replicas.filter((w) => w.cache_drift && w.cache_drift.alarm).map((w) => {
      const found = findingLines(w.doctor, ["error", "warning"]);
      return el("div", { class: "guard-warning", data: { replica: w.id } },
        el("b", {}, "Cache drift on " + w.id + ": "),
        "the engine reports " + fmtPct(w.cache_drift.realisation, 0) + " of the cache hits the router predicted ("
          + fmtInt(w.cache_drift.low_predicted_tokens) + " predicted tokens). ",
        el("span", { class: "doctor-findings" },
          found.length ? "Doctor: " + found.join("; ") : "The doctor found nothing wrong at this epoch."));
    });
    box.hidden = !lines.length;
    box.replaceChildren(...lines);
  }

  // The fleet guard's canary: questions asked, answers counted against the replica, held or not.
  function canaryBadge(c) {
    if (!c) return null;
    const tip = "canary: " + c.questions + " asked, " + c.wrong + " wrong, " + c.window_faults + " of the last " +
      c.window_rounds + " rounds" + (c.drain_above != null ? " (drains above " + c.drain_above + ")" : "") +
      (c.held ? "\nheld: back after " + c.release_after + " clean rounds in a row (" + c.clean_run + " so far)" : "") +
      (c.last_verdict ? "\nlast answer: " + c.last_verdict : "");
    return el("span", { class: "canary-tag" + (c.held ? " held" : ""), title: tip, data: { field: "canary" } },
      c.held ? "canary: held" : "canary " + c.wrong + "/" + c.questions);
  }

  // Exact: the replica's KV events say what its cache holds; otherwise the router's prefix index.
  function cacheModeTag(w) {
    if (w.cache_mode !== "exact") return null;
    return el("span", { class: "canary-tag", data: { field: "cache-mode" },
      title: "cache state exact: routed on the engine's KV-cache events" }, "exact");
  }

  function replicaRow(w, now) {
    const req = w.requests;
    const b = w.breaker || {};
    // The circuit breaker: why it opened, when it lets a trial through, how often it opened.
    const ejections = Object.entries(b.ejections || {}).map(([k, n]) => k + " " + n).join(", ");
    const tip = [w.last_error, b.reason && "breaker: " + b.reason,
      w.guard_holds && w.guard_holds.length && "held out by the fleet guard: " + w.guard_holds.join(", "),
      b.reopens_in_s != null && "trial in " + b.reopens_in_s.toFixed(1) + " s",
      ejections && "ejections: " + ejections].filter(Boolean).join("\n");
    const health = el("span", { class: "badge " + w.status, title: tip }, w.status,
      ejections ? el("span", { class: "muted" }, " ×" + Object.values(b.ejections).reduce((x, y) => x + y, 0)) : null);
    return el("tr", { data: { replica: w.id } },
      el("td", { class: "id", title: w.url }, w.id),
      el("td", {}, health, ...guardFlags(w), canaryBadge(w.canary), cacheModeTag(w)),
      el("td", { title: "epoch " + w.epoch }, since(w.epoch, now),
        w.restarts ? el("span", { class: "muted" }, " · restarted " + w.restarts + "×") : null),
      el("td", { class: "num", data: { field: "requests" } }, fmtInt(w.requests_total)),
      el("td", { class: "num", data: { field: "sticky" } }, fmtInt(req.sticky)),
      el("td", { class: "num", data: { field: "overflow" } }, fmtInt(req.overflow)),
      el("td", { class: "num" }, fmtPct(w.sticky_share, 0)),
      el("td", { class: "num" }, fmtInt(w.sessions)),
      el("td", { class: "num", data: { field: "inflight" } },
        fmtInt(w.inflight), w.peer_inflight ? el("span", { class: "muted", title: "other router instances" }, " +" + w.peer_inflight) : null),
      el("td", { class: "num" }, fmtInt(w.running)),
      el("td", { class: "num" }, fmtInt(w.waiting)),
      el("td", { data: { field: "kv" } }, bar(w.kv_usage)),
      el("td", { data: { field: "hits" } }, bar(w.hit_share, "hits")),
    );
  }

  function renderDecisions(decisions, now) {
    const body = document.getElementById("decisions");
    if (!decisions.length) {
      body.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No requests yet.")));
      return;
    }
    body.replaceChildren(...decisions.map((d) => el("tr", {},
      el("td", {}, clock(d.time)),
      el("td", {}, d.model),
      el("td", { class: "id" }, d.worker || "–"),
      el("td", {}, el("span", { class: "kind " + d.kind }, d.kind.replace("_", " "))),
      el("td", { class: "num" }, d.total_blocks ? d.matched_blocks + "/" + d.total_blocks : "–"),
      el("td", { class: "num" }, fmtSec(d.ttfb_s)),
      el("td", { class: "num" }, d.status, d.attempts > 1 ? el("span", { class: "muted" }, " (" + d.attempts + " tries)") : null),
      el("td", { class: "reason", title: d.reason }, d.reason),
    )));
  }

  // ---- charts (canvas) --------------------------------------------------------------------------
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  function niceStep(max, ticks) {
    const raw = max / ticks;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 2.5 ? 2.5 : norm <= 5 ? 5 : 10) * mag;
  }

  function timeStep(seconds) {
    for (const s of [10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600]) if (seconds / s <= 7) return s;
    return 7200;
  }

  // Draws spec onto canvas; remembers spec for hover redraws. Sets data-points to the number of
  // bins that hold data, so tests (and curious people) can tell an empty chart from a drawn one.
  function drawChart(canvas, spec, hoverX) {
    canvas._spec = spec;
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || 600;
    const cssH = Number(canvas.getAttribute("height")) || 180;
    if (canvas.width !== Math.round(cssW * dpr)) {
      canvas.width = Math.round(cssW * dpr);
      canvas.height = Math.round(cssH * dpr);
      canvas.style.height = cssH + "px";
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    ctx.font = "11px " + css("--sans");

    const { window: win, series } = spec;
    const n = win.bins;
    const top = new Array(n).fill(0);
    let points = 0;
    for (let i = 0; i < n; i++) {
      let sum = 0, any = false, hi = 0;
      for (const s of series) {
        const v = s.values[i];
        if (v !== null && v !== undefined) { sum += v; hi = Math.max(hi, v); if (v > 0) any = true; }
      }
      top[i] = spec.kind === "stacked" ? sum : hi;
      if (any) points++;
    }
    canvas.dataset.points = String(points);
    const maxV = Math.max(...top, 0);
    const step = maxV > 0 ? niceStep(maxV * 1.08, 4) : 1;
    const yMax = maxV > 0 ? Math.ceil((maxV * 1.08) / step) * step : 4;

    const left = 58, right = 12, topPad = 10, bottom = 22;
    const w = cssW - left - right, h = cssH - topPad - bottom;
    const x = (i) => left + ((i + 0.5) / n) * w;
    const y = (v) => topPad + h - (v / yMax) * h;

    // grid and y labels
    ctx.strokeStyle = css("--grid");
    ctx.fillStyle = css("--muted");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let v = 0; v <= yMax + 1e-9; v += maxV > 0 ? step : yMax) {
      const yy = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(left + w, yy); ctx.stroke();
      ctx.fillText(maxV > 0 ? spec.yFormat(v) : "", left - 6, yy);
    }
    // x labels: wall-clock times on round boundaries
    const span = win.end - win.start;
    const ts = timeStep(span);
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let t = Math.ceil(win.start / ts) * ts; t <= win.end; t += ts) {
      const xx = left + ((t - win.start) / span) * w;
      ctx.beginPath(); ctx.moveTo(xx, topPad + h); ctx.lineTo(xx, topPad + h + 4); ctx.stroke();
      ctx.fillText(clock(t, ts < 60), xx, topPad + h + 6);
    }

    if (points === 0) {
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillText(spec.empty, left + w / 2, topPad + h / 2);
      return;
    }

    if (spec.kind === "stacked") {
      let base = new Array(n).fill(0);
      for (const s of series) {
        const upper = base.map((b, i) => b + (s.values[i] || 0));
        ctx.beginPath();
        ctx.moveTo(x(0), y(upper[0]));
        for (let i = 1; i < n; i++) ctx.lineTo(x(i), y(upper[i]));
        for (let i = n - 1; i >= 0; i--) ctx.lineTo(x(i), y(base[i]));
        ctx.closePath();
        ctx.fillStyle = css(s.color);
        ctx.globalAlpha = 0.85;
        ctx.fill();
        ctx.globalAlpha = 1;
        base = upper;
      }
    } else {
      for (const s of series) {
        ctx.strokeStyle = ctx.fillStyle = css(s.color);
        ctx.lineWidth = 2;
        ctx.beginPath();
        let open = false;
        for (let i = 0; i < n; i++) {
          const v = s.values[i];
          if (v === null || v === undefined) { open = false; continue; }
          if (open) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
          open = true;
        }
        ctx.stroke();
        // dots show isolated bins, which a line alone would not draw
        for (let i = 0; i < n; i++) {
          const v = s.values[i];
          if (v === null || v === undefined) continue;
          ctx.beginPath(); ctx.arc(x(i), y(v), 2.5, 0, 2 * Math.PI); ctx.fill();
        }
      }
    }

    if (hoverX !== undefined) {
      const i = Math.max(0, Math.min(n - 1, Math.floor(((hoverX - left) / w) * n)));
      const xx = x(i);
      ctx.strokeStyle = css("--muted");
      ctx.beginPath(); ctx.moveTo(xx, topPad); ctx.lineTo(xx, topPad + h); ctx.stroke();
      const t0 = win.start + i * win.bin_s;
      const lines = [clock(t0) + " – " + clock(t0 + win.bin_s)].concat(
        series.map((s) => s.label + ": " + (s.values[i] === null ? "–" : spec.yFormat(s.values[i]))));
      const boxW = Math.max(...lines.map((l) => ctx.measureText(l).width)) + 14;
      const bx = xx + boxW + 8 > left + w ? xx - boxW - 8 : xx + 8;
      ctx.fillStyle = css("--panel");
      ctx.strokeStyle = css("--border");
      ctx.fillRect(bx, topPad + 4, boxW, lines.length * 15 + 8);
      ctx.strokeRect(bx + 0.5, topPad + 4.5, boxW, lines.length * 15 + 8);
      ctx.fillStyle = css("--text");
      ctx.textAlign = "left";
      ctx.textBaseline = "top";
      lines.forEach((l, k) => ctx.fillText(l, bx + 7, topPad + 9 + k * 15));
    }
  }

  function hover(event) {
    const canvas = event.currentTarget;
    if (!canvas._spec) return;
    const rect = canvas.getBoundingClientRect();
    drawChart(canvas, canvas._spec, event.type === "mouseleave" ? undefined : event.clientX - rect.left);
  }
  const ttfbCanvas = document.getElementById("ttfb-chart");
  ttfbCanvas.addEventListener("mousemove", hover);
  ttfbCanvas.addEventListener("mouseleave", hover);

  window.addEventListener("resize", () => {
    for (const c of document.querySelectorAll("canvas.chart")) if (c._spec) drawChart(c, c._spec);
  });

  // ---- polling ----------------------------------------------------------------------------------
  function setLive(state, text) {
    const live = document.getElementById("live");
    live.dataset.state = state;
    setText("live-text", text);
  }

  async function poll() {
    try {
      const headers = token ? { Authorization: "Bearer " + token } : {};
      const res = await fetch(dataUrl, { headers, cache: "no-store" });
      if (!res.ok) {
        let message = res.status + " " + res.statusText;
        try { message = (await res.json()).error.message; } catch (e) { /* keep the status line */ }
        setLive("error", message);
      } else {
        const data = await res.json();
        render(data);
        lastOk = Date.now();
        setLive("live", "updated " + clock(data.generated_at));
        document.body.dataset.loaded = "true";
      }
    } catch (e) {
      setLive(Date.now() - lastOk > STALE_MS ? "error" : "stale", "router unreachable, retrying…");
    }
    setTimeout(poll, POLL_MS);
  }
  poll();
})();
