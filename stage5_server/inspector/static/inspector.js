// The inspector page: every engine step, the KV pool and the queues, live from a server or replayed from a
// recorded trace (stage5_server/inspector/). Plain JavaScript, SVG and one canvas; no library, nothing
// fetched from another host. Every string that came from a request (ids, prompts, model output) reaches the
// page through textContent or an attribute, never as HTML.
//
// Where it runs:
//   <div data-inspector="live">              the server's /inspect page: /inspect/events and a chat pane
//   <div data-inspector="replay" data-trace="NAME">   a course page: assets/replays/NAME.json
//   <div data-inspector="loader">            a file picker that replays a trace of your own
(function () {
  'use strict';

  const SVG_NS = 'http://www.w3.org/2000/svg';
  const FREE = 0, USED = 1, CACHED = 2, RESERVED = 3;
  const KINDS = [['decode', '#3867d6'], ['prefill', '#e58e26'], ['verify', '#20a55a']];
  const PALETTE = ['#4e79a7', '#f28e2b', '#e15759', '#76b7b2', '#59a14f', '#edc948', '#b07aa1', '#ff9da7',
    '#9c755f', '#17becf', '#bcbd22', '#8c6d31'];
  const OTHERS = ['#8d99a6', '#a3adb8', '#75828f', '#b8c0c9', '#96a0ab'];
  const LIVE_KEEP = 3000; // records a live page keeps for its timeline
  const SCRIPT_URL = document.currentScript ? document.currentScript.src : window.location.href;

  // ---- small DOM helpers: text always as text -------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === 'class') node.className = value;
      else if (key === 'style') Object.assign(node.style, value); // CSSOM: allowed by the page's policy
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(typeof child === 'object' ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function fmt(value, unit) {
    if (value === null || value === undefined) return '';
    if (unit === 'steps') return `${+value.toFixed(2)} step${value === 1 ? '' : 's'}`;
    return value >= 1 ? `${value.toFixed(2)} s` : `${(value * 1000).toFixed(1)} ms`;
  }

  // ---- colours: one per request, greys for requests of other trust groups (~N) ---------------------
  class Colors {
    constructor() { this.order = new Map(); }
    of(id) {
      if (id === null || id === undefined) return '#ccc';
      if (id.startsWith('~')) return OTHERS[(parseInt(id.slice(1, 7), 16) || 0) % OTHERS.length];
      if (!this.order.has(id)) this.order.set(id, this.order.size);
      return PALETTE[this.order.get(id) % PALETTE.length];
    }
  }
  // Another trust group's request: an alias the server made (~ and hex digits), shown as "other 3fa2".
  function label(id) { return id && id.startsWith('~') ? `other ${id.slice(1, 5)}` : id; }

  // ---- the pool, as the records describe it (the same rules as PoolView in hub.py) ------------------
  class PoolModel {
    constructor(numBlocks) {
      this.n = numBlocks;
      this.state = new Uint8Array(numBlocks);
      this.refs = new Int32Array(numBlocks);
      this.owner = new Array(numBlocks).fill(null);
      this.running = []; this.waiting = []; this.numWaiting = 0;
    }
    load(snapshot) {
      for (const [block, owner, state, refs] of snapshot.blocks || []) {
        if (block < this.n) { this.state[block] = state; this.owner[block] = owner; this.refs[block] = refs; }
      }
      this.running = snapshot.running || []; this.waiting = snapshot.waiting || [];
      this.numWaiting = snapshot.num_waiting || 0;
    }
    // In the order the engine did it: blocks given back as the step was scheduled (preemptions), the blocks
    // the step handed out, then the blocks of the requests it finished.
    apply(record) {
      this.release((record.freed || []).filter((f) => f.scheduling));
      for (const r of record.requests || []) {
        for (const b of r.reserved || []) { this.refs[b] += 1; this.state[b] = RESERVED; this.owner[b] = r.id; }
        for (const b of (r.hit || []).concat(r.new || [])) {
          if (this.state[b] === RESERVED && this.owner[b] === r.id) { this.state[b] = USED; continue; }
          this.refs[b] += 1;
          if (this.refs[b] === 1) { this.state[b] = USED; this.owner[b] = r.id; }
        }
      }
      this.release((record.freed || []).filter((f) => !f.scheduling));
      this.running = record.running || []; this.waiting = record.waiting || [];
      this.numWaiting = record.num_waiting || 0;
    }
    release(freed) {
      for (const f of freed) {
        for (const b of f.blocks) {
          this.refs[b] = Math.max(0, this.refs[b] - 1);
          if (!this.refs[b]) { this.state[b] = FREE; this.owner[b] = null; }
        }
        for (const b of f.cached || []) { this.state[b] = CACHED; this.owner[b] = f.id; }
      }
    }
    counts() {
      const c = [0, 0, 0, 0];
      for (let b = 0; b < this.n; b++) c[this.state[b]] += 1;
      return { free: c[FREE], used: c[USED], cached: c[CACHED], reserved: c[RESERVED] };
    }
  }

  // ---- the viewer ---------------------------------------------------------------------------------------
  class Viewer {
    constructor(root, live) {
      this.root = root;
      this.live = live;
      this.colors = new Colors();
      this.records = [];
      this.cursor = -1; // the record shown
      this.following = true;
      this.playing = false;
      this.models = new Map(); // rank -> PoolModel as of this.applied
      this.applied = -1; // the last record applied to the models (replay)
      this.texts = new Map(); // request id -> {prompt, output, finish}
      this.clock = 'seconds';
      this.layout = 'blocks';
      this.rank = 0;
      this.build();
    }

    build() {
      const root = this.root;
      clear(root);
      root.classList.add('ssi');
      this.title = el('div', { class: 'ssi-title' });
      this.stepLabel = el('span', { class: 'ssi-step' });
      this.playButton = el('button', { type: 'button', onclick: () => this.togglePlay(), 'aria-label': 'play' }, 'play');
      this.slider = el('input', { type: 'range', min: '0', max: '0', value: '0', 'aria-label': 'step',
        oninput: () => this.seek(parseInt(this.slider.value, 10)) });
      this.rankSelect = el('select', { class: 'ssi-rank', 'aria-label': 'data-parallel rank',
        onchange: () => { this.rank = parseInt(this.rankSelect.value, 10); this.render(); } });
      this.rankSelect.style.display = 'none'; // shown when a second data-parallel rank reports
      const controls = el('div', { class: 'ssi-controls' },
        el('button', { type: 'button', onclick: () => this.seek(0), 'aria-label': 'first step' }, '|<'),
        el('button', { type: 'button', onclick: () => this.seek(this.cursor - 1), 'aria-label': 'previous step' }, '<'),
        this.playButton,
        el('button', { type: 'button', onclick: () => this.seek(this.cursor + 1), 'aria-label': 'next step' }, '>'),
        el('button', { type: 'button', onclick: () => this.seek(this.records.length - 1), 'aria-label': 'last step' },
          '>|'),
        this.slider, this.stepLabel, this.rankSelect);
      this.notice = el('div', { class: 'ssi-notice' });
      this.timeline = el('div', { class: 'ssi-timeline', role: 'img', 'aria-label': 'tokens per step' });
      this.canvas = el('canvas', { class: 'ssi-grid', role: 'img', 'aria-label': 'KV blocks' });
      this.canvas.addEventListener('mousemove', (e) => this.hover(e));
      this.hoverLabel = el('div', { class: 'ssi-hover' }, ' ');
      this.counts = el('div', { class: 'ssi-counts' });
      this.detail = el('div', { class: 'ssi-detail' });
      this.queues = el('div', { class: 'ssi-queues' });
      this.latency = el('div', { class: 'ssi-latency', role: 'img', 'aria-label': 'TTFT and TPOT over time' });
      this.requestList = el('div', { class: 'ssi-requests' });
      const legend = el('div', { class: 'ssi-legend' },
        ...KINDS.map(([kind, color]) => el('span', null, el('i', { style: { background: color } }), kind)),
        el('span', null, el('i', { class: 'ssi-free' }), 'free block'),
        el('span', null, el('i', { class: 'ssi-cached' }), 'cached (free, reusable)'),
        el('span', null, el('i', { class: 'ssi-reserved' }), 'reserved, empty'),
        el('span', null, el('i', { class: 'ssi-hit' }), 'prefix hit'),
        el('span', null, el('i', { class: 'ssi-evicted' }), 'evicted'));
      root.append(this.title, controls, this.notice, el('h4', null, 'Tokens per step against the budget'),
        this.timeline, legend,
        el('div', { class: 'ssi-row' },
          el('div', { class: 'ssi-pool' }, el('h4', null, 'KV pool'), this.canvas, this.hoverLabel, this.counts),
          el('div', { class: 'ssi-side' }, el('h4', null, 'This step'), this.detail, el('h4', null, 'Queues'),
            this.queues)),
        el('h4', null, 'Time to first token and time per output token'), this.latency,
        el('h4', null, 'Requests'), this.requestList);
      if (typeof ResizeObserver !== 'undefined') {
        let width = 0;
        new ResizeObserver(() => {
          if (root.clientWidth !== width) { width = root.clientWidth; this.render(); }
        }).observe(root);
      }
    }

    // ---- input: a trace, or a live stream --------------------------------------------------------------
    setTrace(trace) {
      this.live = false;
      this.stop();
      this.records = trace.steps || [];
      this.clock = trace.clock || 'seconds';
      this.layout = trace.layout || 'blocks';
      this.texts = new Map((trace.requests || []).map((r) => [r.id, r]));
      this.title.textContent = trace.title || '';
      if (trace.notes) this.title.appendChild(el('div', { class: 'ssi-notes' }, trace.notes));
      this.models = new Map(); this.applied = -1;
      this.slider.max = String(Math.max(0, this.records.length - 1));
      this.seek(0);
    }
    hello(data) {
      this.models = new Map();
      for (const [rank, snap] of Object.entries(data.ranks || {})) {
        const model = new PoolModel(snap.num_blocks);
        model.load(snap);
        model.blockSize = snap.block_size; model.budget = snap.budget;
        this.models.set(parseInt(rank, 10), model);
      }
      for (const r of data.requests || []) this.texts.set(r.id, r);
      this.records.push(...(data.records || [])); // after a reconnect: the steps missed (the pools hold them)
      if (this.following) this.cursor = this.records.length - 1;
      this.title.textContent = 'Live: ' + (data.group ? `trust group ${data.group}` : 'this server');
      this.updateRanks();
      this.render();
    }
    addRecords(data) {
      for (const record of data.records || []) {
        let model = this.models.get(record.rank || 0);
        if (!model || model.n !== record.num_blocks) {
          model = new PoolModel(record.num_blocks);
          this.models.set(record.rank || 0, model);
          this.updateRanks();
        }
        model.apply(record);
        this.records.push(record);
      }
      if (this.records.length > LIVE_KEEP) {
        const cut = this.records.length - LIVE_KEEP;
        this.records.splice(0, cut);
        this.cursor = Math.max(0, this.cursor - cut);
      }
      if (data.dropped || data.engine_dropped) {
        this.notice.textContent = `${data.dropped || 0} records missed by this page, ` +
          `${data.engine_dropped || 0} dropped by the engine (the oldest go first when a reader falls behind)`;
      }
      this.slider.max = String(Math.max(0, this.records.length - 1));
      if (this.following) this.cursor = this.records.length - 1;
      this.scheduleRender();
    }
    addText(data) { this.texts.set(data.id, data); this.scheduleRender(); }
    updateRanks() {
      clear(this.rankSelect);
      for (const rank of [...this.models.keys()].sort((a, b) => a - b)) {
        this.rankSelect.appendChild(el('option', { value: String(rank) }, `rank ${rank}`));
      }
      this.rankSelect.value = String(this.rank);
      this.rankSelect.style.display = this.models.size > 1 ? '' : 'none';
    }

    // ---- playback ----------------------------------------------------------------------------------------
    seek(index) {
      if (!this.records.length) { this.render(); return; }
      this.cursor = Math.max(0, Math.min(this.records.length - 1, index));
      this.following = this.live && this.cursor === this.records.length - 1;
      if (!this.live) {
        if (this.cursor < this.applied) { this.models = new Map(); this.applied = -1; }
        while (this.applied < this.cursor) {
          const record = this.records[++this.applied];
          let model = this.models.get(record.rank || 0);
          if (!model) { model = new PoolModel(record.num_blocks); this.models.set(record.rank || 0, model); }
          model.apply(record);
        }
      }
      this.render();
    }
    togglePlay() { if (this.playing || (this.live && this.following)) this.stop(); else this.play(); }
    play() {
      if (this.live) { this.following = true; this.seek(this.records.length - 1); this.playButton.textContent = 'pause'; return; }
      if (this.cursor >= this.records.length - 1) this.seek(0);
      this.playing = true;
      this.playButton.textContent = 'pause';
      const tick = () => {
        if (!this.playing) return;
        if (this.cursor >= this.records.length - 1) { this.stop(); return; }
        this.seek(this.cursor + 1);
        this.timer = setTimeout(tick, 700);
      };
      this.timer = setTimeout(tick, 300);
    }
    stop() {
      this.playing = false;
      this.following = false;
      clearTimeout(this.timer);
      this.playButton.textContent = 'play';
    }
    scheduleRender() {
      if (this.renderQueued) return;
      this.renderQueued = true;
      requestAnimationFrame(() => { this.renderQueued = false; this.render(); });
    }

    // ---- drawing -------------------------------------------------------------------------------------------
    rankRecords() { return this.records.filter((r) => (r.rank || 0) === this.rank); }
    render() {
      const record = this.records[this.cursor];
      this.slider.value = String(Math.max(0, this.cursor));
      this.stepLabel.textContent = record ? `step ${record.step} (${this.cursor + 1} of ${this.records.length})`
        : 'no steps yet';
      if (this.live) this.playButton.textContent = this.following ? 'pause' : 'follow';
      const shown = record && (record.rank || 0) === this.rank ? record : null;
      this.drawTimeline();
      this.drawPool(shown);
      this.drawDetail(shown);
      this.drawQueues();
      this.drawLatency();
      this.drawRequests();
    }

    drawTimeline() {
      clear(this.timeline);
      const records = this.rankRecords();
      const width = Math.max(200, this.timeline.clientWidth || 600), height = 110, pad = 24;
      const current = this.records[this.cursor];
      const at = Math.max(0, records.indexOf(current));
      const maxBars = Math.max(8, Math.floor((width - pad) / 5));
      const start = Math.max(0, Math.min(at - Math.floor(maxBars * 0.8), records.length - maxBars));
      const shown = records.slice(start, start + maxBars);
      const budget = shown.reduce((m, r) => Math.max(m, r.budget || 0), 0);
      const top = Math.max(1, budget, ...shown.map((r) => total(r)));
      const chart = svg('svg', { width, height, viewBox: `0 0 ${width} ${height}` });
      const barWidth = (width - pad) / Math.max(shown.length, 8);
      const y = (v) => height - 14 - (height - 22) * v / top;
      shown.forEach((r, i) => {
        const x = pad + i * barWidth;
        let base = 0;
        for (const [kind, color] of KINDS) {
          const value = (r.requests || []).reduce((s, q) => s + (q[kind] || 0), 0);
          if (!value) continue;
          const rect = svg('rect', { x: x + 0.5, y: y(base + value), width: Math.max(1, barWidth - 1),
            height: y(base) - y(base + value), fill: color });
          rect.appendChild(svg('title')).textContent = `step ${r.step}: ${kind} ${value}`;
          chart.appendChild(rect);
          base += value;
        }
        const hit = svg('rect', { x, y: 0, width: barWidth, height, fill: r === current ? 'rgba(0,0,0,0.08)' : 'transparent',
          class: 'ssi-bar' });
        hit.addEventListener('click', () => this.seek(this.records.indexOf(r)));
        chart.appendChild(hit);
      });
      if (budget) {
        chart.appendChild(svg('line', { x1: pad, x2: width, y1: y(budget), y2: y(budget), class: 'ssi-budget' }));
        chart.appendChild(svg('text', { x: 2, y: y(budget) + 4, class: 'ssi-axis' })).textContent = String(budget);
      } else if (shown.length) {
        chart.appendChild(svg('text', { x: pad, y: 10, class: 'ssi-axis' })).textContent =
          'static batching: no token budget';
      }
      chart.appendChild(svg('text', { x: 2, y: height - 2, class: 'ssi-axis' })).textContent = '0';
      if (shown.length) {
        chart.appendChild(svg('text', { x: pad, y: height - 2, class: 'ssi-axis' })).textContent = `step ${shown[0].step}`;
      }
      this.timeline.appendChild(chart);
    }

    drawPool(record) {
      const model = this.models.get(this.rank);
      const canvas = this.canvas;
      const width = Math.max(160, (canvas.parentNode && canvas.parentNode.clientWidth) || 320);
      if (!model) { canvas.width = width; canvas.height = 20; this.counts.textContent = ''; return; }
      const n = model.n;
      const cell = Math.max(3, Math.min(30, Math.floor(Math.sqrt(width * 260 / n))));
      const cols = Math.max(1, Math.floor(width / cell));
      const rows = Math.ceil(n / cols);
      const ratio = window.devicePixelRatio || 1;
      canvas.width = Math.ceil(cols * cell * ratio); canvas.height = Math.ceil(rows * cell * ratio);
      canvas.style.width = `${cols * cell}px`; canvas.style.height = `${rows * cell}px`;
      this.grid = { cell, cols, n };
      const ctx = canvas.getContext('2d');
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      const marks = new Map();
      const mark = (blocks, kind) => { for (const b of blocks || []) marks.set(b, kind); };
      if (record) {
        for (const r of record.requests || []) { mark(r.new, 'new'); mark(r.hit, 'hit'); mark(r.loaded, 'loaded'); mark(r.evicted, 'evicted'); }
        for (const f of record.freed || []) mark(f.blocks.filter((b) => model.state[b] !== USED), 'freed');
      }
      for (let b = 0; b < n; b++) {
        const x = (b % cols) * cell, yy = Math.floor(b / cols) * cell, s = model.state[b];
        const color = this.colors.of(model.owner[b]);
        ctx.globalAlpha = 1;
        ctx.fillStyle = s === FREE ? '#e9ecef' : s === RESERVED ? '#ffffff' : color;
        if (s === CACHED) ctx.globalAlpha = 0.35;
        ctx.fillRect(x + 1, yy + 1, cell - 2, cell - 2);
        ctx.globalAlpha = 1;
        if (s === RESERVED) { ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.strokeRect(x + 1.5, yy + 1.5, cell - 3, cell - 3); }
        if (s === USED && model.refs[b] > 1 && cell >= 8) {
          ctx.fillStyle = '#000'; ctx.beginPath(); ctx.arc(x + cell - 4, yy + 4, 2, 0, 2 * Math.PI); ctx.fill();
        }
        const kind = marks.get(b);
        if (kind) {
          ctx.lineWidth = Math.max(1.5, cell / 9);
          ctx.strokeStyle = { new: '#222', hit: '#1a9c4a', loaded: '#7d3cbd', evicted: '#d62728', freed: '#888' }[kind];
          if (kind === 'freed') ctx.setLineDash([2, 2]);
          ctx.strokeRect(x + 1.5, yy + 1.5, cell - 3, cell - 3);
          ctx.setLineDash([]);
          if (kind === 'evicted') {
            ctx.beginPath(); ctx.moveTo(x + 3, yy + 3); ctx.lineTo(x + cell - 3, yy + cell - 3); ctx.stroke();
          }
        }
        if (cell >= 22) {
          ctx.fillStyle = s === USED ? '#fff' : '#555';
          ctx.font = `${Math.floor(cell / 3)}px sans-serif`;
          ctx.fillText(String(b), x + 3, yy + cell - 4);
        }
      }
      const c = model.counts();
      const unit = this.layout === 'slab' ? 'cells of the slab' : 'blocks';
      this.counts.textContent = `${n} ${unit} of ${record ? record.block_size : model.blockSize || '?'} tokens: ` +
        `${c.used} used, ${c.cached} cached, ${c.free} free` + (c.reserved ? `, ${c.reserved} reserved but empty` : '');
    }

    hover(event) {
      const model = this.models.get(this.rank);
      if (!model || !this.grid) return;
      const box = this.canvas.getBoundingClientRect();
      const { cell, cols, n } = this.grid;
      const col = Math.floor((event.clientX - box.left) / cell), row = Math.floor((event.clientY - box.top) / cell);
      const b = row * cols + col;
      if (col >= cols || b < 0 || b >= n) return;
      const state = ['free', 'used', 'cached', 'reserved'][model.state[b]];
      const owner = model.owner[b];
      this.hoverLabel.textContent = `block ${b}: ${state}` + (owner ? `, ${label(owner)}` : '') +
        (model.refs[b] > 1 ? `, shared by ${model.refs[b]} requests` : '');
    }

    drawDetail(record) {
      clear(this.detail);
      if (!record) {
        this.detail.append(el('p', null, this.records.length ? 'A step of another rank.' : 'Waiting for a step.'));
        return;
      }
      const tokens = total(record);
      const head = record.budget ? `${tokens} of ${record.budget} tokens` : `${tokens} tokens (static batch)`;
      this.detail.append(el('p', null, `Step ${record.step}: ${head}` +
        (this.clock === 'seconds' ? `, ${fmt(record.duration)}` : '')));
      const list = el('ul');
      for (const r of record.requests || []) {
        const parts = [];
        if (r.prefill) parts.push(`prefill ${r.prefill}`);
        if (r.decode) parts.push(`decode ${r.decode}`);
        if (r.verify) parts.push(`verify ${r.verify} drafts, ${r.accepted || 0} kept`);
        if ((r.hit || []).length) parts.push(`prefix hit: blocks ${r.hit.join(' ')}`);
        if ((r.loaded || []).length) parts.push(`loaded from the offload tier: ${r.loaded.join(' ')}`);
        if ((r.new || []).length) {
          parts.push(`${this.layout === 'slab' ? 'cells written' : 'new blocks'} ${r.new.join(' ')}`);
        }
        if ((r.evicted || []).length) parts.push(`evicted cached blocks ${r.evicted.join(' ')}`);
        if ((r.reserved || []).length) parts.push(`reserved ${r.reserved.length} cells`);
        if (r.sampled) parts.push(`+${r.sampled} token${r.sampled > 1 ? 's' : ''}`);
        if (r.finish) parts.push(`finished (${r.finish})`);
        list.append(el('li', null, this.chip(r.id), ' ' + parts.join(', ')));
      }
      for (const f of record.freed || []) {
        list.append(el('li', null, this.chip(f.id), ` ${f.why || 'finished'}: gave back blocks ${f.blocks.join(' ')}` +
          ((f.cached || []).length ? ` (${f.cached.join(' ')} stay cached)` : '')));
      }
      for (const id of record.preempted || []) list.append(el('li', null, this.chip(id), ' preempted'));
      this.detail.append(list);
      const extra = [];
      if (record.drafts) extra.push(`${record.drafts} draft tokens proposed for the next step`);
      if (record.offload_loaded || record.offload_saved) {
        extra.push(`offload tier: ${record.offload_loaded || 0} blocks loaded, ${record.offload_saved || 0} saved`);
      }
      if (extra.length) this.detail.append(el('p', null, extra.join('; ')));
    }

    drawQueues() {
      clear(this.queues);
      const model = this.models.get(this.rank);
      if (!model) return;
      const row = (name, ids, more) => el('div', { class: 'ssi-queue' }, el('span', { class: 'ssi-qname' }, name),
        ...ids.map((id) => this.chip(id)), more > 0 ? el('span', null, ` +${more} more`) : null,
        ids.length ? null : el('span', { class: 'ssi-empty' }, 'none'));
      this.queues.append(row('running', model.running, 0),
        row('waiting', model.waiting, model.numWaiting - model.waiting.length));
    }

    drawLatency() {
      clear(this.latency);
      const points = [];
      const upTo = this.live ? this.records.length - 1 : this.cursor;
      for (let i = 0; i <= upTo && i < this.records.length; i++) {
        const r = this.records[i];
        for (const q of r.requests || []) {
          if (q.ttft !== undefined && q.ttft !== null) points.push({ t: r.time, v: q.ttft, kind: 'ttft', id: q.id });
          if (q.tpot !== undefined && q.tpot !== null) points.push({ t: r.time, v: q.tpot, kind: 'tpot', id: q.id });
        }
      }
      const width = Math.max(200, this.latency.clientWidth || 600), height = 120, pad = 48;
      const chart = svg('svg', { width, height, viewBox: `0 0 ${width} ${height}` });
      const t0 = this.records.length ? this.records[0].time : 0;
      const tMax = Math.max(1e-9, ...points.map((p) => p.t - t0), 1e-9);
      const vMax = Math.max(1e-9, ...points.map((p) => p.v));
      const unit = this.clock === 'steps' ? 'steps' : 's';
      for (const p of points) {
        const cx = pad + (width - pad - 8) * (p.t - t0) / tMax, cy = height - 16 - (height - 26) * p.v / vMax;
        const dot = svg(p.kind === 'ttft' ? 'circle' : 'rect', p.kind === 'ttft'
          ? { cx, cy, r: 3.5, fill: this.colors.of(p.id) }
          : { x: cx - 3, y: cy - 3, width: 6, height: 6, fill: 'none', stroke: this.colors.of(p.id), 'stroke-width': 1.5 });
        dot.appendChild(svg('title')).textContent = `${label(p.id)} ${p.kind.toUpperCase()} ${fmt(p.v, unit)}`;
        chart.appendChild(dot);
      }
      chart.appendChild(svg('text', { x: 2, y: 12, class: 'ssi-axis' })).textContent = fmt(vMax, unit);
      chart.appendChild(svg('text', { x: 2, y: height - 4, class: 'ssi-axis' })).textContent =
        points.length ? 'dots: TTFT, squares: TPOT' : 'no token yet';
      this.latency.appendChild(chart);
    }

    drawRequests() {
      clear(this.requestList);
      const ids = [...this.texts.keys()].slice(-40);
      if (!ids.length) {
        this.requestList.append(el('p', { class: 'ssi-empty' }, this.live
          ? 'Your trust group\'s requests appear here with their text; everyone else\'s only as anonymous bars and blocks.'
          : 'No text recorded.'));
      }
      for (const id of this.live ? ids.reverse() : ids) { // live: the newest first
        const t = this.texts.get(id);
        this.requestList.append(el('div', { class: 'ssi-request' }, this.chip(id),
          t.finish ? el('span', { class: 'ssi-finish' }, ` ${t.finish}`) : null,
          el('div', { class: 'ssi-text ssi-prompt' }, t.prompt || ''),
          t.output !== null && t.output !== undefined ? el('div', { class: 'ssi-text ssi-output' }, t.output) : null));
      }
    }

    chip(id) {
      return el('span', { class: 'ssi-chip', style: { borderColor: this.colors.of(id) } }, label(id));
    }
  }

  function total(record) {
    return (record.requests || []).reduce((s, q) => s + (q.prefill || 0) + (q.decode || 0) + (q.verify || 0), 0);
  }

  // ---- live: the server's event stream and the chat pane ------------------------------------------------
  function connect(viewer) {
    const source = new EventSource('inspect/events');
    source.addEventListener('hello', (e) => viewer.hello(JSON.parse(e.data)));
    source.addEventListener('steps', (e) => viewer.addRecords(JSON.parse(e.data)));
    source.addEventListener('request', (e) => viewer.addText(JSON.parse(e.data)));
    // Each stream ends after a few seconds and the browser opens the next, where the last one stopped.
    source.addEventListener('error', () => {
      if (source.readyState === EventSource.CLOSED) viewer.notice.textContent = 'The event stream closed.';
    });
    return source;
  }

  function chatPane(root) {
    const model = el('select', { 'aria-label': 'model' });
    const field = (name, value, attrs) => el('label', null, name,
      el('input', Object.assign({ type: 'number', value: String(value), name }, attrs || {})));
    const temperature = field('temperature', 0.7, { step: '0.1', min: '0', max: '2' });
    const topP = field('top_p', 1, { step: '0.05', min: '0', max: '1' });
    const topK = field('top_k', '', { step: '1', min: '-1' });
    const maxTokens = field('max_tokens', 64, { step: '1', min: '1' });
    const minTokens = field('min_tokens', '', { step: '1', min: '0' });
    const seed = field('seed', '', { step: '1' });
    const log = el('div', { class: 'ssi-chatlog', 'aria-live': 'polite' });
    const input = el('textarea', { rows: '3', 'aria-label': 'message', placeholder: 'Say something to the model' });
    const status = el('div', { class: 'ssi-chatstatus' });
    const messages = [];
    const send = el('button', { type: 'submit' }, 'Send');
    const form = el('form', { class: 'ssi-chatform' }, input, send,
      el('button', { type: 'button', onclick: () => { messages.length = 0; clear(log); } }, 'New chat'));
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      const text = input.value;
      if (!text.trim()) return;
      input.value = '';
      messages.push({ role: 'user', content: text });
      log.append(el('div', { class: 'ssi-msg ssi-user' }, text));
      const reply = el('div', { class: 'ssi-msg ssi-assistant' });
      log.append(reply);
      const body = { model: model.value, messages: messages.slice(), stream: true,
        temperature: parseFloat(temperature.lastChild.value), top_p: parseFloat(topP.lastChild.value),
        max_tokens: parseInt(maxTokens.lastChild.value, 10) };
      for (const [name, input] of [['seed', seed], ['top_k', topK], ['min_tokens', minTokens]]) {
        if (input.lastChild.value !== '') body[name] = parseInt(input.lastChild.value, 10); // sent only when set
      }
      send.disabled = true;
      status.textContent = 'streaming';
      try {
        const answer = await stream(body, (delta) => reply.append(document.createTextNode(delta)));
        messages.push({ role: 'assistant', content: answer });
        status.textContent = '';
      } catch (error) {
        status.textContent = String(error.message || error);
        messages.pop();
      } finally {
        send.disabled = false;
      }
    });
    root.append(el('h3', null, 'Chat'), el('div', { class: 'ssi-chatparams' }, el('label', null, 'model or adapter', model),
      temperature, topP, topK, maxTokens, minTokens, seed), log, form, status);
    fetch('v1/models').then((r) => r.json()).then((data) => {
      for (const m of data.data || []) model.append(el('option', { value: m.id }, m.id));
    }).catch((error) => { status.textContent = `models: ${error}`; });
  }

  async function stream(body, onDelta) {
    const response = await fetch('v1/chat/completions', { method: 'POST', body: JSON.stringify(body),
      headers: { 'Content-Type': 'application/json' } });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '', answer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const frame = buffer.slice(0, end); buffer = buffer.slice(end + 2);
        for (const line of frame.split('\n')) {
          if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) { answer += delta.content; onDelta(delta.content); }
        }
      }
    }
    return answer;
  }

  // ---- a trace from a file ----------------------------------------------------------------------------------
  function filePicker(viewer, holder) {
    const input = el('input', { type: 'file', accept: '.json,application/json', 'aria-label': 'trace file' });
    const status = el('span', { class: 'ssi-empty' });
    input.addEventListener('change', () => {
      const file = input.files && input.files[0];
      if (!file) return;
      file.text().then((text) => {
        const trace = JSON.parse(text);
        if (!Array.isArray(trace.steps)) throw new Error('not a trace: it has no steps');
        (viewer() || null).setTrace(trace);
        status.textContent = '';
      }).catch((error) => { status.textContent = `could not replay it: ${error.message || error}`; });
    });
    holder.append(el('label', { class: 'ssi-picker' }, 'Replay a trace file: ', input), status);
  }

  function start() {
    for (const root of document.querySelectorAll('[data-inspector]')) {
      const kind = root.getAttribute('data-inspector');
      if (root.dataset.started) continue;
      root.dataset.started = '1';
      if (kind === 'live') {
        const main = el('div', { class: 'ssi-main' });
        const side = el('div', { class: 'ssi-chat' });
        const picker = el('div', { class: 'ssi-pickerrow' });
        root.append(el('div', { class: 'ssi-live' }, main, side), picker);
        const viewer = new Viewer(main, true);
        connect(viewer);
        chatPane(side);
        let replay = null;
        filePicker(() => replay || (replay = new Viewer(picker.appendChild(el('div')), false)), picker);
      } else if (kind === 'replay') {
        const viewer = new Viewer(root, false);
        const name = root.getAttribute('data-trace');
        fetch(new URL(`../replays/${name}.json`, SCRIPT_URL)).then((r) => {
          if (!r.ok) throw new Error(`HTTP ${r.status}`);
          return r.json();
        }).then((trace) => viewer.setTrace(trace)).catch((error) => {
          viewer.notice.textContent = `The trace ${name} could not be loaded: ${error.message || error}`;
        });
      } else if (kind === 'loader') {
        let viewer = null;
        const holder = el('div');
        root.append(holder);
        filePicker(() => viewer || (viewer = new Viewer(root.appendChild(el('div')), false)), holder);
      }
    }
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
