// Lights Out: clicking a cell toggles it and its four neighbours; switch every light off.
(function () {
  const N = 5, S = 32;
  function press(g, r, c) {
    for (const [dr, dc] of [[0, 0], [1, 0], [-1, 0], [0, 1], [0, -1]]) {
      const a = r + dr, b = c + dc;
      if (a >= 0 && a < N && b >= 0 && b < N) g[a][b] ^= 1;
    }
  }
  GAME.define({
    name: 'lights-out', version: '1.0.0', timeLimitMs: 40000,
    instruction: 'Click lights to toggle them and their neighbours. Turn every light off.',
    init(st) {
      // Generated from the solved board by 3-5 distinct presses (their set is the privileged solution).
      st.grid = Array.from({length: N}, () => Array(N).fill(0));
      st.solution = GAME.shuffle(st, [...Array(N * N).keys()]).slice(0, 3 + GAME.randint(st, 3)).sort((a, b) => a - b);
      for (const k of st.solution) press(st.grid, Math.floor(k / N), k % N);
    },
    click(st, x, y) {
      const [r, c] = GAME.cell(N, x, y);
      press(st.grid, r, c);
      if (st.grid.every((row) => row.every((v) => !v))) { st.score = 1; GAME.end(st, true, 'all lights off'); }
    },
    render(c, st) {
      st.grid.forEach((row, r) => row.forEach((v, col) => {
        c.fillStyle = v ? '#fc3' : '#446'; c.fillRect(col * S + 2, r * S + 2, S - 4, S - 4);
      }));
    },
  });
})();
