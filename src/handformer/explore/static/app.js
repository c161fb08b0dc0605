// handformer explore: plain JavaScript, no libraries, no network beyond this server.
// Every view is redrawn from the last JSON answer; every failure ends up in #message.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const state = {
    info: null,
    layer: 0,
    head: 0, // a head index or "all"
    maskMode: "overlay",
    scale: "absolute",
    attn: null, // last /api/attention answer
    prompt: null, // the prompt that answer is for
    gen: null, // last /api/generate/* answer
    batch: null, // last /api/batch answer
    batchRequest: null,
  };
  const MASKED = [200, 200, 200];
  const LABEL_MARGIN = 30;

  // -- small helpers ----------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  // Make whitespace tokens visible: a space is ␣, a newline ⏎, a tab ⇥.
  function showTok(token) {
    if (token === "") return "∅";
    return token.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  }

  // A short axis label: one character for a special token (hover shows its name), others
  // cut to `width` characters.
  const SPECIAL_LABELS = { "<pad>": "·", "<unk>": "?", "<bos>": "^", "<eos>": "$" };
  function axisLabel(token, width) {
    if (token in SPECIAL_LABELS) return SPECIAL_LABELS[token];
    if (/^<[^<>]+>$/.test(token)) return "‹";
    return showTok(token).slice(0, width);
  }

  function showMessage(text, kind) {
    const box = $("message");
    box.textContent = text || "";
    box.className = "message " + (kind || "error");
    box.hidden = !text;
  }

  function setNotices(id, notices) {
    const list = $(id);
    list.replaceChildren(...(notices || []).map((n) => el("li", { text: n })));
  }

  async function api(path, body) {
    let response;
    try {
      response = await fetch(path, body === undefined ? {} : {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
    } catch (err) {
      throw new Error("cannot reach the explorer server: is `handformer explore` still running?");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      throw new Error((data && data.error) || `the server answered ${response.status}`);
    }
    if (data === null) throw new Error("the server's answer was not JSON");
    return data;
  }

  // Run an action with its button disabled; any error becomes the visible message.
  async function guarded(button, action) {
    if (button) button.disabled = true;
    document.body.classList.add("busy");
    try {
      await action();
      showMessage("");
    } catch (err) {
      showMessage(err && err.message ? err.message : String(err));
    } finally {
      if (button) button.disabled = false;
      document.body.classList.remove("busy");
      updateStepButton();
    }
  }

  function headParam() {
    return state.head;
  }

  // -- colours ----------------------------------------------------------------------------
  function weightColor(value) { // 0 → white, 1 → dark blue
    const t = Math.max(0, Math.min(1, value));
    return [Math.round(255 - 247 * t), Math.round(255 - 207 * t), Math.round(255 - 148 * t)];
  }

  function rgb(c) {
    return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
  }

  function scaled(row) {
    if (state.scale !== "row") return row;
    const max = Math.max(...row);
    return max > 0 ? row.map((w) => w / max) : row;
  }

  // -- heatmaps ---------------------------------------------------------------------------
  // Draw a (T, S) matrix of weights (or the mask itself) on a canvas; returns the canvas.
  function drawMatrix(weights, allowed, opts) {
    const rows = weights.length;
    const cols = rows ? weights[0].length : 0;
    const cell = opts.cell;
    const margin = opts.labels ? LABEL_MARGIN : 0;
    const width = margin + cols * cell;
    const height = margin + rows * cell;
    const canvas = el("canvas", { class: "heatmap" });
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.ceil(width * ratio);
    canvas.height = Math.ceil(height * ratio);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, height);
    for (let i = 0; i < rows; i++) {
      const row = scaled(weights[i]);
      for (let j = 0; j < cols; j++) {
        let color;
        if (opts.kind === "mask") color = allowed[i][j] ? [40, 40, 40] : [255, 255, 255];
        else if (opts.overlay && !allowed[i][j]) color = MASKED;
        else color = weightColor(row[j]);
        ctx.fillStyle = rgb(color);
        ctx.fillRect(margin + j * cell, margin + i * cell, cell, cell);
      }
    }
    if (cell >= 8) {
      ctx.strokeStyle = "rgba(0, 0, 0, 0.08)";
      ctx.lineWidth = 1;
      for (let i = 0; i <= rows; i++) {
        ctx.beginPath();
        ctx.moveTo(margin, margin + i * cell + 0.5);
        ctx.lineTo(margin + cols * cell, margin + i * cell + 0.5);
        ctx.stroke();
      }
      for (let j = 0; j <= cols; j++) {
        ctx.beginPath();
        ctx.moveTo(margin + j * cell + 0.5, margin);
        ctx.lineTo(margin + j * cell + 0.5, margin + rows * cell);
        ctx.stroke();
      }
    }
    if (opts.labels) {
      ctx.fillStyle = "#333";
      ctx.font = `${Math.min(12, cell)}px monospace`;
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (let i = 0; i < rows; i++) {
        ctx.fillText(axisLabel(opts.rowTokens[i], 3), margin - 3, margin + (i + 0.5) * cell);
      }
      ctx.textAlign = "center";
      ctx.textBaseline = "bottom";
      for (let j = 0; j < cols; j++) {
        ctx.fillText(axisLabel(opts.colTokens[j], 2), margin + (j + 0.5) * cell, margin - 3);
      }
    }
    canvas.dataset.rows = rows;
    canvas.dataset.cols = cols;
    canvas.dataset.cell = cell;
    canvas.dataset.margin = margin;
    canvas.dataset.kind = opts.kind || "weights";
    attachHover(canvas, weights, allowed, opts, margin, cell);
    return canvas;
  }

  function attachHover(canvas, weights, allowed, opts, margin, cell) {
    const tooltip = $("tooltip");
    canvas.addEventListener("mousemove", (event) => {
      const box = canvas.getBoundingClientRect();
      const j = Math.floor((event.clientX - box.left - margin) / cell);
      const i = Math.floor((event.clientY - box.top - margin) / cell);
      if (i < 0 || j < 0 || i >= weights.length || j >= weights[0].length) {
        tooltip.hidden = true;
        return;
      }
      const masked = !allowed[i][j];
      const text = `${opts.title}: query ${i} '${showTok(opts.rowTokens[i])}' → key ${j} ` +
        `'${showTok(opts.colTokens[j])}': weight ${weights[i][j].toFixed(4)}` +
        (masked ? " (masked: may not attend)" : "");
      $("hover-readout").textContent = text;
      tooltip.textContent = text;
      tooltip.hidden = false;
      tooltip.style.left = `${event.pageX + 14}px`;
      tooltip.style.top = `${event.pageY + 14}px`;
    });
    canvas.addEventListener("mouseleave", () => {
      tooltip.hidden = true;
    });
  }

  // One figure per head (small multiples when several), each with its mask if side by side.
  function drawHeads(container, answer, weightsPerHead, allowed, rowTokens, colTokens) {
    const many = weightsPerHead.length > 1;
    const size = Math.max(rowTokens.length, colTokens.length);
    const budget = many ? 200 : 420;
    const cell = Math.max(2, Math.min(many ? 14 : 26, Math.floor(budget / Math.max(1, size))));
    const labels = cell >= 9;
    const figures = [];
    weightsPerHead.forEach((weights, k) => {
      const head = answer.heads[k];
      const title = `layer ${answer.layer} · head ${head}`;
      const opts = { cell, labels, rowTokens, colTokens, title, overlay: state.maskMode === "overlay" };
      const canvas = drawMatrix(weights, allowed, opts);
      canvas.dataset.layer = answer.layer;
      canvas.dataset.head = head;
      const pictures = [canvas];
      if (state.maskMode === "side") {
        const mask = drawMatrix(weights, allowed, { ...opts, kind: "mask", title: "mask" });
        pictures.push(mask);
      }
      figures.push(el("figure", { class: "map" }, el("figcaption", { text: title }),
        el("div", { class: "pair" }, ...pictures)));
    });
    container.replaceChildren(...figures);
    container.dataset.layer = answer.layer;
    container.dataset.heads = answer.heads.join(",");
  }

  function legend() {
    const max = state.scale === "row" ? "row max" : "1";
    return el("p", { class: "legend" },
      el("span", { class: "swatch white" }), " 0 ",
      el("span", { class: "swatch blue" }), ` ${max} `,
      el("span", { class: "swatch grey" }), " masked (may not attend) · axis labels: · = <pad>, " +
      "? = <unk>, ^ = <bos>");
  }

  // -- attention panel --------------------------------------------------------------------
  function renderAttention() {
    const answer = state.attn;
    if (!answer) return;
    setNotices("attn-notices", answer.notices);
    const tokens = $("attn-tokens");
    tokens.replaceChildren(
      el("span", { class: "count", text: `${answer.tokens.length} tokens:` }),
      ...answer.tokens.map((t, i) => el("span", { class: "tok", text: showTok(t), title: `#${i} id ${answer.ids[i]}` })));
    tokens.dataset.count = answer.tokens.length;
    const maps = $("attn-maps");
    const holder = el("div", { class: "multiples" });
    drawHeads(holder, answer, answer.weights, answer.allowed, answer.tokens, answer.tokens);
    maps.replaceChildren(
      el("p", { class: "caption", text: `Rows: queries · columns: keys · mask: ${answer.mask_kind}` }),
      legend(), holder);
    maps.dataset.layer = answer.layer;
    maps.dataset.heads = answer.heads.join(",");
    maps.dataset.state = "ready";
  }

  async function loadAttention(prompt = $("prompt").value) {
    state.attn = await api("/api/attention", { prompt, layer: state.layer, head: headParam() });
    state.prompt = prompt;
    renderAttention();
  }

  // -- generation panel -------------------------------------------------------------------
  function bars(container, title, entries, chosenId) {
    const rows = entries.map((e) => {
      const bar = el("span", { class: "bar" });
      bar.style.width = `${Math.max(0.5, e.prob * 100).toFixed(1)}%`;
      return el("div", { class: "bar-row" + (e.id === chosenId ? " chosen" : "") },
        el("span", { class: "bar-label", text: showTok(e.token) }),
        el("span", { class: "bar-track" }, bar),
        el("span", { class: "bar-value", text: `${(e.prob * 100).toFixed(1)}%` }));
    });
    container.replaceChildren(el("h3", { text: title }), ...rows);
    container.dataset.count = entries.length;
  }

  function renderGeneration() {
    const answer = state.gen;
    if (!answer) return;
    const { filled, capacity } = answer.cache;
    $("gen-status").textContent =
      `${answer.steps} step(s) · KV cache ${filled} / ${capacity} columns filled · the newest ` +
      `token (#${answer.query_index}) attended to all ${answer.weights[0].length} cached keys` +
      (answer.window_full ? " · the window is full: press Start to begin again" : "");
    const table = el("div", { class: "gen-rows" });
    answer.heads.forEach((head, k) => {
      const weights = scaled(answer.weights[k]);
      const cells = answer.tokens.map((t, j) => {
        const cls = ["tok"];
        if (j >= answer.n_prompt) cls.push("generated");
        if (j === answer.query_index) cls.push("query");
        const span = el("span", {
          class: cls.join(" "), text: showTok(t),
          title: `key ${j} '${showTok(t)}': weight ${answer.weights[k][j].toFixed(4)}`,
        });
        const color = weightColor(weights[j]);
        span.style.background = rgb(color);
        span.style.color = weights[j] > 0.55 ? "#fff" : "#111";
        span.dataset.weight = answer.weights[k][j];
        return span;
      });
      table.append(el("div", { class: "gen-row", "data-head": head },
        el("span", { class: "gen-head", text: `L${answer.layer} H${head}` }), ...cells));
    });
    $("gen-attn").replaceChildren(table);
    $("gen-attn").dataset.keys = answer.weights[0].length;
    $("gen-attn").dataset.layer = answer.layer;
    $("gen-attn").dataset.heads = answer.heads.join(",");
    if (answer.chosen) {
      bars($("gen-drawn"), `step ${answer.steps}: drew '${showTok(answer.chosen.token)}' ` +
        `(p = ${(answer.chosen.prob * 100).toFixed(1)}%) from`, answer.drawn_from, answer.chosen.id);
    } else {
      $("gen-drawn").replaceChildren();
    }
    bars($("gen-next"), "next-token probabilities (top 10)", answer.next, null);
  }

  function updateStepButton() {
    $("gen-step").disabled = !state.gen || state.gen.window_full ||
      document.body.classList.contains("busy");
  }

  function topK() {
    const text = $("top-k").value.trim();
    return text === "" ? null : Number(text);
  }

  async function startGeneration() {
    state.gen = await api("/api/generate/start", {
      prompt: $("prompt").value, layer: state.layer, head: headParam(),
      seed: Number($("seed").value || 0),
    });
    setNotices("gen-notices", state.gen.notices);
    renderGeneration();
  }

  async function stepGeneration() {
    if (!state.gen) throw new Error("press Start first");
    const answer = await api("/api/generate/step", {
      session: state.gen.session, layer: state.layer, head: headParam(),
      temperature: Number($("temperature").value || 0), top_k: topK(),
    });
    state.gen = answer;
    renderGeneration();
  }

  async function refreshGeneration() {
    if (!state.gen) return;
    const answer = await api("/api/generate/view", {
      session: state.gen.session, layer: state.layer, head: headParam(),
    });
    state.gen = { ...answer, chosen: state.gen.chosen, drawn_from: state.gen.drawn_from };
    renderGeneration();
  }

  // -- batch panel ------------------------------------------------------------------------
  function renderBatch() {
    const answer = state.batch;
    if (!answer) return;
    setNotices("batch-notices", answer.notices);
    const worst = answer.max_weight_on_padded_keys;
    const check = $("batch-check");
    check.textContent = `Largest weight any query gives a padded key, over every layer, head ` +
      `and row: ${worst}` + (worst === 0 ? " ✓ (exactly zero)" : " ✗ padding leaks!");
    check.className = "status " + (worst === 0 ? "ok" : "bad");
    const rows = answer.rows.map((row, b) => {
      const strip = el("div", { class: "tokens" },
        ...row.tokens.map((t, j) => el("span", {
          class: "tok" + (row.real[j] ? "" : " pad"), text: row.real[j] ? showTok(t) : "pad",
        })));
      const maps = el("div", { class: "multiples" });
      drawHeads(maps, answer, answer.weights[b], answer.allowed[b], row.tokens, row.tokens);
      let prediction = null;
      if (answer.predictions) {
        const p = answer.predictions[b];
        const best = Math.max(...p.probs);
        prediction = el("p", { class: "prediction", text: `prediction: ${p.label} (${(best * 100).toFixed(1)}%)` });
      }
      return el("div", { class: "batch-row", "data-row": b },
        el("h3", { text: `row ${b}: ${row.real.filter((r) => r).length} real tokens, ` +
          `${row.real.filter((r) => !r).length} padding` }), strip, prediction, maps);
    });
    $("batch-rows").replaceChildren(legend(), ...rows);
  }

  async function runBatch() {
    const sentences = $("batch-input").value.split("\n").filter((s) => s.trim() !== "");
    if (sentences.length === 0) throw new Error("type at least one sentence (one per line)");
    state.batchRequest = { sentences, pad_side: $("pad-side").value };
    await refreshBatch();
  }

  async function refreshBatch() {
    if (!state.batchRequest) return;
    state.batch = await api("/api/batch", {
      ...state.batchRequest, layer: state.layer, head: headParam(),
    });
    renderBatch();
  }

  // -- training panel ---------------------------------------------------------------------
  const SVG = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function drawLossCurve(curve) {
    const box = $("loss-curve");
    const series = [
      { name: "train", points: curve.train, cls: "train" },
      { name: "validation", points: curve.val, cls: "val" },
    ];
    const all = series.flatMap((s) => s.points);
    if (all.length === 0) {
      box.replaceChildren(el("p", { class: "note", text: "no loss curve: metrics.jsonl is missing or empty in this run" }));
      return;
    }
    const W = 600, H = 260, L = 56, R = 16, T = 16, B = 40;
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": "loss curve" });
    root.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "plot-bg" }));
    for (let k = 0; k <= 4; k++) {
      const y = y0 + (y1 - y0) * k / 4;
      root.append(svg("line", { x1: L, x2: W - R, y1: py(y), y2: py(y), class: "grid" }));
      root.append(svg("text", { x: L - 6, y: py(y) + 4, "text-anchor": "end", class: "tick" }, y.toFixed(2)));
      const x = x0 + (x1 - x0) * k / 4;
      root.append(svg("text", { x: px(x), y: H - B + 16, "text-anchor": "middle", class: "tick" }, String(Math.round(x))));
    }
    root.append(svg("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis" }, "step"));
    root.append(svg("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "axis", transform: `rotate(-90 12 ${(T + H - B) / 2})` }, "loss (nats/token)"));
    series.forEach((s, k) => {
      if (!s.points.length) return;
      const path = s.points.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
      root.append(svg("polyline", { points: path, class: `line ${s.cls}` }));
      if (s.cls === "val") {
        s.points.forEach((p) => root.append(svg("circle", { cx: px(p[0]), cy: py(p[1]), r: 3, class: "dot val" })));
      }
      root.append(svg("text", { x: W - R - 8, y: T + 16 + 16 * k, "text-anchor": "end", class: `key ${s.cls}` },
        `${s.name} (${s.points.length} points, last ${s.points[s.points.length - 1][1].toFixed(3)})`));
    });
    box.replaceChildren(root);
    box.dataset.train = curve.train.length;
    box.dataset.val = curve.val.length;
  }

  function renderInfo(info) {
    const m = info.model;
    $("run-info").textContent = `${info.kind === "lm" ? "language model" : "classifier"} run ` +
      `'${info.run}' · ${m.n_layers} layers × ${m.n_heads} heads · d_model ${m.d_model} · ` +
      `window ${m.max_len} · vocabulary ${m.vocab_size} · ${m.parameters.toLocaleString()} parameters`;
    $("kernel-note").textContent = info.kernel_note;
    $("layer").replaceChildren(...Array.from({ length: m.n_layers }, (_, i) =>
      el("option", { value: String(i), text: `${i}` })));
    $("head").replaceChildren(...Array.from({ length: m.n_heads }, (_, i) =>
      el("option", { value: String(i), text: `${i}` })), el("option", { value: "all", text: "all heads" }));
    drawLossCurve(info.loss_curve);
    $("config").textContent = JSON.stringify(info.config, null, 2);
    const summary = info.summary || {};
    const keys = ["final_val_loss", "best_val_loss", "unigram_val_loss", "steps", "seconds"];
    $("summary").replaceChildren(...keys.filter((k) => summary[k] !== undefined && summary[k] !== null)
      .map((k) => el("span", { class: "kv", text: `${k}: ${typeof summary[k] === "number" ? +summary[k].toFixed(4) : summary[k]}` })));
    if (info.kind !== "lm") {
      $("generate-panel").classList.add("disabled");
      $("gen-start").disabled = true;
      $("gen-status").textContent = "generation needs a language-model run; this is a classifier";
    }
  }

  // -- wiring -----------------------------------------------------------------------------
  async function refreshAll() {
    const jobs = [];
    if (state.attn) jobs.push(loadAttention(state.prompt));
    if (state.gen) jobs.push(refreshGeneration());
    if (state.batchRequest) jobs.push(refreshBatch());
    await Promise.all(jobs);
  }

  function redrawAll() {
    renderAttention();
    renderGeneration();
    renderBatch();
  }

  function wire() {
    $("prompt-form").addEventListener("submit", (event) => {
      event.preventDefault();
      guarded($("show-btn"), () => loadAttention());
    });
    $("layer").addEventListener("change", (event) => {
      state.layer = Number(event.target.value);
      guarded(null, refreshAll);
    });
    $("head").addEventListener("change", (event) => {
      const v = event.target.value;
      state.head = v === "all" ? "all" : Number(v);
      guarded(null, refreshAll);
    });
    $("mask-mode").addEventListener("change", (event) => {
      state.maskMode = event.target.value;
      redrawAll();
    });
    $("scale").addEventListener("change", (event) => {
      state.scale = event.target.value;
      redrawAll();
    });
    $("gen-start").addEventListener("click", () => guarded($("gen-start"), startGeneration));
    $("gen-step").addEventListener("click", () => guarded($("gen-step"), stepGeneration));
    $("batch-btn").addEventListener("click", () => guarded($("batch-btn"), runBatch));
  }

  window.addEventListener("error", (event) => {
    showMessage(`the page hit a bug: ${event.message}`);
  });
  window.addEventListener("unhandledrejection", (event) => {
    showMessage(`the page hit a bug: ${event.reason && event.reason.message ? event.reason.message : event.reason}`);
  });

  wire();
  guarded(null, async () => {
    state.info = await api("/api/info");
    renderInfo(state.info);
    document.body.dataset.ready = "true";
    await loadAttention();
  });
})();
