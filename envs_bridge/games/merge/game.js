// Merge: drag a number onto an equal number to merge them (value doubles, +new value points);
// after each merge a 2 or 4 appears in an empty cell. Ends when no two equal numbers remain.
(function () {
  const N = 4, S = 40, COL = {2: '#eee4da', 4: '#ede0c8', 8: '#f2b179', 16: '#f59563', 32: '#f67c5f', 64: '#f65e3b'};
  function spawn(st) {
    const free = [];
    st.grid.forEach((row, r) => row.forEach((v, c) => { if (!v) free.push([r, c]); }));
    if (!free.length) return;
    const [r, c] = free[GAME.randint(st, free.length)];
    st.grid[r][c] = GAME.rand(st) < 0.75 ? 2 : 4;
  }
  function hasPair(g) {
    const seen = new Set();
    for (const row of g) for (const v of row) if (v) { if (seen.has(v)) return true; seen.add(v); }
    return false;
  }
  GAME.define({
    name: 'merge', version: '1.0.0', timeLimitMs: 60000,
    instruction: 'Drag a number onto an equal number to merge them.',
    init(st) {
      st.grid = Array.from({length: N}, () => Array(N).fill(0));
      for (let i = 0; i < 8; i++) spawn(st);
      if (!hasPair(st.grid)) st.grid[0][0] = st.grid[0][1] = 2;
    },
    drag(st, x0, y0, x1, y1) {
      if (y1 < 0 || y1 >= 160 || x1 < 0 || x1 >= 160) return;
      const [r0, c0] = GAME.cell(N, x0, y0), [r1, c1] = GAME.cell(N, x1, y1), g = st.grid;
      if ((r0 === r1 && c0 === c1) || !g[r0][c0] || g[r0][c0] !== g[r1][c1]) return;  // no merge: a wasted move
      g[r1][c1] *= 2; g[r0][c0] = 0; st.score += g[r1][c1];
      st.level = Math.max(1, Math.log2(Math.max(...g.flat())) - 1);
      spawn(st);
      if (!hasPair(g)) GAME.end(st, false, 'no equal numbers left');
    },
    render(c, st) {
      c.textAlign = 'center'; c.textBaseline = 'middle'; c.font = 'bold 15px sans-serif';
      st.grid.forEach((row, r) => row.forEach((v, col) => {
        c.fillStyle = v ? (COL[v] || '#edc22e') : '#cdc1b4'; c.fillRect(col * S + 2, r * S + 2, S - 4, S - 4);
        if (v) { c.fillStyle = v > 4 ? '#fff' : '#776e65'; c.fillText(String(v), col * S + S / 2, r * S + S / 2 + 1); }
      }));
    },
  });
})();
