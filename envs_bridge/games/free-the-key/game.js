// Free the key: drag blocks along their own direction; slide the gold key (row 3) out to the right.
(function () {
  const N = 6, S = 160 / N;
  // Hand-made puzzles ('K' the key, other letters blocks, '.' empty); the seed picks one.
  const LEVELS = [
    ['..A...', '..A...', 'KKA...', '...BBB', '......', '......'],
    ['A..C..', 'A..C..', 'AKKC..', '..BBB.', 'D.....', 'D..EE.'],
    ['..ABB.', '..A...', 'KKA..C', '...D.C', '...D.C', '.EE...'],
    ['AAB...', '..B.C.', 'KKB.C.', '..DDC.', 'E.....', 'E.....'],
  ];
  const cells = (b) => Array.from({length: b.len}, (_, i) => (b.h ? [b.r, b.c + i] : [b.r + i, b.c]));
  const at = (st, r, c) => st.blocks.findIndex((b) => cells(b).some(([a, d]) => a === r && d === c));
  GAME.define({
    name: 'free-the-key', version: '1.0.0', timeLimitMs: 40000,
    instruction: 'Drag blocks along their length to clear a way, then slide the gold key out to the right.',
    init(st) {
      st.levelIndex = st.seed % LEVELS.length;
      const found = {};
      LEVELS[st.levelIndex].forEach((row, r) => [...row].forEach((ch, c) => { if (ch !== '.') (found[ch] = found[ch] || []).push([r, c]); }));
      st.blocks = Object.keys(found).sort().map((id) => {
        const cs = found[id];
        return {id, r: cs[0][0], c: cs[0][1], len: cs.length, h: cs[0][0] === cs[cs.length - 1][0]};
      });
    },
    drag(st, x0, y0, x1, y1) {
      const [r, c] = GAME.cell(N, x0, y0), i = at(st, r, c);
      if (i < 0) return;
      const b = st.blocks[i], want = Math.round((b.h ? x1 - x0 : y1 - y0) / S), step = Math.sign(want);
      let moved = 0;
      while (moved !== want) {  // slide cell by cell until blocked
        const n = {...b, r: b.r + (b.h ? 0 : step), c: b.c + (b.h ? step : 0)};
        if (cells(n).some(([a, d]) => a < 0 || a >= N || d < 0 || d >= N || (at(st, a, d) >= 0 && at(st, a, d) !== i))) break;
        b.r = n.r; b.c = n.c; moved += step;
      }
      if (b.id === 'K' && b.c + b.len === N) { st.score = 1; GAME.end(st, true, 'key freed'); }
    },
    render(c, st) {
      c.fillStyle = '#222'; c.fillRect(157, 2 * S + 4, 3, S - 8);  // the exit
      for (const b of st.blocks) {
        c.fillStyle = b.id === 'K' ? '#e5b800' : '#8a6d4b';
        c.fillRect(b.c * S + 3, b.r * S + 3, (b.h ? b.len : 1) * S - 6, (b.h ? 1 : b.len) * S - 6);
      }
    },
  });
})();
