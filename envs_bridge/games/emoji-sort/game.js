// Emoji sort (ball sort): click a tube, then another, to move its top item there (onto an empty
// tube or the same kind, at most 3 per tube). Score = tubes holding 3 of one kind. Items are drawn
// as coloured shapes (no emoji font is assumed on the machine).
(function () {
  const T = 5, CAP = 3, K = 3, W = 32;
  const key = (tubes) => tubes.map((t) => t.join('')).join('|');
  const full = (tubes) => tubes.filter((t) => t.length === CAP && t.every((v) => v === t[0])).length;
  function canMove(tubes, a, b) {
    const s = tubes[a], d = tubes[b];
    return a !== b && s.length > 0 && d.length < CAP && (!d.length || d[d.length - 1] === s[s.length - 1]);
  }
  function solvable(start) {  // BFS over tube contents (a few thousand states at most)
    const seen = new Set([key(start)]), todo = [start];
    while (todo.length) {
      const t = todo.shift();
      if (full(t) === K) return true;
      for (let a = 0; a < T; a++) for (let b = 0; b < T; b++) if (canMove(t, a, b)) {
        const n = t.map((x) => x.slice()); n[b].push(n[a].pop());
        const k = key(n); if (!seen.has(k)) { seen.add(k); todo.push(n); }
      }
    }
    return false;
  }
  GAME.define({
    name: 'emoji-sort', version: '1.0.0', timeLimitMs: 60000,
    instruction: 'Click a tube, then another, to move the top item. Sort each kind into its own tube.',
    init(st) {
      do {
        const items = GAME.shuffle(st, [0, 0, 0, 1, 1, 1, 2, 2, 2]);
        st.tubes = [items.slice(0, 3), items.slice(3, 6), items.slice(6, 9), [], []];
      } while (full(st.tubes) > 0 || !solvable(st.tubes));
      st.selected = -1;
    },
    click(st, x) {
      const i = Math.floor(x / W);
      if (st.selected < 0) { if (!st.tubes[i].length) return; st.selected = i; return; }
      const a = st.selected; st.selected = -1;
      if (!canMove(st.tubes, a, i)) return;
      st.tubes[i].push(st.tubes[a].pop());
      st.score = full(st.tubes);
      if (st.score === K) GAME.end(st, true, 'all sorted');
    },
    render(c, st) {
      const COL = ['#e33', '#27d', '#2a4'];
      st.tubes.forEach((t, i) => {
        const x = i * W;
        c.strokeStyle = i === st.selected ? '#f90' : '#777'; c.lineWidth = i === st.selected ? 3 : 2;
        c.strokeRect(x + 4, 30, W - 8, 110); c.lineWidth = 1;
        t.forEach((v, j) => {
          const cx = x + W / 2, cy = 122 - j * 34;
          c.fillStyle = COL[v]; c.beginPath();
          if (v === 0) c.arc(cx, cy, 10, 0, 2 * Math.PI);
          else if (v === 1) c.rect(cx - 9, cy - 9, 18, 18);
          else { c.moveTo(cx, cy - 11); c.lineTo(cx + 11, cy + 9); c.lineTo(cx - 11, cy + 9); c.closePath(); }
          c.fill();
        });
      });
    },
  });
})();
