// SameGame (tiles/match): click a group of 2+ touching tiles of one colour to clear it,
// (n-1)^2 points; tiles fall down, empty columns close to the left. Ends when no group is left.
(function () {
  const N = 8, S = 20, COLORS = ['#d33', '#36c', '#2a5'];
  function group(g, r, c) {
    const v = g[r][c], out = [], seen = new Set([r * N + c]), todo = [[r, c]];
    while (todo.length) {
      const [a, b] = todo.pop(); out.push([a, b]);
      for (const [da, db] of [[1, 0], [-1, 0], [0, 1], [0, -1]]) {
        const x = a + da, y = b + db;
        if (x >= 0 && x < N && y >= 0 && y < N && g[x][y] === v && !seen.has(x * N + y)) { seen.add(x * N + y); todo.push([x, y]); }
      }
    }
    return out;
  }
  function anyGroup(g) {
    for (let r = 0; r < N; r++) for (let c = 0; c < N; c++)
      if (g[r][c] >= 0 && ((r + 1 < N && g[r + 1][c] === g[r][c]) || (c + 1 < N && g[r][c + 1] === g[r][c]))) return true;
    return false;
  }
  GAME.define({
    name: 'same-game', version: '1.0.0', timeLimitMs: 60000,
    instruction: 'Click groups of 2+ same-coloured tiles to clear them. Bigger groups score more.',
    init(st) { st.grid = Array.from({length: N}, () => Array.from({length: N}, () => GAME.randint(st, COLORS.length))); },
    click(st, x, y) {
      const [r, c] = GAME.cell(N, x, y), g = st.grid;
      if (g[r][c] < 0) return;
      const grp = group(g, r, c);
      if (grp.length < 2) return;
      for (const [a, b] of grp) g[a][b] = -1;
      st.score += (grp.length - 1) ** 2;
      const cols = [];
      for (let b = 0; b < N; b++) {  // gravity: a column's tiles sink, empty columns are dropped
        const col = []; for (let a = N - 1; a >= 0; a--) if (g[a][b] >= 0) col.push(g[a][b]);
        if (col.length) cols.push(col);
      }
      for (let a = 0; a < N; a++) for (let b = 0; b < N; b++) { const col = cols[b]; g[a][b] = col && N - 1 - a < col.length ? col[N - 1 - a] : -1; }
      if (!anyGroup(g)) GAME.end(st, g.every((row) => row.every((v) => v < 0)), 'no groups left');
    },
    render(c, st) {
      st.grid.forEach((row, r) => row.forEach((v, col) => {
        if (v >= 0) { c.fillStyle = COLORS[v]; c.fillRect(col * S + 1, r * S + 1, S - 2, S - 2); }
      }));
    },
  });
})();
