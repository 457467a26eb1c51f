// Sokoban: push every box (brown) onto a goal (green ring) with the arrow keys; score = boxes on goals.
(function () {
  // Small hand-made levels ('#' wall, '.' goal, '$' box, '@' player); the seed picks one and a mirror.
  const LEVELS = [
    ['########', '#      #', '# .$   #', '#   @  #', '#  $.  #', '#      #', '#      #', '########'],
    ['########', '###   ##', '#.$ # ##', '#  $@  #', '#.  #  #', '##     #', '###    #', '########'],
    ['########', '#  #   #', '#  $ . #', '## # # #', '#  @   #', '# $  ###', '#   . ##', '########'],
    ['########', '#.   ###', '# ## ###', '#  $   #', '# @ $# #', '###  . #', '###    #', '########'],
  ];
  const N = 8, S = 20;
  const DIRS = {ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1]};
  const onGoal = (st) => st.boxes.filter(([r, c]) => st.goals.some(([a, b]) => a === r && b === c)).length;
  GAME.define({
    name: 'sokoban', version: '1.0.0', timeLimitMs: 60000,
    instruction: 'Push every brown box onto a green goal with the arrow keys.',
    init(st) {
      st.levelIndex = st.seed % LEVELS.length;
      const mirror = (st.seed >> 2) & 1;
      const rows = LEVELS[st.levelIndex].map((row) => (mirror ? [...row].reverse().join('') : row));
      st.walls = []; st.goals = []; st.boxes = [];
      rows.forEach((row, r) => [...row].forEach((ch, c) => {
        if (ch === '#') st.walls.push([r, c]);
        if (ch === '.') st.goals.push([r, c]);
        if (ch === '$') st.boxes.push([r, c]);
        if (ch === '@') st.player = [r, c];
      }));
    },
    key(st, k) {
      const d = DIRS[k];
      if (!d) return false;
      const at = (list, r, c) => list.findIndex(([a, b]) => a === r && b === c);
      const r = st.player[0] + d[0], c = st.player[1] + d[1];
      if (at(st.walls, r, c) >= 0) return;
      const bi = at(st.boxes, r, c);
      if (bi >= 0) {
        const r2 = r + d[0], c2 = c + d[1];
        if (at(st.walls, r2, c2) >= 0 || at(st.boxes, r2, c2) >= 0) return;
        st.boxes[bi] = [r2, c2];
      }
      st.player = [r, c];
      st.score = onGoal(st);
      if (st.score === st.boxes.length) GAME.end(st, true, 'all boxes on goals');
    },
    render(c, st) {
      c.fillStyle = '#555'; for (const [r, col] of st.walls) c.fillRect(col * S, r * S, S, S);
      c.strokeStyle = '#2a2'; c.lineWidth = 3;
      for (const [r, col] of st.goals) { c.beginPath(); c.arc(col * S + 10, r * S + 10, 6, 0, 2 * Math.PI); c.stroke(); }
      c.lineWidth = 1;
      for (const [r, col] of st.boxes) { c.fillStyle = '#a66b2a'; c.fillRect(col * S + 3, r * S + 3, S - 6, S - 6); }
      c.fillStyle = '#25d'; c.beginPath(); c.arc(st.player[1] * S + 10, st.player[0] * S + 10, 7, 0, 2 * Math.PI); c.fill();
    },
  });
})();
