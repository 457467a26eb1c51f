// Laser maze: click mirrors to flip them (/ <-> \) until the laser from the left reaches the green target.
(function () {
  const N = 5, S = 32;
  // mirror 0 = '/', 1 = '\'; a beam going (dr, dc) leaves '/' as (-dc, -dr) and '\' as (dc, dr).
  const reflect = (m, [dr, dc]) => (m === 0 ? [-dc, -dr] : [dc, dr]);
  function trace(st) {
    let [r, c] = [st.source, -1], d = [0, 1];
    const pts = [[r, c]];
    for (let i = 0; i < 4 * N * N; i++) {
      r += d[0]; c += d[1];
      if (r < 0 || r >= N || c < 0 || c >= N) { pts.push([r, c]); return {hit: false, pts}; }
      if (r === st.target[0] && c === st.target[1]) { pts.push([r, c]); return {hit: true, pts}; }
      const m = st.mirrors.find((q) => q.r === r && q.c === c);
      if (m) { pts.push([r, c]); d = reflect(m.m, d); }
    }
    return {hit: false, pts};
  }
  GAME.define({
    name: 'laser-maze', version: '1.0.0', timeLimitMs: 40000,
    instruction: 'Click mirrors to flip them so the red laser reaches the green target.',
    init(st) {
      for (;;) {  // a random non-crossing beam path with 2-3 turns; mirrors at the turns
        st.source = GAME.randint(st, N);
        let [r, c] = [st.source, -1], d = [0, 1], ok = true;
        const seen = new Set(), mirrors = [], turns = 2 + GAME.randint(st, 2);
        for (let t = 0; t <= turns && ok; t++) {
          const k = 1 + GAME.randint(st, 3);
          for (let i = 0; i < k; i++) {
            r += d[0]; c += d[1];
            if (r < 0 || r >= N || c < 0 || c >= N || seen.has(r * N + c)) { ok = false; break; }
            seen.add(r * N + c);
          }
          if (!ok) break;
          if (t < turns) {
            const nd = GAME.rand(st) < 0.5 ? [d[1], d[0]] : [-d[1], -d[0]];
            mirrors.push({r, c, m: nd[0] === -d[1] && nd[1] === -d[0] ? 0 : 1, path: true});
            d = nd;
          } else st.target = [r, c];
        }
        if (!ok) continue;
        const free = [...Array(N * N).keys()].filter((k) => !seen.has(k));
        for (const k of GAME.shuffle(st, free).slice(0, 3)) mirrors.push({r: Math.floor(k / N), c: k % N, m: GAME.randint(st, 2), path: false});
        st.solution = mirrors.map((q) => q.m);
        for (const q of mirrors) q.m = GAME.randint(st, 2);
        st.mirrors = mirrors.map(({r, c, m}) => ({r, c, m}));
        if (trace(st).hit) st.mirrors[0].m ^= 1;
        return;
      }
    },
    click(st, x, y) {
      const [r, c] = GAME.cell(N, x, y);
      const m = st.mirrors.find((q) => q.r === r && q.c === c);
      if (!m) return;
      m.m ^= 1;
      if (trace(st).hit) { st.score = 1; GAME.end(st, true, 'target hit'); }
    },
    render(c, st) {
      c.strokeStyle = '#ddd8cc';
      for (let i = 1; i < N; i++) { c.beginPath(); c.moveTo(i * S, 0); c.lineTo(i * S, 160); c.moveTo(0, i * S); c.lineTo(160, i * S); c.stroke(); }
      const [tr, tc] = st.target;
      c.fillStyle = '#2b2'; c.beginPath(); c.arc(tc * S + 16, tr * S + 16, 10, 0, 2 * Math.PI); c.fill();
      c.fillStyle = '#c00'; c.fillRect(0, st.source * S + 10, 6, 12);
      c.strokeStyle = '#333'; c.lineWidth = 4;
      for (const q of st.mirrors) {
        const x = q.c * S, y = q.r * S; c.beginPath();
        if (q.m === 0) { c.moveTo(x + 5, y + S - 5); c.lineTo(x + S - 5, y + 5); } else { c.moveTo(x + 5, y + 5); c.lineTo(x + S - 5, y + S - 5); }
        c.stroke();
      }
      const {pts} = trace(st);
      c.strokeStyle = '#f22'; c.lineWidth = 2; c.beginPath();
      pts.forEach(([r, col], i) => { const x = Math.min(160, Math.max(0, col * S + 16)), y = r * S + 16; if (i) c.lineTo(x, y); else c.moveTo(0, y); });
      c.stroke(); c.lineWidth = 1;
    },
  });
})();
