// Yarn untangle (planarity): drag the knots until no two threads cross.
(function () {
  const R = 7;
  function cross(p, q, r, s) {  // proper intersection of segments pq and rs
    const o = (a, b, c) => Math.sign((b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0]));
    return o(p, q, r) * o(p, q, s) < 0 && o(r, s, p) * o(r, s, q) < 0;
  }
  function crossings(st) {
    let n = 0;
    st.edges.forEach(([a, b], i) => st.edges.slice(i + 1).forEach(([c, d]) => {
      if (a !== c && a !== d && b !== c && b !== d && cross(st.pos[a], st.pos[b], st.pos[c], st.pos[d])) n++;
    }));
    return n;
  }
  GAME.define({
    name: 'yarn-untangle', version: '1.0.0', timeLimitMs: 40000,
    instruction: 'Drag the knots so that no two threads cross.',
    init(st) {
      // A hexagon with two non-crossing chords is planar; its corners are the solution, knots start elsewhere.
      const o = GAME.randint(st, 6);
      st.edges = [0, 1, 2, 3, 4, 5].map((i) => [i, (i + 1) % 6]).concat([[o, (o + 2) % 6], [o, (o + 3) % 6]]);
      st.solution = [0, 1, 2, 3, 4, 5].map((i) => [Math.round(80 + 60 * Math.cos(i * Math.PI / 3)), Math.round(80 + 60 * Math.sin(i * Math.PI / 3))]);
      do {
        st.pos = [];
        while (st.pos.length < 6) {
          const p = [12 + GAME.randint(st, 137), 12 + GAME.randint(st, 137)];
          if (st.pos.concat(st.solution).every((q) => Math.hypot(p[0] - q[0], p[1] - q[1]) >= 22)) st.pos.push(p);
        }
      } while (crossings(st) === 0);
      st.crossings = crossings(st);
    },
    drag(st, x0, y0, x1, y1) {
      let best = -1, bd = R + 3;
      st.pos.forEach(([x, y], i) => { const d = Math.hypot(x - x0, y - y0); if (d <= bd) { bd = d; best = i; } });
      if (best < 0) return;
      st.pos[best] = [Math.round(Math.min(152, Math.max(8, x1))), Math.round(Math.min(152, Math.max(8, y1)))];
      st.crossings = crossings(st);
      if (!st.crossings) { st.score = 1; GAME.end(st, true, 'untangled'); }
    },
    render(c, st) {
      c.lineWidth = 2;
      for (const [a, b] of st.edges) { c.strokeStyle = '#b45'; c.beginPath(); c.moveTo(...st.pos[a]); c.lineTo(...st.pos[b]); c.stroke(); }
      c.lineWidth = 1;
      for (const [x, y] of st.pos) { c.fillStyle = '#335'; c.beginPath(); c.arc(x, y, R, 0, 2 * Math.PI); c.fill(); }
    },
  });
})();
