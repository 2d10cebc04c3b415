"use strict";
(function () {
  const D = JSON.parse(document.getElementById("episodes-data").textContent);
  const E = D.E, PAGE = 25, FOLD = 96;
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  const fmt = (x, d = 3) => (x === null || x === undefined) ? "–" : (Number.isInteger(x) ? String(x) : x.toFixed(d));
  const signed = (x) => (x > 0 ? "+" : "") + x.toFixed(4);
  let page = 0, current = -1, visible = [];

  $("scale-note").textContent = D.tokenized
    ? `colour saturates at |A| = ${D.scale.toPrecision(3)} (95th percentile); hover a token for its values`
    : `colour saturates at |A| = ${D.scale.toPrecision(3)}; no tokenizer given: actions shown as text`;
  const src = $("f-source");
  src.innerHTML = `<option value="">all rollouts (${E.length} of ${D.total})</option>` +
    `<option value="@train">training</option><option value="@eval">evaluation</option>` +
    D.sources.map((s) => `<option value="${esc(s.name)}">${esc(s.label)} (${s.shown}/${s.total})</option>`).join("");

  // groups: consecutive episodes of one source sharing a group id (a task's group, or a tree)
  const groups = [];
  E.forEach((ep, i) => {
    const key = ep.src + "\u0000" + (ep.g || "#" + i);
    const last = groups[groups.length - 1];
    if (last && last.key === key) last.items.push(i); else groups.push({key, items: [i]});
  });
  groups.forEach((g) => g.items.sort((a, b) => cmpPath(E[a].b, E[b].b) || a - b));
  function cmpPath(a, b) {
    for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i] - b[i];
    return a.length - b.length;
  }

  function matches(ep, q, source, outcome) {
    if (source === "@train" && ep.kind !== "train") return false;
    if (source === "@eval" && ep.kind !== "eval") return false;
    if (source && source[0] !== "@" && ep.src !== source) return false;
    if (outcome === "success" && ep.s !== "success") return false;
    if (outcome === "fail" && ep.s === "success") return false;
    if (outcome === "pos" && !(ep.R > 0)) return false;
    if (outcome === "zero" && !(ep.R <= 0)) return false;
    if (outcome === "trunc" && !ep.trunc) return false;
    if (q) {
      if (ep._hay === undefined) {
        ep._hay = [ep.id, ep.task, ep.g, ep.s || "", ep.p || ""].concat(ep.T.map((t) => t.t + " " + (t.o || ""))).join("\n").toLowerCase();
      }
      if (!ep._hay.includes(q)) return false;
    }
    return true;
  }

  function refresh(resetPage) {
    const q = $("f-search").value.trim().toLowerCase(), source = src.value, outcome = $("f-outcome").value;
    visible = [];
    for (const g of groups) {
      const items = g.items.filter((i) => matches(E[i], q, source, outcome));
      if (items.length) visible.push({items, all: g.items});
    }
    if (resetPage) page = 0;
    renderList();
  }

  function badge(ep) {
    const cls = ep.s === "success" ? "ok" : (ep.R !== null && ep.R <= 0 ? "bad" : "");
    return `<span class="badge ${cls}" title="reward">${fmt(ep.R, 2)}</span>`;
  }

  function renderList() {
    const pages = Math.max(1, Math.ceil(visible.length / PAGE));
    page = Math.min(page, pages - 1);
    const nEp = visible.reduce((n, g) => n + g.items.length, 0);
    $("page-info").textContent = `page ${page + 1}/${pages} · ${visible.length} groups · ${nEp} episodes`;
    const out = [];
    for (const g of visible.slice(page * PAGE, (page + 1) * PAGE)) {
      const first = E[g.all[0]];
      const rs = g.all.map((i) => E[i].R).filter((r) => r !== null);
      const mean = rs.length ? rs.reduce((a, b) => a + b, 0) / rs.length : null;
      const tree = first.b.length > 0;
      out.push(`<div class="grp"><div class="grp-head"><b>${esc(first.task)}</b> · ${esc(first.kind === "eval" ? "eval" : "train")}` +
        (first.step !== null ? ` · step ${fmt(first.step)}` : "") + ` · ${g.all.length} ${tree ? "leaves (tree)" : "episodes"}` +
        ` · mean R ${fmt(mean, 2)}` + (first.g ? ` · <span title="group id">${esc(first.g)}</span>` : "") + `</div>`);
      let prev = [];
      for (const i of g.items) {
        const ep = E[i];
        for (let d = 0; d < ep.b.length - 1; d++) {
          if (prev.length <= d || prev[d] !== ep.b[d] || prev.slice(0, d).join() !== ep.b.slice(0, d).join()) {
            const pre = ep.b.slice(0, d + 1).join("/");
            const under = g.all.filter((j) => E[j].b.slice(0, d + 1).join("/") === pre).map((j) => E[j].R);
            const m = under.reduce((a, b) => a + (b || 0), 0) / under.length;
            out.push(`<div class="node" style="padding-left:${8 + 14 * d}px">▾ node ${esc(pre)} · mean R ${fmt(m, 2)} (${under.length})</div>`);
          }
        }
        prev = ep.b;
        const indent = 8 + 14 * Math.max(0, ep.b.length - 1);
        const path = ep.b.length ? ep.b.join("/") : "#" + (g.all.indexOf(i) + 1);
        out.push(`<div class="ep${i === current ? " sel" : ""}" data-i="${i}" data-episode-id="${esc(ep.id)}" tabindex="0" style="padding-left:${indent}px">` +
          `<span class="path">${esc(path)}</span>${badge(ep)}<span>${ep.T.length} turn${ep.T.length === 1 ? "" : "s"}</span>` +
          `<span class="muted">${esc(ep.s || (ep.trunc ? "truncated" : ""))}</span><span class="id">${esc(ep.id)}</span></div>`);
      }
      out.push(`</div>`);
    }
    $("list").innerHTML = out.join("") || `<p class="muted" style="padding:8px">No episode matches.</p>`;
  }

  function shown(text, ws) {
    let s = esc(text);
    if (ws) s = s.replace(/ /g, `<span class="ws">·</span>`).replace(/\t/g, `<span class="ws">→</span>`);
    return s.replace(/\r?\n/g, `<span class="nl">↵</span>\n`);
  }

  // provenance of a turn's shown context tokens: one source name per token ("unknown" when not recorded)
  function contextSources(turn, n) {
    if (!turn.cs) return new Array(n).fill("unknown");
    const out = [];
    for (const [code, count] of turn.cs) for (let c = 0; c < count; c++) out.push(D.P[code]);
    return out;
  }

  function tokens(run, cls, ws, turn) {
    const ids = D.G[run], out = [];
    const srcs = cls === "ctx" ? contextSources(turn, ids.length) : null;
    for (let j = 0; j < ids.length; j++) {
      const p = ids[j], id = D.I[p];
      if (cls === "ctx") {
        const s = srcs[j] || "unknown";
        out.push(`<span class="tok ctx" data-src="${s}" title="untrained (${s}) · id ${id}">${shown(D.S[p], ws)}</span>`);
      } else {
        const lp = turn.lp && turn.lp[j] !== undefined && turn.lp[j] !== null ? ` · logp ${turn.lp[j].toFixed(3)}` : "";
        out.push(actionSpan(turn, shown(D.S[p], ws), `id ${id}${lp}`));
      }
    }
    return out.join("");
  }

  function actionSpan(turn, inner, extra) {
    if (turn.A === null) {
      return `<span class="tok act-untrained" data-src="assistant" title="action not trained (advantage none) · ${extra}">${inner}</span>`;
    }
    const a = Math.min(1, Math.abs(turn.A) / D.scale).toFixed(3);
    const sign = turn.A > 0 ? "pos" : (turn.A < 0 ? "neg" : "zero");
    return `<span class="tok adv ${sign}" style="--a:${a}" data-adv="${turn.A}" data-src="assistant" title="A = ${signed(turn.A)} · ${extra}">${inner}</span>`;
  }

  // the episode's training rows by source (the mask report): tokens per source, sampled, trained, dilution
  function rowsTable(ep) {
    if (!ep.rows || !ep.rows.length) return "";
    const used = D.P.map((_, c) => c).filter((c) => D.P[c] !== "unknown" || ep.rows.some((r) => r[1][c] > 0));
    const head = `<tr><th>row</th>` + used.map((c) => `<th><span class="src-swatch" data-src="${D.P[c]}"></span>${esc(D.P[c])}</th>`).join("") +
      `<th>sampled</th><th>trained</th><th>dilution</th></tr>`;
    const body = ep.rows.map(([turn, counts, sampled, trained]) => {
      const total = counts.reduce((a, b) => a + b, 0);
      const dil = total ? 1 - sampled / total : 0;
      return `<tr class="mask-row"><th>${turn < 0 ? "whole episode" : "turn " + esc(turn)}</th>` + used.map((c) => `<td>${esc(counts[c])}</td>`).join("") +
        `<td>${esc(sampled)}</td><td>${esc(trained)}</td><td>${dil.toFixed(3)}</td></tr>`;
    }).join("");
    return `<table class="rows" title="training rows of this episode by token source; dilution = 1 − sampled / all tokens">${head}${body}</table>`;
  }

  function show(i) {
    if (i < 0 || i >= E.length) return;
    current = i;
    const ep = E[i], ws = $("ws").checked;
    const meta = [["episode", ep.id], ["task", ep.task], ["reward", fmt(ep.R, 4)], ["stop", ep.s || "–"],
      ["terminated", ep.term], ["truncated", ep.trunc], ["source", ep.src], ["step", fmt(ep.step)]];
    if (ep.b.length) meta.push(["branch", ep.b.join("/")]);
    if (ep.g) meta.push(["group", ep.g]);
    for (const [k, v] of Object.entries(ep.m)) if (k !== "step") meta.push([k, fmt(v, 4)]);
    const out = [`<div class="ep-meta">` + meta.map(([k, v]) => `<div><span>${esc(k)}</span> ${esc(v)}</div>`).join("") + `</div>`];
    out.push(rowsTable(ep));
    if (!D.tokenized && ep.p) {
      out.push(`<div class="turn"><div class="turn-head"><b>prompt</b></div><div class="seq"><span class="tok ctx" title="untrained (prompt)">${shown(ep.p, ws)}</span></div></div>`);
    }
    ep.T.forEach((t, k) => {
      const head = [`<b>turn ${esc(t.k ?? k)}</b>`, t.A === null ? "not trained" : `A = ${signed(t.A)}`, `${esc(t.n)} tokens`];
      if (t.mlp !== undefined) head.push(`mean logp ${t.mlp.toFixed(3)}`);
      if (t.r !== null) head.push(`turn reward ${fmt(t.r, 4)}`);
      if (t.f) head.push(`finish ${esc(t.f)}`);
      if (t.v !== null && t.v !== undefined) head.push(`policy v${esc(t.v)}`);
      if (t.rebuilt) head.push(`context rebuilt (shown whole)`);
      let seq = "";
      if (D.tokenized) {
        const n = D.G[t.c].length;
        if (n > FOLD) {  // a long system prompt or tool output: folded, one click away
          seq += `<details class="fold"${$("unfold").checked ? " open" : ""}><summary>${k === 0 ? "prompt" : "context"}: ${n} untrained tokens</summary>${tokens(t.c, "ctx", ws, t)}</details>`;
        } else if (n) {
          seq += tokens(t.c, "ctx", ws, t);
        }
        seq += tokens(t.a, "act", ws, t);
        if (k === ep.T.length - 1 && t.o) {
          seq += `<span class="obs-label">environment (final reply, not part of any context)</span><span class="tok ctx" title="untrained (environment)">${shown(t.o, ws)}</span>`;
        }
      } else {
        const extra = `${esc(t.n)} tokens` + (t.mlp !== undefined ? ` · mean logp ${t.mlp.toFixed(3)}` : "");
        seq += actionSpan(t, shown(t.t, ws), extra);
        if (t.o) seq += `<span class="obs-label">environment</span><span class="tok ctx" title="untrained (environment)">${shown(t.o, ws)}</span>`;
      }
      out.push(`<div class="turn"><div class="turn-head">${head.join(" · ")}</div><div class="seq">${seq}</div></div>`);
    });
    $("detail").innerHTML = out.join("");
    for (const el of document.querySelectorAll(".ep.sel")) el.classList.remove("sel");
    const el = document.querySelector(`.ep[data-i="${i}"]`);
    if (el) el.classList.add("sel");
    history.replaceState(null, "", "#ep=" + encodeURIComponent(ep.id));
  }

  function step(delta) {
    const order = visible.flatMap((g) => g.items);
    const at = order.indexOf(current);
    const next = order[at < 0 ? 0 : at + delta];
    if (next === undefined) return;
    const gi = visible.findIndex((g) => g.items.includes(next));
    if (Math.floor(gi / PAGE) !== page) { page = Math.floor(gi / PAGE); renderList(); }
    show(next);
  }

  $("list").addEventListener("click", (ev) => {
    const el = ev.target.closest(".ep");
    if (el) show(Number(el.dataset.i));
  });
  $("list").addEventListener("keydown", (ev) => {
    const el = ev.target.closest(".ep");
    if (el && (ev.key === "Enter" || ev.key === " ")) { ev.preventDefault(); show(Number(el.dataset.i)); }
  });
  $("f-search").addEventListener("input", () => refresh(true));
  src.addEventListener("change", () => refresh(true));
  $("f-outcome").addEventListener("change", () => refresh(true));
  $("prev").addEventListener("click", () => { if (page > 0) { page--; renderList(); } });
  $("next").addEventListener("click", () => { page++; renderList(); });
  $("ep-prev").addEventListener("click", () => step(-1));
  $("ep-next").addEventListener("click", () => step(1));
  $("ws").addEventListener("change", () => { if (current >= 0) show(current); });
  $("unfold").addEventListener("change", () => { if (current >= 0) show(current); });
  const bySource = () => $("detail").classList.toggle("by-source", $("by-source").checked);
  $("by-source").addEventListener("change", bySource);
  bySource();

  refresh(true);
  const m = location.hash.match(/^#ep=(.+)$/);
  if (m) {
    const i = E.findIndex((ep) => ep.id === decodeURIComponent(m[1]));
    if (i >= 0) {
      const gi = visible.findIndex((g) => g.items.includes(i));
      if (gi >= 0) { page = Math.floor(gi / PAGE); renderList(); }
      show(i);
    }
  }
})();
