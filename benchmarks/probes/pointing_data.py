"""Screens and labels of the pointing probe (`benchmarks/probes/pointing_probe.py`), flag-free so tests can
import them: collection from the real sandbox into an .npz, loading, the target reply, the training
episode and the hit test."""

from __future__ import annotations

import asyncio
import io
import time

import numpy as np
from PIL import Image

from tars_jax.agent.images import preprocess
from tars_jax.agent.trajectory import Episode
from tars_jax.data.sources import grounding as G

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


def target_point(box, hw, coord_format: str = "tens3") -> tuple[int, int]:
  """The grid point nearest the centre of box [x, y, w, h] px on a screen of hw = (h, w) px
  (`grounding.grid_point`, as the grounding examples label it).
  Raises: ValueError when no grid point lies inside the box."""
  pt = G.grid_point(box, (hw[1], hw[0]), coord_format)
  if pt is None:
    raise ValueError(f"no {coord_format} grid point inside box {list(box)} of a {hw[1]} x {hw[0]} screen")
  return pt


def _click_reply(pt: tuple[int, int], coord_format: str) -> str:
  x, y = (G.format_coord(v, coord_format) for v in pt)
  return f"Thought: \nAction: click(start_box='({x},{y})')"


def target_reply(box, hw, coord_format: str = "tens3") -> str:
  """`click` at `target_point`, empty thought."""
  return _click_reply(target_point(box, hw, coord_format), coord_format)


def hit(reply: str, box, hw) -> bool:
  """True if the reply's click lies in box [x, y, w, h] px of a screen of hw = (h, w) px
  (`grounding.score_reply`); a missing box ([-1, -1, -1, -1]) is never hit."""
  return G.score_reply(reply, {"kind": "where", "box": tuple(box), "screen_wh": (hw[1], hw[0])})


def episode(fmt: G.EpisodeFormat, r: dict) -> Episode:
  """The one-turn training episode of a loaded screen `r`: its instruction, screenshot and the click
  at the named button (`grounding.make_episode`, the grounding stage's episode builder)."""
  pt = target_point(r["box"], r["hw"], fmt.coord_format)
  target = G.Target("where", r["instruction"], _click_reply(pt, fmt.coord_format), "", "button", tuple(r["box"]), pt)
  return G.make_episode(fmt, target, r["image"], r["task"], 0)
