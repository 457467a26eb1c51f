r"""Can the policy learn to point? Supervised clicks on synthetic click-test screens, no sandbox.

A fast diagnostic for the main job's model (issue #25): screens drawn with PIL like MiniWoB's
click-test (160 x 210, yellow instruction bar, one grey "Click Me!" button of 36-97 px at a random
place; `--contrast`: a black square instead), the reply `click(start_box='(x,y)')` at the button's
centre on the 'tens3' grid, cross-entropy on the reply (the pointing probe's loss), fresh screens
every update. Prints the held-out cross-entropy of the free coordinate digits (two per axis; the
third is forced) beside the marginal prior's (what a policy blind to the screen can reach) and the
image dependence of the decisions (`tars_jax.analysis.image_dependence`) before and after.

  python -m benchmarks.probes.pointing_synthetic --config experiments/configs/miniwob_ppo.py --steps 400
  python -m benchmarks.probes.pointing_synthetic --config experiments/configs/miniwob_ppo.py \
      --config.model.vision_depth=4 --short_prompt --contrast --lr 2e-3
"""

from __future__ import annotations

import collections
import time

from absl import app, flags
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image, ImageDraw

from tars_jax.agent import prompts
from tars_jax.agent.grammar import walk
from tars_jax.agent.images import preprocess
from tars_jax.agent.trajectory import Episode, Turn, collate
from tars_jax.analysis.image_dependence import format_row, image_dependence
from tars_jax.train import sft
from tars_jax.train.state import build

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config (its model, grammar, optimiser).")
_STEPS = flags.DEFINE_integer("steps", 400, "Updates.")
_BATCH = flags.DEFINE_integer("batch", 16, "Screens per update.")
_LR = flags.DEFINE_float("lr", None, "Learning rate (default: the config's rl.lr).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 50, "Updates between held-out evaluations.")
_CONTRAST = flags.DEFINE_bool("contrast", False, "Black squares instead of MiniWoB-like grey buttons.")
_SHORT = flags.DEFINE_bool("short_prompt", False, "No system prompt (fewer text tokens in the context).")

W, H, INSTRUCTION = 160, 210, "Click the button."


def screen(rng: np.random.Generator, contrast: bool) -> tuple[np.ndarray, tuple[int, int, int]]:
  """([210, 160, 3] uint8 screen, (x, y, side) of the button in pixels)."""
  img = Image.new("RGB", (W, H), "white")
  d = ImageDraw.Draw(img)
  d.rectangle([0, 0, W - 1, 49], fill=(255, 255, 0))
  d.text((3, 3), INSTRUCTION, fill="black")
  s = int(rng.integers(36, 98))
  x, y = int(rng.integers(0, W - s)), int(rng.integers(50, H - s))
  if contrast:
    d.rectangle([x, y, x + s, y + s], fill=(0, 0, 0))
  else:
    d.rectangle([x, y, x + s, y + s], fill=(238, 238, 238), outline=(120, 120, 120))
    d.text((x + s // 2 - 20, y + s // 2 - 5), "Click Me!", fill="black")
  return np.asarray(img), (x, y, s)


def coords(box) -> str:
  """The button centre on the 0-1000 grid as 'tens3' digits, e.g. '570,610'."""
  x, y, s = box
  cx, cy = (x + s / 2) / W * 1000, (y + s / 2) / H * 1000
  return f"{int(round(cx / 10)) * 10:03d},{int(round(cy / 10)) * 10:03d}"


def prior_ce(contrast: bool, n: int = 20_000) -> float:
  """Mean entropy (nats) of the marginal distribution of the 4 free digits: a screen-blind optimum."""
  rng = np.random.default_rng(1)
  counts = [collections.Counter() for _ in range(4)]
  for _ in range(n):
    c = coords(screen(rng, contrast)[1])
    for k, ch in enumerate(c[:2] + c[4:6]):
      counts[k][ch] += 1
  return float(np.mean([-sum(v / n * np.log(v / n) for v in c.values()) for c in counts]))


def batch_of(parts, recs, length_multiple: int) -> dict:
  tok = parts.tokenizer
  eps = []
  for img, box in recs:
    prefix = prompts.encode_episode_prefix(tok, INSTRUCTION, parts.loop_cfg.system)
    obs = prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None)
    rep = tok.encode(f"Thought: \nAction: click(start_box='({coords(box)})')") + [tok.eos_id]
    ep = Episode(task="synthetic/click-test", seed=0, instruction=INSTRUCTION, prefix_ids=prefix)
    ep.turns.append(Turn(image=preprocess(img, parts.image_hw), obs_ids=obs, reply_ids=rep,
                         logprobs=np.zeros(len(rep), np.float32), states=walk(parts.grammar, rep)))
    eps.append(ep)
  return collate(eps, pad_id=tok.pad_id, max_images=1, image_hw=parts.image_hw,
                 length_multiple=length_multiple, batch_size=len(eps)).as_dict()


def main(argv):
  del argv
  config = _CONFIG.value
  if _LR.value:
    config.rl.lr = _LR.value
  parts = build(config)
  if _SHORT.value:
    parts.loop_cfg.system = ""
  gd, table, hp = parts.policy_gd, parts.table, parts.hparams
  test = batch_of(parts, [screen(np.random.default_rng(10_000 + i), _CONTRAST.value) for i in range(128)],
                  config.length_multiple)
  state = parts.init_state(config.seed)
  params, opt = state["policy"], state["policy_opt"]
  digits = jnp.asarray([ord(c) for c in "0123456789"])

  def step(p, o, mb):  # the SFT update (train/sft.py) with the RL optimiser
    p, o, m = sft.train_step(p, o, mb, table, graphdef=gd, opt=parts.popt, inputs=parts.inputs,
                             aux_coef=hp.aux_loss_coef)
    return p, o, m["loss"]

  @jax.jit
  def digit_ce(p, mb):
    logp = sft.token_logp(p, mb, table, graphdef=gd, inputs=parts.inputs)[0]
    free = jnp.isin(mb["tokens"][:, 1:], digits) & (mb["loss_mask"] > 0) & (logp < -1e-6)
    return (-(logp * free).sum(-1) / free.sum(-1)).mean()

  def dependence(p):
    return format_row(image_dependence(gd, p, test, table, temperature=config.sampling.temperature,
                                       image_token_id=parts.inputs.image_token_id, grid_hw=parts.inputs.grid_hw))

  print(f"[pointing] prior CE {prior_ce(_CONTRAST.value):.3f} nats (uniform {np.log(10):.3f}); "
        f"at init: digit CE {float(digit_ce(params, test)):.3f} | {dependence(params)}", flush=True)
  rng, t0 = np.random.default_rng(config.seed), time.time()
  for s in range(1, _STEPS.value + 1):
    mb = batch_of(parts, [screen(rng, _CONTRAST.value) for _ in range(_BATCH.value)], config.length_multiple)
    params, opt, loss = step(params, opt, mb)
    if s % _EVAL_EVERY.value == 0 or s == _STEPS.value:
      print(f"[pointing] update {s}: train loss {float(loss):.3f}, held-out digit CE "
            f"{float(digit_ce(params, test)):.3f} ({time.time() - t0:.0f} s)", flush=True)
  print(f"[pointing] after {_STEPS.value} updates: {dependence(params)}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
