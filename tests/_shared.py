"""Helpers shared by several test modules (tiny model config, jitted forward, grid coordinates)."""

import asyncio

from flax import nnx

from envs_bridge.browser import miniwob_tasks as mw
from tars_jax.models import ModelConfig

TINY_CFG = ModelConfig(image_h=56, image_w=84, patch_size=14, vision_hidden=32, vision_depth=1, vision_heads=2,
                       vision_mlp=64, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
                       moe_intermediate=32)  # merged grid 2 x 3


@nnx.jit
def fwd(model, *args):
  """Jitted forward (op-by-op eager NNX is several times slower on CPU)."""
  return model(*args)


def grid(box) -> tuple[int, int]:
  """Centre of a MiniWoB pixel box {x, y, width, height} -> 0-1000 grid coordinates."""
  return (round((box["x"] + box["width"] / 2) / mw.WIDTH * 1000),
          round((box["y"] + box["height"] / 2) / mw.HEIGHT * 1000))


def run(coro):
  """Runs a coroutine to completion on a fresh event loop (tests that drive the async client)."""
  loop = asyncio.new_event_loop()
  try:
    return loop.run_until_complete(coro)
  finally:
    loop.close()
