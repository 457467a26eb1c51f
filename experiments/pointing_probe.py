r"""Supervised pointing probe: how fast does the demo's policy learn to point with *perfect* labels?

An upper bound on what the RL signal could teach per update (README, "Main job"; measured runs in
benchmarks/RESULTS.md): the same model, config and optimiser as
`experiments/configs/miniwob_ppo.py`, trained by cross-entropy on replies `click(start_box='(x,y)')`
whose (x, y) is the centre of the correct button, read from the DOM through the sandbox's debug
endpoint (never shown to agents). Prints the single-click hit rate of the policy's own sampled
clicks on 100 held-out screens per task at a few update counts.

  PYTHONPATH=. .venv/bin/python -m experiments.pointing_probe 1024 800   # N_TRAIN screens, updates
"""
import asyncio, sys, time, re
import numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
from experiments.configs.miniwob_ppo import get_config
from tars_jax.train.state import build
from tars_jax.train import ppo
from tars_jax.rl import losses
from tars_jax.agent import prompts
from tars_jax.agent.images import preprocess
from tars_jax.agent.grammar import walk
from tars_jax.agent.trajectory import Episode, Turn, collate
from envs_bridge.launch import launch_server
from envs_bridge.client import SandboxClient

N_TRAIN = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 800
cfg = get_config("")
parts = build(cfg)
tok = parts.tokenizer

async def collect(client, task, seeds):
  out = []
  sem = asyncio.Semaphore(16)
  async def one(seed):
    async with sem:
      sid, obs = await client.open(task, seed)
      instr = obs.info["instruction"]
      sel = "#subbtn"
      if task.endswith("click-test-2") and "TWO" in instr:
        sel = "#subbtn2"
      box = await client.element_box(sid, sel)
      await client.close(sid)
      return task, seed, instr, preprocess(obs.image(), parts.image_hw), box, obs.image().shape
  return await asyncio.gather(*[one(s) for s in seeds])

def target_text(box, shape):
  h, w = shape[:2]
  cx = (box["x"] + box["width"] / 2) / w * 1000
  cy = (box["y"] + box["height"] / 2) / h * 1000
  return f"Thought: \nAction: click(start_box='({int(round(cx/10))*10:03d},{int(round(cy/10))*10:03d})')"

def episode(rec, reply_text=None):
  task, seed, instr, img, box, shape = rec
  prefix = prompts.encode_episode_prefix(tok, instr, parts.loop_cfg.system)
  obs_ids = prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None)
  ep = Episode(task=task, seed=seed, instruction=instr, prefix_ids=prefix)
  if reply_text is not None:
    rep = tok.encode(reply_text) + [tok.eos_id]
    st = walk(parts.grammar, rep)
    assert (st >= 0).all(), reply_text
    ep.turns.append(Turn(image=img, obs_ids=obs_ids, reply_ids=rep, logprobs=np.zeros(len(rep), np.float32), states=st))
  return ep, prefix + obs_ids

def hit(text, box, shape):
  m = re.search(r"\((\d+),(\d+)\)", text)
  if not m: return False
  h, w = shape[:2]
  px, py = int(m.group(1)) / 1000 * w, int(m.group(2)) / 1000 * h
  return box["x"] <= px <= box["x"] + box["width"] and box["y"] <= py <= box["y"] + box["height"]

def main():
  server = launch_server(step_ms=1000, lease_s=600)
  client = SandboxClient(server.url)
  loop = asyncio.new_event_loop()
  t0 = time.time()
  train, test = [], []
  for task in cfg.tasks:
    train += loop.run_until_complete(collect(client, task, range(N_TRAIN // 2)))
    test += loop.run_until_complete(collect(client, task, range(10_000_000, 10_000_000 + 100)))
  print(f"collected {len(train)} train / {len(test)} test in {time.time()-t0:.0f}s", flush=True)
  loop.run_until_complete(client.aclose()); loop.close(); server.stop()

  state = parts.init_state(cfg.seed)
  params, opt_state = state["policy"], state["policy_opt"]
  gd, table, hp = parts.policy_gd, parts.table, parts.hparams
  eps = [episode(r, target_text(r[4], r[5]))[0] for r in train]

  def loss_fn(p, mb):
    policy = nnx.merge(gd, p)
    pos = ppo._positions(mb["tokens"], mb["attn_mask"], hp)
    logits, aux, _, _ = policy(mb["tokens"], pos, mb["attn_mask"], mb["pixel_values"], mb["image_mask"])
    logits = logits[:, :-1]
    mask = mb["loss_mask"]
    allowed = ppo._allowed(table, mb["states"], mask)
    logp_all = losses.masked_log_softmax(logits, allowed, 1.0)
    logp = jnp.take_along_axis(logp_all, mb["tokens"][:, 1:, None], axis=-1)[..., 0]
    return -(logp * mask).sum() / mask.sum() + 0.01 * aux

  @jax.jit
  def step(p, o, mb):
    l, g = jax.value_and_grad(loss_fn)(p, mb)
    u, o = parts.popt.update(g, o, p)
    return optax.apply_updates(p, u), o, l

  def evaluate(p):
    pol = parts.batched_policy(p, batch_size=32, seed=1)
    res = {}
    for task in cfg.tasks:
      recs = [r for r in test if r[0] == task]
      hits = 0
      for i in range(0, len(recs), 32):
        chunk = recs[i:i+32]
        pr = [episode(r)[1] for r in chunk]
        outs = pol.act(pr, [[r[3]] for r in chunk])
        hits += sum(hit(tok.decode(ids), r[4], r[5]) for (ids, _, _), r in zip(outs, chunk))
      res[task] = hits / len(recs)
    return res

  rng = np.random.default_rng(0)
  t0 = time.time()
  for s in range(1, STEPS + 1):
    idx = rng.choice(len(eps), 16, replace=False)
    b = collate([eps[i] for i in idx], pad_id=tok.pad_id, max_images=cfg.env.max_turns,
                image_hw=parts.image_hw, length_multiple=cfg.length_multiple, batch_size=16).as_dict()
    params, opt_state, l = step(params, opt_state, b)
    if s in (50, 100, 200, 400, 800, 1600) or s == STEPS:
      print(f"step {s} loss {float(l):.3f} t {time.time()-t0:.0f}s eval(sampled) {evaluate(params)}", flush=True)


if __name__ == "__main__":
  main()
