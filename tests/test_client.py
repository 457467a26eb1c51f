"""Many concurrent sessions through the async client."""

import asyncio

import pytest

from envs_bridge.client import SandboxClient

pytestmark = pytest.mark.browser


def test_eight_concurrent_sessions(server):
  async def one(c, seed):
    sid, o = await c.open("miniwob/click-test", seed)
    box = await c.element_box(sid, "#subbtn")
    x = round((box["x"] + box["width"] / 2) / 160 * 1000)
    y = round((box["y"] + box["height"] / 2) / 210 * 1000)
    o = await c.step(sid, f"click(start_box='({x},{y})')")
    await c.close(sid)
    return o.reward, o.done

  async def go():
    async with SandboxClient(server.url) as c:
      return await asyncio.gather(*[one(c, s) for s in range(8)])
  out = asyncio.new_event_loop().run_until_complete(go())
  assert out == [(1.0, True)] * 8
