// The cell browser of a ragfix report page. Every text of the payload goes into the page as
// text (append / textContent), never as HTML.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("cells").textContent);
  const S = data.strings;
  const root = document.getElementById("browser");
  const PAGE = 200;

  function el(tag, cls, ...kids) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    for (const k of kids) if (k !== null && k !== undefined) e.append(k);
    return e;
  }
  function short(text, n) {
    text = String(text).replace(/\s+/g, " ").trim();
    return text.length > n ? text.slice(0, n - 1) + "\u2026" : text;
  }
  function option(value, text, selected) {
    const o = el("option", null, text);
    o.value = String(value);
    o.selected = selected;
    return o;
  }

  if (!data.groups.length) {
    root.append(el("p", "note", "No cells to show."));
    return;
  }

  const state = { group: 0, pos: null, a: 0, b: 1, rel: "all", flag: "", shown: PAGE };

  function group() { return data.groups[state.group]; }

  function flagsOf(cell) {
    const out = cell.flags.slice();
    if (!cell.scored) out.push("not scored");
    return out;
  }

  function matches(row) {
    const g = group();
    if (g.kind === "sweep" && row.pos !== state.pos) return false;
    const a = row.cells[state.a], b = row.cells[state.b];
    const okA = a ? a.ok : null, okB = b ? b.ok : null;
    switch (state.rel) {
      case "right": if (okA !== true) return false; break;
      case "wrong": if (okA !== false) return false; break;
      case "only-a": if (!(okA === true && okB === false)) return false; break;
      case "only-b": if (!(okA === false && okB === true)) return false; break;
      case "both": if (!(okA === true && okB === true)) return false; break;
      case "neither": if (!(okA === false && okB === false)) return false; break;
    }
    if (state.flag === "none") {
      return row.cells.every((c) => !c || flagsOf(c).length === 0);
    }
    if (state.flag) return row.cells.some((c) => c && flagsOf(c).includes(state.flag));
    return true;
  }

  function renderPrompt(segs, prefix, rebuilt) {
    const pre = el("pre", "prompt");
    for (const [i, kind] of segs) {
      if (kind === 0) pre.append(S[i]);
      else if (kind === 2) pre.append(el("mark", "gold", S[i]));
      else pre.append(el("span", "passage", S[i]));
    }
    const head = el("div", "facts", "prompt the model read");
    if (rebuilt) head.append(" (not stored: ", el("span", "rebuilt", rebuilt), ")");
    const box = el("div", "prompt-box", head, pre);
    if (prefix) box.append(el("div", "facts", "assistant turn prefilled with: ", el("code", null, prefix)));
    return box;
  }

  function facts(list) {
    const d = el("div", "facts");
    for (const [k, v] of list) if (v !== null && v !== undefined) d.append(el("span", null, k + ": " + v));
    return d;
  }

  function flagList(cell) {
    const f = flagsOf(cell);
    if (!f.length) return "";
    const d = el("div", "flags", "flags: ");
    for (const x of f) d.append(el("span", null, x));
    return d;
  }

  function sweepCell(label, cell, row) {
    const box = el("div", "cell");
    box.dataset.col = label;
    box.append(el("h4", null, label));
    if (!cell) { box.append(el("p", "missing", "no such cell in this run")); return box; }
    box.append(el("p", "score " + (cell.ok ? "right" : "wrong"),
      (cell.ok ? "right" : "wrong") + (cell.scored ? "" : " (not scored: its sample overflows the window at some position)")));
    box.append(el("div", "facts", "answer"), el("pre", "answer", cell.answer === "" ? "(empty)" : cell.answer));
    if (row.gold) box.append(el("div", "facts", "gold answers: ", el("span", "gold-answers", row.gold.join(" | "))));
    box.append(flagList(cell), facts(cell.facts));
    if (cell.prompt) box.append(renderPrompt(cell.prompt, cell.prefix, cell.rebuilt));
    else box.append(el("p", "missing", cell.missing));
    return box;
  }

  function judgeCell(label, cell) {
    const box = el("div", "cell");
    box.dataset.col = label;
    box.append(el("h4", null, label));
    if (!cell) { box.append(el("p", "missing", "this pair is not in this run")); return box; }
    box.append(el("p", "score " + (cell.ok ? "right" : "wrong"),
      (cell.ok ? "consistent" : "inconsistent") + ": verdicts (original / swapped, about the answers) " + cell.answer));
    box.append(flagList(cell), facts(cell.facts));
    if (cell.missing) box.append(el("p", "missing", cell.missing));
    const orders = el("div", "orders");
    for (const o of cell.orders) {
      const d = el("div", "order");
      d.append(el("h5", null, o.name));
      const scored = o.ll[0] !== null;
      const reply = scored ? "(none generated: each answer scored as the reply)" : o.reply === "" ? "(empty)" : o.reply;
      d.append(el("div", "facts", "reply"), el("pre", "answer", reply));
      const p = o.p[0] === null ? [] : [["P(A)", o.p[0].toFixed(3)], ["P(B)", o.p[1].toFixed(3)]];
      const ll = scored ? [["log-likelihood of A's answer", o.ll[0].toFixed(3)], ["log-likelihood of B's answer", o.ll[1].toFixed(3)]] : [];
      d.append(facts([["verdict about the slots", o.verdict], ...p, ...ll]));
      if (o.prompt) d.append(renderPrompt(o.prompt, o.prefix));
      orders.append(d);
    }
    box.append(orders);
    return box;
  }

  function rowBody(row) {
    const g = group();
    const body = el("div", "body");
    if (row.q) body.append(el("p", null, el("strong", null, "question: "), row.q));
    if (g.kind === "judge" && row.gold) body.append(el("p", "facts", row.gold.join(" | ")));
    const cols = el("div", "cols");
    cols.style.gridTemplateColumns = "repeat(" + g.columns.length + ", minmax(0, 1fr))";
    g.columns.forEach((label, k) => {
      cols.append(g.kind === "judge" ? judgeCell(label, row.cells[k]) : sweepCell(label, row.cells[k], row));
    });
    body.append(cols);
    return body;
  }

  function rowElement(row) {
    const g = group();
    const d = el("details", "row");
    d.dataset.key = row.key;
    if (row.pos !== null) d.dataset.pos = String(row.pos);
    const sum = el("summary", null, el("span", "key", row.key));
    sum.append(el("span", "q", row.q ? short(row.q, 140) : "(question not stored)"));
    g.columns.forEach((label, k) => {
      const c = row.cells[k];
      const cls = !c ? "none" : c.ok ? "right" : "wrong";
      const mark = !c ? "\u2013" : c.ok ? "\u2713" : "\u2717";
      const b = el("span", "badge " + cls, mark + " " + (c ? short(c.answer, 36) : ""));
      b.title = label;
      sum.append(b);
    });
    d.append(sum);
    d.addEventListener("toggle", () => {
      if (d.open && d.children.length === 1) d.append(rowBody(row));
    });
    return d;
  }

  function accuracy(pos) {
    let n = 0, ok = 0;
    for (const r of group().rows) {
      const c = r.cells[state.a];
      if (r.pos === pos && c && c.scored) { n += 1; ok += c.ok ? 1 : 0; }
    }
    return n ? (ok / n).toFixed(2) : "n/a";
  }

  function controls() {
    const g = group();
    const bar = el("div", "controls");
    if (data.groups.length > 1) {
      const sel = el("select", null);
      sel.id = "group";
      data.groups.forEach((x, i) => sel.append(option(i, x.title, i === state.group)));
      sel.addEventListener("change", () => { state.group = Number(sel.value); reset(); draw(); });
      bar.append(el("label", null, "runs", sel));
    }
    const cols = g.columns;
    const pick = (id, key, text) => {
      const sel = el("select", null);
      sel.id = id;
      cols.forEach((c, i) => sel.append(option(i, c, i === state[key])));
      sel.addEventListener("change", () => { state[key] = Number(sel.value); state.shown = PAGE; draw(); });
      return el("label", null, text, sel);
    };
    bar.append(pick("run-a", "a", "run A"));
    if (cols.length > 1) bar.append(pick("run-b", "b", "run B"));
    const ok = g.kind === "judge" ? ["consistent", "inconsistent"] : ["right", "wrong"];
    const rels = [["all", "all cells"], ["right", ok[0] + " in A"], ["wrong", ok[1] + " in A"]];
    if (cols.length > 1) {
      rels.push(["only-a", ok[0] + " only in A"], ["only-b", ok[0] + " only in B"],
        ["both", ok[0] + " in both"], ["neither", ok[1] + " in both"]);
    }
    const rel = el("select", null);
    rel.id = "relation";
    for (const [v, t] of rels) rel.append(option(v, t, v === state.rel));
    rel.addEventListener("change", () => { state.rel = rel.value; state.shown = PAGE; draw(); });
    bar.append(el("label", null, "show", rel));
    const seen = new Set();
    for (const r of g.rows) for (const c of r.cells) if (c) for (const f of flagsOf(c)) seen.add(f);
    const flag = el("select", null);
    flag.id = "flag";
    flag.append(option("", "any", state.flag === ""), option("none", "no flag", state.flag === "none"));
    for (const f of [...seen].sort()) flag.append(option(f, f, state.flag === f));
    flag.addEventListener("change", () => { state.flag = flag.value; state.shown = PAGE; draw(); });
    bar.append(el("label", null, "flag", flag));
    return bar;
  }

  function positions() {
    const g = group();
    const box = el("div", "positions", el("span", "facts", g.x_axis + " (accuracy of run A): "));
    for (const p of g.positions) {
      const b = el("button", null, p + " \u00b7 " + accuracy(p));
      b.type = "button";
      b.dataset.pos = String(p);
      if (p === state.pos) b.classList.add("current");
      if (p === g.worst) { b.classList.add("worst"); b.title = "worst position of the baseline"; }
      b.addEventListener("click", () => { state.pos = p; state.shown = PAGE; draw(); });
      box.append(b);
    }
    return box;
  }

  function reset() {
    const g = group();
    state.pos = g.kind === "sweep" ? (g.worst !== null ? g.worst : g.positions[0]) : null;
    state.a = 0;
    state.b = g.columns.length > 1 ? 1 : 0;
    state.rel = "all";
    state.flag = "";
    state.shown = PAGE;
  }

  function draw() {
    const g = group();
    root.replaceChildren();
    root.append(el("h3", null, g.title));
    root.append(controls());
    if (g.kind === "sweep") root.append(positions());
    const rows = g.rows.filter(matches);
    const count = el("p", "note", rows.length + " of " + g.rows.filter((r) => g.kind !== "sweep" || r.pos === state.pos).length +
      (g.kind === "sweep" ? " rows at " + g.x_axis + " " + state.pos : " pairs"));
    count.id = "count";
    root.append(count);
    const list = el("div", "rows");
    list.id = "rows";
    for (const r of rows.slice(0, state.shown)) list.append(rowElement(r));
    root.append(list);
    if (rows.length > state.shown) {
      const more = el("button", "more", "show " + Math.min(PAGE, rows.length - state.shown) + " more");
      more.type = "button";
      more.addEventListener("click", () => { state.shown += PAGE; draw(); });
      root.append(more);
    }
  }

  reset();
  draw();
})();
