// Shapes: click every shape of the asked colour and kind (+1 each); a wrong shape costs a life.
(function () {
  const COLORS = ['red', 'green', 'blue'], HEX = {red: '#d22', green: '#1a1', blue: '#23c'};
  const KINDS = ['circle', 'square', 'triangle'], SLOT = 40;
  GAME.define({
    name: 'shapes', version: '1.0.0', timeLimitMs: 30000, lives: 3,
    instruction: (st) => `Click every ${st.target.color} ${st.target.kind}.`,
    init(st) {
      const slots = GAME.shuffle(st, [...Array(16).keys()]).slice(0, 9);
      st.target = {color: COLORS[GAME.randint(st, 3)], kind: KINDS[GAME.randint(st, 3)]};
      st.shapes = slots.map((k) => ({r: Math.floor(k / 4), c: k % 4, color: COLORS[GAME.randint(st, 3)], kind: KINDS[GAME.randint(st, 3)], gone: false}));
      const isT = (s) => s.color === st.target.color && s.kind === st.target.kind;
      for (const s of st.shapes) {  // at least two targets
        if (st.shapes.filter(isT).length >= 2) break;
        if (!isT(s)) { s.color = st.target.color; s.kind = st.target.kind; }
      }
      st.left = st.shapes.filter((s) => s.color === st.target.color && s.kind === st.target.kind).length;
    },
    click(st, x, y) {
      const [r, c] = GAME.cell(4, x, y);
      const s = st.shapes.find((q) => q.r === r && q.c === c && !q.gone);
      if (!s) return;
      s.gone = true;
      if (s.color === st.target.color && s.kind === st.target.kind) {
        st.score += 1; st.left -= 1;
        if (!st.left) GAME.end(st, true, 'all found');
      } else {
        st.lives -= 1;
        if (st.lives <= 0) GAME.end(st, false, 'no lives left');
      }
    },
    render(c, st) {
      for (const s of st.shapes) {
        if (s.gone) continue;
        const x = s.c * SLOT + SLOT / 2, y = s.r * SLOT + SLOT / 2;
        c.fillStyle = HEX[s.color]; c.beginPath();
        if (s.kind === 'circle') c.arc(x, y, 13, 0, 2 * Math.PI);
        else if (s.kind === 'square') c.rect(x - 12, y - 12, 24, 24);
        else { c.moveTo(x, y - 14); c.lineTo(x + 14, y + 11); c.lineTo(x - 14, y + 11); c.closePath(); }
        c.fill();
      }
    },
  });
})();
