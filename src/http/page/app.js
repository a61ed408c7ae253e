// gpumem-exporter's live page. Reads api/v1/snapshot every sample interval
// and api/v1/history (sparklines) at most once a second; builds the DOM with
// textContent only (process and pod names are data, never markup). No inline
// handlers, no inline styles: the page's Content-Security-Policy forbids them.
'use strict';
(function () {
  const MIB = 1048576;
  const GIB = 1073741824;
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const HISTORY_SECONDS = 600;
  // Growth per step below this (64 KiB) is read as steady, not a leak.
  const LEAK_SENTENCE_BYTES = 65536;
  const state = {
    sort: { key: 'mem', desc: true },
    snap: null,
    hist: null,
    histAt: 0,
    started: 0,
    // The last snapshot's answer: the server's clock then (its HTTP Date,
    // whole seconds; NaN without one) and this page's monotonic clock
    // (performance.now(), ms) when it came, and when this page last saw
    // taken_at change.
    answer: { server: NaN, at: 0 },
    takenAt: null,
    changedAt: 0,
  };

  function el(tag, cls, ...children) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(typeof c === 'string' ? document.createTextNode(c) : c);
    }
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    return e;
  }
  function group(n) {
    return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ',');
  }
  function mib(bytes) {
    return group(Math.round(bytes / MIB)) + ' MiB';
  }
  // With one decimal: the per-step growth is often a few MiB.
  function mibs(bytes) {
    return (bytes / MIB).toFixed(1) + ' MiB';
  }
  function gib(bytes) {
    return (bytes / GIB).toFixed(1) + ' GiB';
  }
  function pct(ratio) {
    return Math.round(ratio * 100) + ' %';
  }
  function ago(seconds) {
    if (seconds < 60) return seconds.toFixed(1) + ' s';
    if (seconds < 3600) return Math.round(seconds / 60) + ' min';
    return (seconds / 3600).toFixed(1) + ' h';
  }
  function clamp(v, lo, hi) {
    return Math.min(hi, Math.max(lo, v));
  }

  async function getJSON(path) {
    const r = await fetch(path, { cache: 'no-store', credentials: 'same-origin' });
    let body = null;
    try {
      body = await r.json();
    } catch (e) {
      body = null;
    }
    const date = Date.parse(r.headers.get('Date') || '');
    return { ok: r.ok, status: r.status, body, server: date / 1000, at: performance.now() };
  }

  // How old the sample is, by the server's clock only: taken_at against the
  // server's own time when it answered (plus the time since, by this page's
  // monotonic clock), never against the browser's wall clock, which may be
  // off by minutes. Without a Date header: how long taken_at has not moved.
  function sampleAge(s) {
    const now = performance.now();
    const a = state.answer;
    if (Number.isFinite(a.server)) return Math.max(0, a.server + (now - a.at) / 1000 - s.taken_at);
    return Math.max(0, (now - state.changedAt) / 1000);
  }

  async function refresh() {
    let delay = 1000;
    // Numbered, so a test can tell which refresh showed a change.
    const seq = ++state.started;
    document.body.dataset.started = String(seq);
    try {
      const r = await getJSON('api/v1/snapshot');
      if (!r.ok || !r.body || !Array.isArray(r.body.gpus)) {
        state.snap = null;
        const why = r.body && r.body.error ? r.body.error : 'the exporter answered HTTP ' + r.status;
        problems([why.charAt(0).toUpperCase() + why.slice(1) + '.']);
        document.getElementById('gpus').replaceChildren();
        document.getElementById('health').replaceChildren();
        document.getElementById('workloads').replaceChildren();
      } else {
        state.snap = r.body;
        state.answer = { server: r.server, at: r.at };
        if (r.body.taken_at !== state.takenAt) {
          state.takenAt = r.body.taken_at;
          state.changedAt = r.at;
        }
        delay = clamp((r.body.sample_interval_seconds || 1) * 1000, 100, 60000);
        if (performance.now() - state.histAt >= 1000) {
          state.histAt = performance.now();
          const h = await getJSON('api/v1/history?seconds=' + HISTORY_SECONDS);
          if (h.ok && h.body && Array.isArray(h.body.gpus)) state.hist = h.body;
        }
        render();
        document.body.dataset.rendered = String(seq);
      }
    } catch (e) {
      problems(['Cannot reach the exporter (' + (e && e.message ? e.message : e) + ').']);
    }
    setTimeout(refresh, delay);
  }

  function problems(lines) {
    const box = document.getElementById('problems');
    box.replaceChildren(...lines.map((l) => el('p', 'problem', l)));
  }

  function render() {
    const s = state.snap;
    const age = sampleAge(s);
    const stale = Math.max(3 * s.sample_interval_seconds, 5);
    const lines = [];
    if (s.gpus.length === 0) lines.push('NVML lists no GPU on this host.');
    for (const g of s.gpus) {
      if (!g.up) lines.push('GPU ' + g.gpu + (g.name ? ' (' + g.name + ')' : '') + ' is not answering (gpu_up 0).');
    }
    if (age > stale) {
      lines.push('The last sample is ' + ago(age) + ' old: the sampler may be stuck (see /healthz).');
    }
    problems(lines);
    const d = s.driver;
    document.getElementById('summary').textContent =
      s.gpus.length + (s.gpus.length === 1 ? ' GPU' : ' GPUs') +
      ' · driver ' + (d.driver_version || '?') + ' · CUDA ' + (d.cuda_driver_version || '?') +
      ' · sampled every ' + s.sample_interval_seconds + ' s';
    const hist = new Map();
    if (state.hist) for (const h of state.hist.gpus) hist.set(h.gpu + '/' + h.uuid, h);
    document.getElementById('gpus').replaceChildren(...s.gpus.map((g) => gpuCard(g, hist.get(g.gpu + '/' + g.uuid), s.collectors || [])));
    document.getElementById('workloads').replaceChildren(...(s.workloads ? workloads(s.workloads) : []));
    document.getElementById('health').replaceChildren(health(s, age));
  }

  // Who a ranked workload is: "pod team-a/trainer-0", "Slurm job 42", …
  function who(w) {
    if (w.kind === 'pod') return ['pod', (w.namespace ? w.namespace + '/' : '') + (w.pod || w.pod_uid || '?')];
    if (w.kind === 'slurm_job') return ['Slurm job', w.slurm_job || '?'];
    if (w.kind === 'container') return ['container', (w.container_id || '?').slice(0, 12)];
    return ['user', w.user || '?'];
  }

  function hours(h) {
    return h >= 100 ? group(Math.round(h)) : h >= 1 ? h.toFixed(2) : h.toFixed(4);
  }

  // The ledger's workloads ranked by memory GiB-hours, over the last hour
  // and since start, as the API gives them (largest first).
  function workloads(r) {
    const out = [];
    for (const [id, title, w] of [['last-hour', 'Workloads by memory-hours, last ', r.last_hour], ['since-start', 'Workloads by memory-hours since start (', r.since_start]]) {
      const span = id === 'last-hour' ? ago(w.window_seconds) : ago(w.window_seconds) + ')';
      const head = el('tr');
      for (const [label, cls] of [['#', 'num'], ['kind', null], ['workload', null], ['memory GiB-hours', 'num'], ['busy GPU-hours', 'num']]) {
        head.append(el('th', cls, label));
      }
      const body = el('tbody');
      w.workloads.forEach((x, i) => {
        const [kind, name] = who(x);
        const tr = el('tr');
        tr.append(
          el('td', 'rank num', String(i + 1)),
          el('td', 'kind', kind),
          el('td', 'workload', name),
          el('td', 'gib-hours num', hours(x.memory_gib_hours)),
          el('td', 'gpu-hours num', hours(x.busy_gpu_hours)));
        body.append(tr);
      });
      if (w.omitted) {
        const tr = el('tr', 'rollup');
        tr.append(el('td', null, ''), el('td', null, ''), el('td', null, 'not listed'),
          el('td', 'gib-hours num', hours(w.omitted.memory_gib_hours)), el('td', 'gpu-hours num', hours(w.omitted.busy_gpu_hours)));
        body.append(tr);
      }
      if (body.childElementCount === 0) {
        const tr = el('tr', 'empty');
        const td = el('td', 'dim', 'no workload used GPU memory');
        td.colSpan = 5;
        tr.append(td);
        body.append(tr);
      }
      const box = el('div', 'ranking');
      box.dataset.window = id;
      box.append(el('h2', null, title + span), el('table', 'procs', el('thead', null, head), body));
      out.push(box);
    }
    return out;
  }

  // One collector's figures of a GPU as "help: name value · …", for every
  // collector the snapshot lists (its registry row) that the card does not
  // draw itself: a new collector is on the page with no edit here.
  const DRAWN = new Set(['utilization']);
  function figure(name, v) {
    if (v === null || v === undefined) return null;
    if (typeof v === 'object') {
      const inner = Object.entries(v).map(([k, n]) => k + ' ' + n);
      return inner.length ? name + ' {' + inner.join(', ') + '}' : null;
    }
    const label = name.replace(/_(ratio|bytes|celsius|watts|joules|hertz|bytes_per_second)$/, '').replace(/_/g, ' ');
    if (typeof v === 'boolean') return label + ' ' + (v ? 'yes' : 'no');
    if (name.endsWith('_ratio')) return label + ' ' + pct(v);
    if (name.endsWith('_bytes_per_second')) return label + ' ' + mib(v) + '/s';
    if (name.endsWith('_bytes')) return label + ' ' + mib(v);
    if (name.endsWith('_celsius')) return label + ' ' + v + ' °C';
    if (name.endsWith('_watts')) return label + ' ' + v.toFixed(1) + ' W';
    if (name.endsWith('_joules')) return label + ' ' + v.toFixed(0) + ' J';
    if (name.endsWith('_hertz')) return label + ' ' + (v / 1e6).toFixed(0) + ' MHz';
    return label + ' ' + v;
  }
  function collectorLines(g, collectors) {
    const out = [];
    for (const c of collectors) {
      const r = g[c.key];
      if (DRAWN.has(c.key) || !r || typeof r !== 'object') continue;
      const parts = Object.entries(r).map(([k, v]) => figure(k, v)).filter(Boolean);
      if (!parts.length) continue;
      const p = el('p', 'collector dim', c.help + ': ' + parts.join(' · '));
      p.dataset.collector = c.key;
      out.push(p);
    }
    return out;
  }

  function gpuCard(g, hist, collectors) {
    const card = el('section', 'gpu' + (g.up ? '' : ' down'));
    card.dataset.gpu = g.gpu;
    card.dataset.uuid = g.uuid;
    const badge = el('span', g.up ? 'badge up' : 'badge down', g.up ? 'up' : 'not answering');
    card.append(el('h2', null, 'GPU ' + g.gpu + ' ', el('span', 'name', g.name || 'unknown'), ' ', badge));
    card.append(el('p', 'dim ident', [g.uuid, g.pci_bus_id].filter(Boolean).join(' · ') || 'identity not read yet'));
    if (g.memory_note) card.append(el('p', 'unified', g.memory_note + ': used is the host\'s MemTotal − MemAvailable.'));
    const m = g.memory;
    if (!m) {
      card.append(el('p', 'problem', 'No memory figures: the last sample of this GPU failed.'));
      return card;
    }
    const seg = segments(g);
    card.append(bar(m, g.memory_used_peak_bytes, seg));
    const legend = el('p', 'legend',
      el('span', 'key used', 'used ' + mib(m.used_bytes)), ' ',
      m.reserved_bytes === null ? null : el('span', 'key reserved', 'reserved ' + mib(m.reserved_bytes)), ' ',
      el('span', 'key free', 'free ' + mib(m.free_bytes)), ' ',
      el('span', 'total', 'of ' + mib(m.total_bytes)));
    if (g.memory_used_peak_bytes !== null) {
      legend.append(' ', el('span', 'key peak', 'peak ' + mib(g.memory_used_peak_bytes)));
    }
    card.append(legend);
    if (seg) {
      card.append(el('p', 'legend segments',
        el('span', 'key used', 'attributed ' + mib(seg.attributed)), ' ',
        el('span', 'key unattributed', 'unattributed ' + (seg.unattributed === null ? 'n/a' : mib(seg.unattributed))), ' ',
        el('span', 'key stale', 'stale ' + mib(seg.stale))));
    }
    const lim = limits(g, m.total_bytes);
    if (lim) card.append(lim);
    const u = g.utilization;
    if (u) {
      const parts = [];
      if (u.gpu_ratio !== null) parts.push('GPU ' + pct(u.gpu_ratio));
      if (u.memory_ratio !== null) parts.push('memory ' + pct(u.memory_ratio));
      if (u.encoder_ratio !== null) parts.push('encoder ' + pct(u.encoder_ratio));
      if (u.decoder_ratio !== null) parts.push('decoder ' + pct(u.decoder_ratio));
      if (parts.length) card.append(el('p', 'util', 'utilisation: ' + parts.join(' · ')));
    }
    card.append(...collectorLines(g, collectors));
    card.append(sparkline(hist, m.total_bytes));
    const f = g.forecast;
    if (f) {
      card.append(el('p', 'forecast', 'Full in about ' + ago(f.full_in_seconds) + ' at the last ' + ago(f.window_seconds) +
        "'s rate (used grows " + mib(f.growth_bytes_per_second * 60) + ' a minute).'));
    }
    for (const p of g.processes) {
      const st = p.torch && p.torch.steps;
      if (st && st.growth_bytes_per_step !== null && st.growth_bytes_per_step >= LEAK_SENTENCE_BYTES) {
        card.append(el('p', 'leak', 'pid ' + p.pid + ' (' + (p.process || '?') + '): allocated grows ' +
          mibs(st.growth_bytes_per_step) + ' per step over the last ' + st.window_steps + ' steps: a leak?' +
          (st.steps_per_second !== null ? ' At ' + st.steps_per_second.toFixed(1) + ' steps/s that is ' +
            mib(st.growth_bytes_per_step * st.steps_per_second * 60) + ' a minute.' : '')));
      }
      const th = p.torch && p.torch.threshold;
      if (th && th.above) {
        card.append(el('p', 'leak', 'pid ' + p.pid + ' (' + (p.process || '?') + ') is above its warning threshold: ' +
          mib(p.torch.reserved_bytes) + ' reserved, threshold ' + mib(th.bytes) + ' (GPUMEM_BRIDGE_WARN_AT).'));
      }
    }
    for (const mig of g.mig) {
      card.append(el('p', 'mig dim', 'MIG ' + mig.name + ' (GI ' + mig.gpu_instance_id + ', CI ' + mig.compute_instance_id + '): ' +
        (mig.memory ? mib(mig.memory.used_bytes) + ' of ' + mib(mig.memory.total_bytes) : 'no figures')));
    }
    card.append(processTable(g, m.total_bytes));
    const dead = deadTable(g, state.snap.taken_at);
    if (dead) card.append(dead);
    return card;
  }

  // Used memory split in three, where the processes were read: held by
  // live processes (attributed), by stale ones (dead, orphaned, owner
  // deleted), and by no listed process (unattributed: null when a listed
  // process has no figure). null where the processes were not read.
  function segments(g) {
    const st = g.memory_stale_bytes;
    if (!st || !g.memory) return null;
    const stale = Object.values(st).reduce((n, b) => n + b, 0);
    const unattributed = g.memory_unattributed_bytes;
    const attributed = Math.max(0, g.memory.used_bytes - stale - (unattributed || 0));
    return { attributed, stale, unattributed };
  }

  // The workload a process belongs to, as the ledger keys it: its pod,
  // else its Slurm job, else its container, else its user; null when
  // nothing is known of it.
  function workloadOf(p) {
    if (p.pod_uid || p.pod) return 'pod ' + p.namespace + '/' + p.pod + '/' + p.pod_uid;
    if (p.slurm_job) return 'slurm ' + p.slurm_job;
    if (p.container_id) return 'container ' + p.container_id;
    if (p.user) return 'user ' + p.user;
    return null;
  }

  // Each workload's own limits on this GPU (the API's limits): a bar of its
  // used memory, scaled to the GPU's total like the GPU's bar, with a tick at
  // each limit (hard solid, soft dashed, granted dotted, torch's with its own
  // mark; the tick's title names the source and kind), and how far it is from
  // its lowest hard limit. A GPU shared by several workloads none of which
  // has a limit gets a sentence instead.
  const LIMIT_KIND = { hard: 'hard limit', soft: 'soft limit', granted: 'granted share' };
  function tickClass(l) {
    return l.source === 'torch' ? 'torch' : l.kind;
  }
  function limitText(l) {
    return l.source + ' ' + (LIMIT_KIND[l.kind] || l.kind) + ' ' + gib(l.bytes);
  }
  function limits(g, total) {
    const rows = g.limits || [];
    if (!rows.length) {
      const shared = new Set(g.processes.map(workloadOf).filter(Boolean)).size;
      if (shared < 2) return null;
      return el('p', 'nolimit', 'Shared by ' + shared +
        ' workloads, each with no limit of its own: neighbours can take it all.');
    }
    return el('div', 'limits', ...rows.map((w) => limitRow(w, total)));
  }
  function limitRow(w, total) {
    const [kind, name] = who(w);
    const row = el('div', 'workload-limit');
    row.dataset.workload = kind + ' ' + name;
    const head = el('p', 'limit-head', el('span', 'who', kind + ' ' + name), ' ',
      el('span', 'dim', gib(w.used_bytes) + ' used'));
    if (w.to_limit_bytes !== null) head.append(' · ', el('span', 'to-limit', gib(w.to_limit_bytes) + ' to its limit'));
    if (w.limit_in_seconds !== null) {
      head.append(' · ', el('span', 'limit-in', 'reaches it in about ' + ago(w.limit_in_seconds) + ' at its present growth'));
    }
    const keys = el('p', 'legend limit-keys');
    for (const l of w.limits) keys.append(el('span', 'key ' + tickClass(l), limitText(l)), ' ');
    row.append(head, limitBar(w, total), keys);
    return row;
  }
  function limitBar(w, total) {
    const W = 1000;
    const H = 14;
    const top = Math.max(total || 0, w.used_bytes, ...w.limits.map((l) => l.bytes));
    const x = (b) => (top > 0 ? clamp((b / top) * W, 0, W) : 0);
    const s = svg('svg', { class: 'bar wbar', viewBox: '0 0 ' + W + ' ' + H, preserveAspectRatio: 'none', role: 'img' });
    s.append(svg('title', {}));
    s.firstChild.textContent = 'used ' + gib(w.used_bytes) + '; ' + w.limits.map(limitText).join(', ');
    s.append(svg('rect', { class: 'free', x: 0, y: 0, width: W, height: H }));
    s.append(svg('rect', { class: 'used', x: 0, y: 0, width: x(w.used_bytes), height: H }));
    for (const l of w.limits) {
      const px = clamp(x(l.bytes), 2, W - 2);
      const t = svg('g', { class: 'tick ' + tickClass(l), 'data-source': l.source, 'data-kind': l.kind, 'data-bytes': l.bytes });
      t.append(svg('title', {}), svg('line', { x1: px, x2: px, y1: 0, y2: H }));
      t.firstChild.textContent = limitText(l);
      if (l.source === 'torch') t.append(svg('polygon', { points: (px - 9) + ',0 ' + (px + 9) + ',0 ' + px + ',7' }));
      s.append(t);
    }
    return s;
  }

  // The idle marker of a process that ran no kernel for at least
  // processes.idle_after (the API's idle_since): " idle 2h 10m".
  function idleMark(p) {
    if (p.idle_since === null || p.idle_since === undefined || !state.snap) return [];
    const mark = el('span', 'idle', 'idle ' + ago(Math.max(0, state.snap.taken_at - p.idle_since)));
    mark.dataset.idleSince = String(p.idle_since);
    return [' ', mark];
  }

  // Who a stale process belonged to when last seen alive.
  function lastOwner(p) {
    if (p.pod) return 'pod ' + p.namespace + '/' + p.pod + (p.container ? ' (' + p.container + ')' : '');
    if (p.slurm_job) return 'Slurm job ' + p.slurm_job + (p.slurm_step ? '.' + p.slurm_step : '');
    if (p.container_name) return 'container ' + p.container_name;
    if (p.container_id) return 'container ' + p.container_id.slice(0, 12);
    if (p.user) return 'user ' + p.user;
    return '?';
  }

  // "Held by the dead": each stale process of the GPU, largest first.
  function deadTable(g, takenAt) {
    const stale = g.processes.filter((p) => p.stale);
    if (!stale.length) return null;
    stale.sort((a, b) => (b.memory_used_bytes || 0) - (a.memory_used_bytes || 0) || a.pid - b.pid);
    const head = el('tr');
    for (const [label, cls] of [['pid', 'num'], ['reason', null], ['since', null], ['bytes', 'num'], ['last owner', null]]) {
      head.append(el('th', cls, label));
    }
    const body = el('tbody');
    for (const p of stale) {
      const tr = el('tr');
      tr.dataset.stalePid = String(p.pid);
      tr.dataset.reason = p.stale.reason;
      tr.dataset.since = String(p.stale.since);
      tr.append(
        el('td', 'pid num', String(p.pid)),
        el('td', 'reason', p.stale.reason.replace('_', ' ')),
        el('td', 'since', ago(Math.max(0, takenAt - p.stale.since)) + ' ago'),
        el('td', 'mem num', p.memory_used_bytes === null ? 'n/a' : mib(p.memory_used_bytes)),
        el('td', 'owner', (p.process || '?') + ', ' + lastOwner(p)));
      body.append(tr);
    }
    const box = el('div', 'dead');
    box.append(el('h3', null, 'Held by the dead'), el('table', 'procs', el('thead', null, head), body));
    return box;
  }

  function bar(m, peak, seg) {
    const w = 1000;
    const x = (b) => (m.total_bytes > 0 ? clamp((b / m.total_bytes) * w, 0, w) : 0);
    const s = svg('svg', { class: 'bar', viewBox: '0 0 1000 24', preserveAspectRatio: 'none', role: 'img' });
    s.append(svg('title', {}));
    const reserved = m.reserved_bytes === null ? 0 : m.reserved_bytes;
    s.firstChild.textContent = 'used ' + mib(m.used_bytes) + (m.reserved_bytes === null ? '' : ', reserved ' + mib(reserved)) + ', free ' + mib(m.free_bytes);
    s.append(svg('rect', { class: 'free', x: 0, y: 0, width: w, height: 24 }));
    if (seg) {
      // Attributed, stale, unattributed, side by side; together the used.
      let at = 0;
      for (const [cls, b] of [['used', seg.attributed], ['stale', seg.stale], ['unattributed', seg.unattributed || 0]]) {
        s.append(svg('rect', { class: cls, x: x(at), y: 0, width: x(at + b) - x(at), height: 24 }));
        at += b;
      }
      s.firstChild.textContent += ' (attributed ' + mib(seg.attributed) + ', stale ' + mib(seg.stale) +
        (seg.unattributed === null ? '' : ', unattributed ' + mib(seg.unattributed)) + ')';
    } else {
      s.append(svg('rect', { class: 'used', x: 0, y: 0, width: x(m.used_bytes), height: 24 }));
    }
    s.append(svg('rect', { class: 'reserved', x: x(m.used_bytes), y: 0, width: x(reserved), height: 24 }));
    if (peak !== null && peak !== undefined) {
      const px = clamp(x(peak), 2, w - 2);
      s.append(svg('line', { class: 'peak', x1: px, x2: px, y1: 0, y2: 24 }));
    }
    return s;
  }

  function sparkline(hist, total) {
    const W = HISTORY_SECONDS;
    const H = 40;
    const wrap = el('div', 'spark');
    const s = svg('svg', { class: 'sparkline', viewBox: '0 0 ' + W + ' ' + H, preserveAspectRatio: 'none', role: 'img' });
    const pts = hist ? hist.points : [];
    if (pts.length === 0 || !(total > 0)) {
      wrap.append(el('p', 'dim', 'used memory, last 10 min: no history yet'));
      return wrap;
    }
    // Scaled to the highest point (a flat line at 8 % of the GPU says
    // little); the caption gives the scale.
    const end = Math.floor(state.hist.taken_at);
    const max = pts.reduce((m, p) => Math.max(m, p[1]), 0);
    const top = Math.max(max * 1.1, MIB);
    const xs = (t) => clamp(W - (end - t), 0, W);
    const ys = (b) => H - clamp((b / top) * H, 0, H);
    let d = '';
    let prev = null;
    for (const [t, used] of pts) {
      d += (prev !== null && t - prev <= 2 ? 'L' : 'M') + xs(t).toFixed(1) + ' ' + ys(used).toFixed(1);
      prev = t;
    }
    s.append(svg('path', { class: 'line', d }));
    wrap.append(s, el('p', 'dim', 'used memory, last 10 min: highest ' + mib(max) + ' (' + pct(max / total) + ' of the GPU)'));
    return wrap;
  }

  const COLUMNS = [
    { key: 'pid', label: 'pid' },
    { key: 'process', label: 'process' },
    { key: 'user', label: 'user' },
    { key: 'pod', label: 'namespace / pod' },
    { key: 'mem', label: 'memory' },
    { key: 'mem', label: 'share', share: true },
  ];
  function sortValue(p, key) {
    switch (key) {
      case 'pid': return p.pid;
      case 'mem': return p.memory_used_bytes === null ? -1 : p.memory_used_bytes;
      case 'pod': return (p.namespace + '/' + p.pod).toLowerCase();
      default: return String(p[key] || '').toLowerCase();
    }
  }

  function processTable(g, total) {
    const procs = g.processes.slice();
    const { key, desc } = state.sort;
    procs.sort((a, b) => {
      const va = sortValue(a, key);
      const vb = sortValue(b, key);
      const c = va < vb ? -1 : va > vb ? 1 : a.pid - b.pid;
      return desc ? -c : c;
    });
    const torch = procs.some((p) => p.torch);
    const util = procs.some((p) => p.utilization);
    const cols = COLUMNS.slice();
    if (util) cols.push({ key: null, label: 'SM' });
    if (torch) cols.push({ key: null, label: 'torch allocated / reserved' });
    const steps = procs.some((p) => p.torch && p.torch.steps);
    if (steps) cols.push({ key: null, label: 'per step' });
    const head = el('tr');
    for (const c of cols) {
      if (!c.key || c.share) {
        head.append(el('th', c.share ? 'num' : null, c.label));
        continue;
      }
      const arrow = c.key === key ? (desc ? ' ▼' : ' ▲') : '';
      const b = el('button', 'sort', c.label + arrow);
      b.type = 'button';
      b.dataset.key = c.key;
      b.addEventListener('click', () => sortBy(c.key));
      const th = el('th', c.key === 'mem' ? 'num' : null, b);
      th.setAttribute('aria-sort', c.key === key ? (desc ? 'descending' : 'ascending') : 'none');
      head.append(th);
    }
    const body = el('tbody');
    for (const p of procs) {
      const tr = el('tr');
      tr.dataset.pid = String(p.pid);
      if (p.stale) tr.className = 'stale';
      const used = p.memory_used_bytes;
      const where = p.pod ? p.namespace + '/' + p.pod + (p.container ? ' (' + p.container + ')' : '') : '—';
      tr.append(
        el('td', 'pid num', String(p.pid)),
        el('td', 'process', p.process || '?', ...idleMark(p)),
        el('td', 'user', p.user || '?'),
        el('td', 'pod', where),
        el('td', 'mem num', used === null ? 'n/a' : mib(used)),
        el('td', 'share num', used === null || !(total > 0) ? '—' : (100 * used / total).toFixed(1) + ' %'));
      if (util) tr.append(el('td', 'sm num', p.utilization ? pct(p.utilization.sm_ratio) : '—'));
      if (torch) {
        tr.append(el('td', 'torch num', p.torch ? mib(p.torch.allocated_bytes) + ' / ' + mib(p.torch.reserved_bytes) : '—'));
      }
      if (steps) tr.append(el('td', 'steps num', stepText(p.torch && p.torch.steps)));
      body.append(tr);
    }
    for (const [label, r] of [['other', g.processes_other], ['not listed', g.processes_omitted]]) {
      if (!r) continue;
      const tr = el('tr', 'rollup');
      const cells = [
        el('td', null, ''),
        el('td', null, label + ' (' + r.count + (r.count === 1 ? ' process)' : ' processes)')),
        el('td', null, ''),
        el('td', null, ''),
        el('td', 'mem num', mib(r.memory_used_bytes)),
        el('td', 'share num', total > 0 ? (100 * r.memory_used_bytes / total).toFixed(1) + ' %' : '—'),
      ];
      if (util) cells.push(el('td', null, ''));
      if (torch) cells.push(el('td', null, ''));
      if (steps) cells.push(el('td', null, ''));
      tr.append(...cells);
      body.append(tr);
    }
    if (body.childElementCount === 0) {
      const tr = el('tr', 'empty');
      const td = el('td', 'dim', 'no process on this GPU');
      td.colSpan = cols.length;
      tr.append(td);
      body.append(tr);
    }
    return el('table', 'procs', el('thead', null, head), body);
  }

  // "+3.0 MiB · 12.5/s · 812 steps": growth per step (once 16 steps are
  // in), pace, steps taken.
  function stepText(st) {
    if (!st) return '—';
    const parts = [];
    if (st.growth_bytes_per_step !== null) {
      parts.push((st.growth_bytes_per_step >= 0 ? '+' : '−') + mibs(Math.abs(st.growth_bytes_per_step)));
    }
    if (st.steps_per_second !== null) parts.push(st.steps_per_second.toFixed(1) + '/s');
    parts.push(group(st.total) + (st.total === 1 ? ' step' : ' steps'));
    return parts.join(' · ');
  }

  function sortBy(key) {
    const s = state.sort;
    if (s.key === key) s.desc = !s.desc;
    else {
      s.key = key;
      s.desc = key === 'mem';
    }
    if (state.snap) render();
  }

  function health(s, age) {
    const up = s.gpus.filter((g) => g.up).length;
    const errors = s.nvml_errors.reduce((n, e) => n + e.count, 0);
    const list = el('ul', 'facts',
      el('li', 'gpu-up', 'gpu_up: ' + up + ' of ' + s.gpus.length + ' answering'),
      el('li', 'age', 'last sample: ' + ago(age) + ' ago'),
      el('li', 'errors', 'NVML errors: ' + group(errors) + (errors ? ' (' + s.nvml_errors.map((e) => e.operation + ' ' + e.error + ' × ' + e.count).join(', ') + ')' : '')),
      el('li', null, 'processes not found in /proc: ' + group(s.process_lookup_failures)),
      el('li', null, 'NVML re-opened: ' + group(s.nvml_reinit_attempts) + ' times'));
    if (s.kubernetes) {
      list.append(el('li', null, 'Kubernetes: ' + (s.kubernetes.synced ? 'synced, ' : 'not synced yet, ') + s.kubernetes.pods + ' pods'));
    }
    list.append(el('li', 'dim', 'gpumem-exporter ' + s.exporter.version + ' (' + s.exporter.revision + ')'));
    return el('div', null, el('h2', null, 'Health'), list);
  }

  document.addEventListener('DOMContentLoaded', refresh);
})();
