// Maze: walk from the blue square (top-left) to the green exit (bottom-right) with the arrow keys.
(function () {
  const N = 6, S = 160 / N;
  const DIRS = {ArrowUp: [-1, 0, 0], ArrowRight: [0, 1, 1], ArrowDown: [1, 0, 2], ArrowLeft: [0, -1, 3]};
  GAME.define({
    name: 'maze', version: '1.0.0', timeLimitMs: 60000,
    instruction: 'Move the blue square to the green exit with the arrow keys.',
    init(st) {
      // walls[r][c] = 4 bits (N, E, S, W) set where a wall stands; carved by randomized DFS.
      st.walls = Array.from({length: N}, () => Array(N).fill(15));
      const seen = Array.from({length: N}, () => Array(N).fill(false));
      const stack = [[0, 0]]; seen[0][0] = true;
      const steps = [[-1, 0, 0, 2], [0, 1, 1, 3], [1, 0, 2, 0], [0, -1, 3, 1]];
      while (stack.length) {
        const [r, c] = stack[stack.length - 1];
        const opts = steps.filter(([dr, dc]) => { const a = r + dr, b = c + dc; return a >= 0 && a < N && b >= 0 && b < N && !seen[a][b]; });
        if (!opts.length) { stack.pop(); continue; }
        const [dr, dc, w, back] = opts[GAME.randint(st, opts.length)];
        st.walls[r][c] &= ~(1 << w); st.walls[r + dr][c + dc] &= ~(1 << back);
        seen[r + dr][c + dc] = true; stack.push([r + dr, c + dc]);
      }
      st.pos = [0, 0]; st.exit = [N - 1, N - 1];
    },
    key(st, k) {
      const d = DIRS[k];
      if (!d) return false;
      const [r, c] = st.pos;
      if (st.walls[r][c] & (1 << d[2])) return;  // bumped into a wall: a move, no progress
      st.pos = [r + d[0], c + d[1]];
      if (st.pos[0] === st.exit[0] && st.pos[1] === st.exit[1]) { st.score = 1; GAME.end(st, true, 'reached the exit'); }
    },
    render(c, st) {
      c.fillStyle = '#3b3'; c.fillRect(st.exit[1] * S + 4, st.exit[0] * S + 4, S - 8, S - 8);
      c.fillStyle = '#25d'; c.fillRect(st.pos[1] * S + 6, st.pos[0] * S + 6, S - 12, S - 12);
      c.strokeStyle = '#333'; c.lineWidth = 2; c.beginPath();
      for (let r = 0; r < N; r++) for (let col = 0; col < N; col++) {
        const w = st.walls[r][col], x = col * S, y = r * S;
        if (w & 1) { c.moveTo(x, y); c.lineTo(x + S, y); }
        if (w & 2) { c.moveTo(x + S, y); c.lineTo(x + S, y + S); }
        if (w & 4) { c.moveTo(x, y + S); c.lineTo(x + S, y + S); }
        if (w & 8) { c.moveTo(x, y); c.lineTo(x, y + S); }
      }
      c.stroke(); c.lineWidth = 1;
    },
  });
})();
