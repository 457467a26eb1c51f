// Infinity Loop: click a tile to rotate it a quarter turn clockwise until every pipe end meets another.
(function () {
  const N = 4, S = 40;
  // mask bits: 1 = up, 2 = right, 4 = down, 8 = left
  const rot = (m) => ((m << 1) | (m >> 3)) & 15;
  const NB = [[-1, 0, 1, 4], [0, 1, 2, 8], [1, 0, 4, 1], [0, -1, 8, 2]];
  function solved(g) {
    for (let r = 0; r < N; r++) for (let c = 0; c < N; c++) for (const [dr, dc, b, back] of NB) {
      if (!(g[r][c] & b)) continue;
      const a = r + dr, d = c + dc;
      if (a < 0 || a >= N || d < 0 || d >= N || !(g[a][d] & back)) return false;
    }
    return true;
  }
  GAME.define({
    name: 'infinity-loop', version: '1.0.0', timeLimitMs: 90000,
    instruction: 'Click tiles to rotate them until every pipe is connected.',
    init(st) {
      // A random spanning tree of the grid (randomized DFS) is the solved picture; tiles are then turned.
      const g = Array.from({length: N}, () => Array(N).fill(0));
      const seen = new Set([0]), stack = [[0, 0]];
      while (stack.length) {
        const [r, c] = stack[stack.length - 1];
        const opts = NB.filter(([dr, dc]) => { const a = r + dr, d = c + dc; return a >= 0 && a < N && d >= 0 && d < N && !seen.has(a * N + d); });
        if (!opts.length) { stack.pop(); continue; }
        const [dr, dc, b, back] = opts[GAME.randint(st, opts.length)];
        g[r][c] |= b; g[r + dr][c + dc] |= back; seen.add((r + dr) * N + c + dc); stack.push([r + dr, c + dc]);
      }
      st.solution = g.map((row) => row.slice());
      st.grid = g.map((row) => row.map((m) => { let k = GAME.randint(st, 4); while (k--) m = rot(m); return m; }));
      if (solved(st.grid)) st.grid[0][0] = rot(st.grid[0][0]);
    },
    click(st, x, y) {
      const [r, c] = GAME.cell(N, x, y);
      st.grid[r][c] = rot(st.grid[r][c]);
      if (solved(st.grid)) { st.score = 1; GAME.end(st, true, 'all connected'); }
    },
    render(c, st) {
      c.strokeStyle = '#234'; c.lineWidth = 7; c.lineCap = 'round';
      st.grid.forEach((row, r) => row.forEach((m, col) => {
        const x = col * S + S / 2, y = r * S + S / 2;
        c.beginPath();
        for (const [dr, dc, b] of NB) if (m & b) { c.moveTo(x, y); c.lineTo(x + dc * S / 2, y + dr * S / 2); }
        c.stroke();
        if ([1, 2, 4, 8].includes(m)) { c.fillStyle = '#234'; c.beginPath(); c.arc(x, y, 7, 0, 2 * Math.PI); c.fill(); }
      }));
      c.lineWidth = 1; c.lineCap = 'butt';
    },
  });
})();
