// The job's page (docs/dashboard.md). window.NONSTOP.mode is "live" (served
// by the controller at /: polls /events and /status) or "report" (`nonstop
// report`: the journal is window.NONSTOP.journal). Everything is drawn from
// journal records (docs/journal.md), so both modes show the same things.
(function () {
  'use strict';
  const config = window.NONSTOP || { mode: 'report', journal: [] };
  const $ = (id) => document.getElementById(id);

  // Errors of this page, kept where a test (or a person) can read them.
  function pageError(text) {
    const e = $('errors');
    e.hidden = false;
    e.textContent += text + '\n';
  }
  window.addEventListener('error', (e) => pageError('error: ' + e.message));
  window.addEventListener('unhandledrejection', (e) => pageError('unhandled rejection: ' + e.reason));

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') node.className = v; else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  const fmtMs = (v) => (typeof v === 'number' ? v.toFixed(Math.abs(v) < 10 ? 1 : 0) : '–');
  const fmtBytes = (b) => (b >= 1 << 20 ? (b / (1 << 20)).toFixed(1) + ' MiB' : b >= 1024 ? (b / 1024).toFixed(1) + ' KiB' : b + ' B');
  const median = (xs) => {
    if (!xs.length) return NaN;
    const s = xs.slice().sort((a, b) => a - b);
    return s[Math.floor(s.length / 2)];
  };
  function handled(rec) {
    if (rec.restarted_from_checkpoint) return 'checkpoint restart';
    if (rec.new_world < rec.old_world) return 'shrink';
    if (rec.new_world > rec.old_world) return 'grow';
    if (rec.replacements && rec.replacements.length) return 'spare';
    return 'same members';
  }

  // ---- the model: what the journal says ----
  function Model() {
    this.start = null; this.last = null; this.end = null; this.policy = null;
    this.steps = new Map();   // step → {loss, secs, tps, world, t}; a step computed again keeps its last
    this.stepEvents = [];     // [t seconds, step] of every step record, redone ones included
    this.world = [];          // [t seconds, members, spares]
    this.recoveries = new Map();
    this.refused = null;
    this.members = 0; this.spares = null;
    this.records = 0;
  }
  Model.prototype.t = function (us) { return this.start === null ? 0 : (us - this.start) / 1e6; };
  Model.prototype.recovery = function (id) {
    if (!this.recoveries.has(id)) this.recoveries.set(id, { id: id });
    return this.recoveries.get(id);
  };
  Model.prototype.add = function (r) {
    if (!r || typeof r !== 'object') return;
    this.records++;
    const us = typeof r.time_us === 'number' ? r.time_us : null;
    if (this.start === null && us !== null) this.start = us;
    if (us !== null) this.last = us;
    switch (r.event) {
      case 'job_start':
        if (us !== null) this.start = us;
        this.policy = r.policy || null;
        break;
      case 'step':
        this.steps.set(r.step, { loss: r.loss, secs: r.step_seconds, tps: r.tokens_per_second, world: r.world_size, t: us });
        this.stepEvents.push([this.t(us), r.step]);
        break;
      case 'plan':
        this.members = (r.members || []).length;
        if (typeof r.spares === 'number') this.spares = r.spares;
        this.world.push([this.t(us), this.members, this.spares]);
        if (r.recovery) this.recovery(r.recovery).planAt = us;
        break;
      case 'join':
        if (r.spare && this.spares !== null) {
          this.spares++;
          this.world.push([this.t(us), this.members, this.spares]);
        }
        break;
      case 'spare_lost':
        if (this.spares !== null && this.spares > 0) {
          this.spares--;
          this.world.push([this.t(us), this.members, this.spares]);
        }
        break;
      case 'recovery_start':
      case 'resize_start': {
        const rec = this.recovery(r.recovery);
        rec.startAt = us;
        break;
      }
      case 'recovery_end': {
        const rec = this.recovery(r.recovery && r.recovery.id);
        rec.end = r.recovery;
        rec.endAt = us;
        break;
      }
      case 'scale_refused':
        this.refused = r;
        break;
      case 'job_end':
        this.end = r;
        break;
    }
  };
  // Goodput from the time lost: 1 − Σ time lost / the training's wall time (from the first step's
  // start to the last step's end). Null before a step.
  Model.prototype.goodput = function (recs) {
    const first = this.stepEvents.length ? this.stepEvents[0] : null;
    if (!first) return null;
    const firstSecs = this.steps.has(first[1]) && typeof this.steps.get(first[1]).secs === 'number' ? this.steps.get(first[1]).secs : 0;
    const wall = this.stepEvents[this.stepEvents.length - 1][0] - (first[0] - firstSecs);
    return wall > 0 ? Math.max(0, Math.min(1, 1 - timeLostMs(recs) / 1000 / wall)) : null;
  };
  function timeLostMs(recs) { return recs.reduce((n, r) => n + (typeof r.end.time_lost_ms === 'number' ? Math.max(0, r.end.time_lost_ms) : 0), 0); }
  // "1313 ms lost (0.61 of a step)", or why there is no figure.
  function lostText(e) {
    if (typeof e.time_lost_ms !== 'number') return (e.outcome || '').startsWith('superseded') ? 'counted in the next recovery' : '–';
    const t = e.time_lost || {};
    return fmtMs(e.time_lost_ms) + ' ms' + (typeof t.normal_steps === 'number' ? ' (' + t.normal_steps.toFixed(2) + ' of a step)' : '');
  }
  // The split of a recovery's time lost, for a tooltip.
  function lostSplit(e) {
    const s = (e.time_lost || {}).split_ms || {};
    return ['in_flight', 'detect', 'abort', 'plan', 'state_copy', 'resumed_step_vs_normal', 'redone_steps']
      .filter((k) => typeof s[k] === 'number').map((k) => k + ' ' + fmtMs(s[k]) + ' ms').join(', ');
  }

  // When the fault happened and when each phase ended, in seconds since the start.
  Model.prototype.phases = function (rec) {
    const e = rec.end;
    if (!e || rec.startAt === undefined) return null;
    const at = e.ms_after_fault || {};
    const fault = rec.startAt - (typeof at.detected === 'number' ? at.detected * 1000 : 0);
    const out = { fault: this.t(fault) };
    for (const k of ['detected', 'aborted', 'plan_published', 'state_ready', 'first_step_completed']) {
      if (typeof at[k] === 'number') out[k] = this.t(fault + at[k] * 1000);
    }
    out.until = out.first_step_completed !== undefined ? out.first_step_completed : this.t(rec.endAt);
    return out;
  };

  // ---- drawing ----
  const charts = {};
  function chart(name, data, options) {
    const figure = $('chart-' + name).parentNode;  // the counts are for a test (and a glance in the inspector)
    if (figure.dataset.firstPoints === undefined && data.length) figure.dataset.firstPoints = data.length;
    figure.dataset.points = data.length;
    if (!data.length) return;
    if (charts[name]) {
      charts[name].updateOptions(Object.assign({ file: data }, options));
    } else {
      charts[name] = new Dygraph($('chart-' + name), data, options);
    }
  }

  function card(value, label) { return el('div', { class: 'card' }, el('b', {}, value), el('span', {}, label)); }

  // The markers, table rows and summary lines of a run's recoveries (`run`: its name, in a comparison).
  function recoveryRows(m, recs, run) {
    const markers = [], rows = [], lines = [];
    for (const r of recs) {
      const e = r.end, p = m.phases(r) || {}, at = e.ms_after_fault || {};
      const cause = (e.injected ? 'injected ' + e.injected + ': ' : '') + (e.causes || []).join('; ');
      const phasesText = ['detected', 'aborted', 'plan_published', 'state_ready', 'first_step_completed']
        .map((k) => k + ' ' + fmtMs(at[k]) + ' ms').join(', ');
      const downtime = e.kind === 'resize' ? e.pause_ms : e.downtime_ms;
      markers.push(el('span', {
        class: 'marker ' + (e.kind === 'resize' ? 'resize' : 'recovery'), 'data-recovery': e.id,
        title: cause + '\n' + phasesText + '\ntime lost: ' + lostSplit(e),
      }, (run ? run + ': ' : '') + (e.kind === 'resize' ? 'resize #' : 'recovery #') + e.id + ' at ' +
        (p.fault !== undefined ? p.fault.toFixed(1) + ' s' : '?') + ': ' + lostText(e) + ' lost'));
      const cells = [el('td', {}, e.id)];
      if (run) cells.push(el('td', {}, run));
      rows.push(el('tr', { 'data-recovery': e.id },
        ...cells, el('td', {}, e.kind), el('td', {}, cause), el('td', {}, handled(e) + (e.replacements && e.replacements.length ? ' (' + e.replacements.join('; ') + ')' : '')),
        el('td', {}, e.outcome), el('td', {}, e.old_world + ' → ' + e.new_world),
        el('td', { class: 'num time-lost', title: lostSplit(e) }, lostText(e)),
        ...['detected', 'aborted', 'plan_published', 'state_ready', 'first_step_completed'].map((k) => el('td', { class: 'num' }, fmtMs(at[k]))),
        el('td', { class: 'num' }, fmtMs(downtime)), el('td', { class: 'num' }, e.lost_steps),
        el('td', { class: 'num' }, e.bytes_copied ? fmtBytes(e.bytes_copied) + ' in ' + fmtMs(e.transfer_ms) + ' ms' : '–')));
      lines.push(el('li', {}, (run ? run + ' ' : '') + '#' + e.id + ' ' + e.kind + ': ' + cause + ' → ' + handled(e) + ', ' +
        e.outcome + '; time lost ' + lostText(e) + (lostSplit(e) ? ': ' + lostSplit(e) : '') + '; ' +
        (e.kind === 'resize' ? 'pause ' : 'downtime (fault → first step, less a step) ') + fmtMs(downtime) + ' ms; ' +
        e.lost_steps + ' step(s) lost'));
    }
    return { markers, rows, lines };
  }

  function render(m, status) {
    const steps = Array.from(m.steps.entries()).sort((a, b) => a[0] - b[0]);
    const recs = Array.from(m.recoveries.values()).filter((r) => r.end).sort((a, b) => a.id - b.id);
    const phase = status ? status.phase : m.end ? 'ended' : 'running';
    $('phase').textContent = phase;
    $('phase').className = 'badge ' + phase;
    const lastStep = steps.length ? steps[steps.length - 1] : null;
    $('headline').textContent = m.end ? 'job ended (exit code ' + m.end.exit_code + '): ' + m.end.reason
      : status && status.waiting_for ? status.waiting_for.text : '';

    // Summary cards.
    const lost = recs.reduce((n, r) => n + (r.end.lost_steps || 0), 0);
    const cards = [
      card(lastStep ? lastStep[0] : '–', 'highest step'),
      card(!lastStep ? '–' : typeof lastStep[1].loss === 'number' ? lastStep[1].loss.toFixed(4) : 'NaN', 'loss'),
      card(lastStep && lastStep[1].tps ? Math.round(lastStep[1].tps) : '–', 'tokens/s'),
      card(status ? status.world_size : m.members, 'world size'),
      card(status ? status.spares : m.spares === null ? '–' : m.spares, 'spares'),
      card(recs.filter((r) => r.end.kind !== 'resize').length, 'recoveries'),
      card(recs.filter((r) => r.end.kind === 'resize').length, 'resizes'),
      card(lost, 'steps lost'),
      card((timeLostMs(recs) / 1000).toFixed(2) + ' s', 'time lost to faults'),
    ];
    const goodput = m.goodput(recs);
    if (goodput !== null) cards.push(card((goodput * 100).toFixed(1) + ' %', 'goodput'));
    $('summary').replaceChildren(...cards);

    // Charts.
    chart('loss', steps.map((s) => [s[0], s[1].loss]), { labels: ['step', 'loss'], drawPoints: steps.length < 60, strokeWidth: 1.5 });
    chart('speed', steps.map((s) => [s[0], s[1].secs, s[1].tps]), {
      labels: ['step', 'step s', 'tokens/s'],
      series: { 'tokens/s': { axis: 'y2' } },
      axes: { y2: { axisLabelWidth: 60 } },
      ylabel: 'seconds', y2label: 'tokens/s',
    });
    const world = m.world.slice();
    if (world.length) world.push([m.t(m.last), world[world.length - 1][1], world[world.length - 1][2]]);
    const shaded = recs.map((r) => Object.assign({ kind: r.end.kind }, m.phases(r))).filter((p) => p.fault !== undefined);
    chart('world', world.map((w) => [w[0], w[1], w[2] === null ? null : w[2]]), {
      labels: ['t', 'world', 'spares'], stepPlot: true, includeZero: true, strokeWidth: 2, xlabel: 'seconds since the start',
      underlayCallback: (ctx, area, g) => {
        for (const p of shaded) {
          const x0 = g.toDomXCoord(p.fault), x1 = Math.max(g.toDomXCoord(p.until), x0 + 3);
          ctx.fillStyle = p.kind === 'resize' ? 'rgba(60,110,220,0.18)' : 'rgba(220,50,40,0.22)';
          ctx.fillRect(x0, area.y, x1 - x0, area.h);
        }
      },
    });

    // Markers (the time axis, in words) and the recovery table.
    const { markers, rows, lines } = recoveryRows(m, recs, null);
    $('markers').replaceChildren(...markers);
    $('recoveries').tBodies[0].replaceChildren(...rows);
    $('fault-lines').replaceChildren(...lines);
    $('no-recoveries').hidden = recs.length > 0;
    if (charts.loss) {
      charts.loss.setAnnotations(recs.filter((r) => m.steps.has(r.end.resume_step)).map((r) => ({
        series: 'loss', x: r.end.resume_step, shortText: (r.end.kind === 'resize' ? 'Z' : 'R') + r.end.id,
        text: r.end.kind + ' #' + r.end.id + ' resumed at step ' + r.end.resume_step, width: 22,
      })));
    }

    // Members and spares (live only: a report has no /status).
    $('members-section').hidden = !status;
    if (status) {
      const workers = (status.workers || []).filter((w) => w.role !== 'gone')
        .sort((a, b) => (a.rank < 0) - (b.rank < 0) || a.rank - b.rank || a.worker_id - b.worker_id);
      $('members').tBodies[0].replaceChildren(...workers.map((w) => el('tr', { class: w.role, 'data-worker': w.worker_id },
        el('td', { class: 'num' }, w.rank >= 0 ? w.rank : '–'), el('td', { class: 'num' }, w.worker_id), el('td', {}, w.host || 'local'),
        el('td', { class: 'num' }, w.pid), el('td', {}, w.role), el('td', { class: 'num' }, w.last_step),
        el('td', { class: 'num' }, typeof w.heartbeat_age_ms === 'number' ? w.heartbeat_age_ms + ' ms' : '–'))));
    }
    const policy = status ? status.policy : m.policy;
    $('policy').textContent = policy ? JSON.stringify(policy, null, 1) : '–';
    if (m.refused) {
      $('refused').textContent = 'Last refused scale request: ' + JSON.stringify(m.refused.request) + ' — ' + m.refused.reason;
    }
  }

  // A comparison of runs (the recovery benchmark): steps over wall time and loss per run, a row per run.
  function renderCompare(runs) {
    for (const id of ['summary', 'members-section', 'chart-speed', 'chart-world']) {
      const node = $(id);
      (node.tagName === 'DIV' && node.classList.contains('chart') ? node.parentNode : node).hidden = true;
    }
    $('policy').parentNode.hidden = true;
    $('compare-figure').hidden = false;
    $('compare-figure').append($('markers'));  // the world chart is hidden in a comparison
    $('runs-section').hidden = false;
    for (const th of document.querySelectorAll('.run-column')) th.hidden = false;
    const names = runs.map((r) => r.name);
    const timeline = [];
    runs.forEach((r, i) => {
      for (const [t, step] of r.model.stepEvents) {
        const row = new Array(runs.length + 1).fill(null);
        row[0] = t;
        row[i + 1] = step;
        timeline.push(row);
      }
    });
    timeline.sort((a, b) => a[0] - b[0]);
    chart('compare', timeline, { labels: ['t'].concat(names), connectSeparatedPoints: true, strokeWidth: 2,
                                 xlabel: 'seconds since the run started', ylabel: 'step completed' });
    const allSteps = new Set();
    runs.forEach((r) => r.model.steps.forEach((_, s) => allSteps.add(s)));
    const losses = Array.from(allSteps).sort((a, b) => a - b).map((s) =>
      [s].concat(runs.map((r) => (r.model.steps.has(s) ? r.model.steps.get(s).loss : null))));
    chart('loss', losses, { labels: ['step'].concat(names), connectSeparatedPoints: true });
    const markers = [], rows = [], lines = [], runRows = [];
    for (const r of runs) {
      const m = r.model;
      const recs = Array.from(m.recoveries.values()).filter((x) => x.end).sort((a, b) => a.id - b.id);
      const part = recoveryRows(m, recs, r.name);
      markers.push(...part.markers); rows.push(...part.rows); lines.push(...part.lines);
      const wall = m.start !== null && m.last !== null ? (m.last - m.start) / 1e6 : 0;
      const goodput = m.goodput(recs);
      const faults = recs.filter((x) => x.end.kind !== 'resize' && typeof x.end.time_lost_ms === 'number');
      const downtimes = recs.filter((x) => x.end.kind !== 'resize' && typeof x.end.downtime_ms === 'number').map((x) => x.end.downtime_ms);
      runRows.push(el('tr', { 'data-run': r.name },
        el('td', {}, r.name), el('td', { class: 'num' }, m.end ? m.end.exit_code : '–'), el('td', { class: 'num' }, wall.toFixed(1)),
        el('td', { class: 'num' }, m.stepEvents.length), el('td', { class: 'num' }, m.steps.size),
        el('td', { class: 'num' }, recs.filter((x) => x.end.kind !== 'resize').length),
        el('td', { class: 'num time-lost' }, faults.length ? fmtMs(timeLostMs(faults) / faults.length) : '–'),
        el('td', { class: 'num' }, downtimes.length ? fmtMs(downtimes.reduce((a, b) => a + b, 0) / downtimes.length) : '–'),
        el('td', { class: 'num' }, recs.reduce((n, x) => n + (x.end.lost_steps || 0), 0)),
        el('td', { class: 'num' }, goodput !== null ? (goodput * 100).toFixed(1) + ' %' : '–')));
    }
    $('markers').replaceChildren(...markers);
    $('recoveries').tBodies[0].replaceChildren(...rows);
    $('fault-lines').replaceChildren(...lines);
    $('no-recoveries').hidden = rows.length > 0;
    $('runs').tBodies[0].replaceChildren(...runRows);
    $('phase').textContent = runs.length + ' runs';
  }

  // ---- the three modes ----
  if (config.mode === 'compare') {
    document.title = 'nonstop: ' + (config.title || 'runs');
    $('title').textContent = 'nonstop: ' + (config.title || 'runs');
    const runs = (config.runs || []).map((r) => {
      const model = new Model();
      for (const rec of r.journal || []) model.add(rec);
      return { name: r.name, model: model };
    });
    renderCompare(runs);
    return;
  }
  const model = new Model();
  if (config.mode === 'report') {
    document.title = 'nonstop report: ' + (config.title || 'job');
    $('title').textContent = 'nonstop report: ' + (config.title || 'job');
    $('note').textContent = config.note || '';
    for (const r of config.journal || []) model.add(r);
    render(model, null);
    return;
  }

  // The token rides in the fragment, which the browser never sends; every data request carries it
  // (off loopback the endpoint asks for it on /status and /metrics too).
  const token = new URLSearchParams(location.hash.slice(1)).get('token');
  const auth = token ? { Authorization: 'Bearer ' + token } : {};
  const tokenNote = 'The job\'s data needs the job token: open the address `nonstop run` printed (…/#token=…), or add #token=… from the job token file (runs/job.token).';
  let offset = 0, status = null, failures = 0;
  async function poll() {
    let more = false;
    try {
      const ev = await fetch('/events?offset=' + offset, { cache: 'no-store', headers: auth });
      let refused = ev.status === 401;
      if (ev.ok) {
        const text = await ev.text();
        const next = Number(ev.headers.get('X-Next-Offset'));
        const size = Number(ev.headers.get('X-Journal-Size'));
        for (const line of text.split('\n')) {
          if (!line) continue;
          try { model.add(JSON.parse(line)); } catch (e) { pageError('a journal line is not JSON: ' + line.slice(0, 80)); }
        }
        if (isFinite(next)) offset = next;
        more = isFinite(size) && offset < size;  // the server sends at most a few MiB at once
      }
      const st = await fetch('/status', { cache: 'no-store', headers: auth });
      if (st.ok) status = await st.json();
      refused = refused || st.status === 401;
      failures = 0;
      $('note').textContent = refused ? tokenNote : '';
    } catch (e) {
      failures++;
      $('note').textContent = model.end ? 'The job ended; its controller no longer answers.'
                                        : 'The controller does not answer (' + failures + ' tries); trying again.';
    } finally {
      try {
        render(model, status);
      } finally {
        // A job that ended and whose controller is gone has nothing more to say.
        if (!(model.end && failures >= 3)) setTimeout(poll, more ? 0 : Math.min(1000 * (1 + failures), 5000));
      }
    }
  }
  poll();
})();
