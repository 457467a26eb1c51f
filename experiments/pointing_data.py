"""Screens and labels of the pointing probe (`experiments/pointing_probe.py`), flag-free so tests can
import them: collection from the real sandbox into an .npz, loading, the target reply and the hit test."""

from __future__ import annotations

import asyncio
import io
import re
import time

import numpy as np
from PIL import Image

from tars_jax.agent import prompts
from tars_jax.agent.images import preprocess

POINT = re.compile(r"click\(start_box='\((\d+),(\d+)\)'\)")
_SELECTORS = {"miniwob/click-test": ("#subbtn", None), "miniwob/click-test-2": ("#subbtn", "#subbtn2")}


async def _collect_task(client, task: str, seeds) -> list[dict]:
  sem = asyncio.Semaphore(16)

  async def one(seed):
    async with sem:
      sid, obs = await client.open(task, seed)
      try:
        instr = obs.info["instruction"]
        sel, other = _SELECTORS[task]
        if "TWO" in instr:  # click-test-2 names its button; the other one is the distractor
          sel, other = other, sel
        box = await client.element_box(sid, sel)
        obox = await client.element_box(sid, other) if other else None
      finally:
        await client.close(sid)
      buf = io.BytesIO()
      Image.fromarray(obs.image()[..., :3]).save(buf, format="PNG")
      return {"task": task, "seed": seed, "instruction": instr, "png": buf.getvalue(), "box": box,
              "other": obox}
  return list(await asyncio.gather(*[one(s) for s in seeds]))


def collect(path: str, tasks, n_train: int, n_test: int) -> None:
  """Writes `path` (.npz): per screen its task, split, instruction, PNG bytes and the target / other
  button boxes [x, y, w, h] in screenshot pixels (other = -1 where there is none)."""
  from envs_bridge.client import SandboxClient
  from envs_bridge.launch import launch_server
  server = launch_server(step_ms=1000, lease_s=600)
  recs, t0 = [], time.time()

  async def run():
    async with SandboxClient(server.url) as client:
      for task in tasks:
        for split, seeds in (("train", range(n_train)), ("test", range(10_000_000, 10_000_000 + n_test))):
          for r in await _collect_task(client, task, seeds):
            recs.append(dict(r, split=split))
  try:
    asyncio.run(run())
  finally:
    server.stop()
  box = lambda b: [b["x"], b["y"], b["width"], b["height"]] if b else [-1, -1, -1, -1]
  pngs = [r["png"] for r in recs]
  np.savez(path, task=np.array([r["task"] for r in recs]), split=np.array([r["split"] for r in recs]),
           seed=np.array([r["seed"] for r in recs]), instruction=np.array([r["instruction"] for r in recs]),
           box=np.array([box(r["box"]) for r in recs], np.float32),
           other=np.array([box(r["other"]) for r in recs], np.float32),
           png=np.frombuffer(b"".join(pngs), np.uint8), png_end=np.cumsum([len(p) for p in pngs]))
  print(f"[probe] {len(recs)} screens of {list(tasks)} in {time.time() - t0:.0f} s -> {path}")


def load(path: str, image_hw) -> list[dict]:
  z = np.load(path)
  starts = np.concatenate([[0], z["png_end"][:-1]])
  out = []
  for i in range(len(z["task"])):
    img = np.asarray(Image.open(io.BytesIO(z["png"][starts[i]:z["png_end"][i]].tobytes())).convert("RGB"))
    out.append({"task": str(z["task"][i]), "split": str(z["split"][i]), "instruction": str(z["instruction"][i]),
                "image": preprocess(img, image_hw), "hw": img.shape[:2], "box": z["box"][i], "other": z["other"][i]})
  return out


def target_reply(box, hw) -> str:
  """`click` at the box centre on the 0-1000 'tens3' grid, empty thought."""
  (h, w), (x, y, bw, bh) = hw, box
  cx, cy = (x + bw / 2) / w * 1000, (y + bh / 2) / h * 1000
  return f"Thought: \nAction: click(start_box='({int(round(cx / 10)) * 10:03d},{int(round(cy / 10)) * 10:03d})')"


def inside(point, box, hw) -> bool:
  """point (x, y) on the 0-1000 grid inside box [x, y, w, h] px of a screen of hw = (h, w) px."""
  if box[2] < 0:
    return False
  px, py = point[0] / 1000 * hw[1], point[1] / 1000 * hw[0]
  return box[0] <= px <= box[0] + box[2] and box[1] <= py <= box[1] + box[3]


def demo_episode(parts, task: str, instruction: str, image: np.ndarray, reply: str | None):
  """A one-turn Episode on `image` (preprocessed), reply text `reply` (None: prompt only)."""
  from tars_jax.agent.trajectory import Episode, Turn
  tok = parts.tokenizer
  ep = Episode(task=task, seed=0, instruction=instruction,
               prefix_ids=prompts.encode_episode_prefix(tok, instruction, parts.loop_cfg.system))
  ep.turns.append(Turn(image=image, obs_ids=prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None),
                       reply_ids=[], logprobs=np.zeros(0, np.float32), states=np.zeros(0, np.int32),
                       text=reply or "Thought: \nAction: finished()"))
  return ep
