// Snake: arrows steer; one cell per second of virtual time; food +1; a crash costs a life.
(function () {
  const N = 10, S = 16, PERIOD = 1000;
  const DIRS = {ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1]};
  function spawn(st) {
    st.body = [[5, 4], [5, 3], [5, 2]];  // head first, moving right
    st.dir = [0, 1]; st.next = [0, 1];
  }
  function placeFood(st) {
    const free = [];
    for (let r = 0; r < N; r++) for (let c = 0; c < N; c++)
      if (!st.body.some(([br, bc]) => br === r && bc === c)) free.push([r, c]);
    st.food = free[GAME.randint(st, free.length)];
  }
  GAME.define({
    name: 'snake', version: '1.0.0', timeLimitMs: 60000, lives: 3,
    instruction: 'Steer the snake with the arrow keys and eat the red food.',
    init(st) { st.acc = 0; spawn(st); placeFood(st); },
    key(st, k) {
      const d = DIRS[k];
      if (!d) return false;
      if (d[0] === -st.dir[0] && d[1] === -st.dir[1]) return false;  // no reversing into yourself
      st.next = d;
    },
    tick(st, dt) {
      st.acc += dt;
      if (st.acc < PERIOD) return;
      st.acc -= PERIOD;
      st.dir = st.next;
      const [hr, hc] = st.body[0], h = [hr + st.dir[0], hc + st.dir[1]];
      const eats = h[0] === st.food[0] && h[1] === st.food[1];
      const body = eats ? st.body : st.body.slice(0, -1);
      if (h[0] < 0 || h[0] >= N || h[1] < 0 || h[1] >= N || body.some(([r, c]) => r === h[0] && c === h[1])) {
        st.lives -= 1;
        if (st.lives <= 0) { GAME.end(st, false, 'no lives left'); return; }
        spawn(st);
        if (st.body.some(([r, c]) => r === st.food[0] && c === st.food[1])) placeFood(st);
        return;
      }
      st.body = [h, ...body];
      if (eats) { st.score += 1; st.level = 1 + Math.floor(st.score / 5); placeFood(st); }
    },
    render(c, st) {
      c.strokeStyle = '#e3dfd3';
      for (let i = 0; i <= N; i++) { c.beginPath(); c.moveTo(i * S, 0); c.lineTo(i * S, 160); c.moveTo(0, i * S); c.lineTo(160, i * S); c.stroke(); }
      c.fillStyle = '#d22'; c.beginPath(); c.arc(st.food[1] * S + 8, st.food[0] * S + 8, 6, 0, 2 * Math.PI); c.fill();
      st.body.forEach(([r, col], i) => { c.fillStyle = i ? '#2a7' : '#064'; c.fillRect(col * S + 1, r * S + 1, S - 2, S - 2); });
    },
  });
})();
