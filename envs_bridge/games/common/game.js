// Shared runtime of the games written here: seeded PRNG, one clock-driven tick, input, status bar,
// and the explicit state interface the verifier reads (window.GAME).
//
// Page layout (160 x 210, like MiniWoB's #wrap): a 50 px bar (instruction + score/level/lives/time)
// over a 160 x 160 canvas. All game state is ONE JSON object `GAME.st` (the PRNG state included), so
// snapshot/restore is JSON and nothing depends on real time: the only timer is a setInterval that
// Playwright's page.clock drives (TICK_MS of virtual time per tick).
(function () {
  'use strict';
  const TICK_MS = 100;
  const AREA = 160, BAR = 50;

  // mulberry32: tiny seeded PRNG whose whole state is one uint32 (kept in st.rng).
  function rand(st) {
    let t = (st.rng = (st.rng + 0x6D2B79F5) >>> 0);
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }

  const G = {
    TICK_MS, AREA, BAR, def: null, st: null, ctx: null, timer: null, down: null,
    rand,
    randint(st, n) { return Math.floor(rand(st) * n); },
    shuffle(st, a) {
      for (let i = a.length - 1; i > 0; i--) { const j = G.randint(st, i + 1); [a[i], a[j]] = [a[j], a[i]]; }
      return a;
    },

    define(def) {
      G.def = def;
      document.body.innerHTML = '<div id="bar"><div id="instr"></div><div id="status"></div></div>' +
        '<canvas id="area" width="160" height="160"></canvas>';
      G.ctx = document.getElementById('area').getContext('2d');
      const cv = document.getElementById('area');
      const pos = (e) => { const r = cv.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; };
      cv.addEventListener('mousedown', (e) => { G.down = pos(e); e.preventDefault(); });
      document.addEventListener('mouseup', (e) => {
        if (!G.down) return;
        const [x0, y0] = G.down, [x1, y1] = pos(e);
        G.down = null;
        if (Math.hypot(x1 - x0, y1 - y0) < 4) G.input('click', x0, y0);
        else G.input('drag', x0, y0, x1, y1);
      });
      document.addEventListener('keydown', (e) => { G.input('key', e.key); e.preventDefault(); });
    },

    // (Re)starts an episode: same seed -> same initial state (the PRNG is the only randomness).
    start(seed) {
      const d = G.def;
      const st = {seed: seed >>> 0, rng: (seed ^ 0x9E3779B9) >>> 0, score: 0, level: 1, lives: d.lives || 1,
                  done: false, won: false, reason: null, elapsed: 0, moves: 0};
      d.init(st);
      G.st = st;
      if (G.timer === null) G.timer = setInterval(G.tick, TICK_MS);  // one interval per page, phase fixed
      G.render();
    },

    tick() {
      const st = G.st;
      if (!st || st.done) return;
      st.elapsed += TICK_MS;
      if (G.def.tick) G.def.tick(st, TICK_MS);
      if (!st.done && st.elapsed >= G.def.timeLimitMs) G.end(st, false, 'time limit');
      G.render();
    },

    input(kind, ...args) {
      const st = G.st;
      if (!st || st.done) return;
      const h = G.def[kind];
      if (!h) return;
      if (kind !== 'key' && (args[1] < 0 || args[1] >= AREA)) return;  // clicks on the bar do nothing
      if (h(st, ...args) !== false) st.moves += 1;
      G.render();
    },

    end(st, won, reason) { st.done = true; st.won = won; st.reason = reason; },

    render() {
      const st = G.st, d = G.def, c = G.ctx;
      c.fillStyle = d.background || '#f4f1ea';
      c.fillRect(0, 0, AREA, AREA);
      d.render(c, st);
      if (st.done) {
        c.fillStyle = 'rgba(0,0,0,0.55)'; c.fillRect(0, 62, AREA, 36);
        c.fillStyle = '#fff'; c.font = 'bold 14px sans-serif'; c.textAlign = 'center'; c.textBaseline = 'middle';
        c.fillText(st.won ? 'Solved!' : (st.reason === 'time limit' ? "Time's up" : 'Game over'), 80, 80);
      }
      document.getElementById('instr').textContent = G.instruction();
      const left = Math.max(0, Math.ceil((d.timeLimitMs - st.elapsed) / 1000));
      document.getElementById('status').textContent =
        `score ${st.score}  lvl ${st.level}  ♥${st.lives}  ${left}s`;
    },

    instruction() { const i = G.def.instruction; return typeof i === 'function' ? i(G.st) : i; },

    // The explicit state interface the verification script reads.
    record() {
      const st = G.st;
      return {game: G.def.name, version: G.def.version, seed: st.seed, score: st.score, level: st.level,
              lives: st.lives, done: st.done, won: st.won, reason: st.reason, elapsed_ms: st.elapsed,
              moves: st.moves};
    },
    debugState() { return JSON.parse(JSON.stringify(G.st)); },  // privileged: reference players, tests
    snapshot() { return JSON.stringify({game: G.def.name, version: G.def.version, st: G.st}); },
    // Parses and checks a snapshot string -> the episode state; throws a clear Error otherwise.
    load(snap) {
      const what = `GAME.restore (${G.def.name} ${G.def.version})`;
      let o;
      try { o = JSON.parse(snap); } catch (e) { throw new Error(`${what}: snapshot is not JSON`); }
      if (!o || o.game !== G.def.name || o.version !== G.def.version || !o.st || typeof o.st !== 'object')
        throw new Error(`${what}: not a snapshot of this game and version`);
      return o.st;
    },
    restore(snap) { G.st = G.load(snap); G.render(); },

    // grid helpers: cell size and the cell under a point of an n x n board
    cell(n, x, y) { const s = AREA / n; return [Math.floor(y / s), Math.floor(x / s)]; },
  };
  window.GAME = G;
})();
