"""Slow: every game's reference player over the reference seeds reproduces reference_scores.json
(deterministic games on virtual time: the same seeds and actions give the same scores)."""

import asyncio

import pytest

from envs_bridge.browser.sessions import BrowserSandbox
from envs_bridge.games import catalog
from envs_bridge.games import reference as R

pytestmark = [pytest.mark.long, pytest.mark.browser]


def test_reference_players_reproduce_reference_scores():
  async def go():
    sb = BrowserSandbox(step_ms=1000)
    await sb.start()
    try:
      out = {}
      for g in catalog.GAMES:
        finals = [(await R.play(sb, g, s))[0] for s in R.REFERENCE_SEEDS]
        out[g] = finals
      return out
    finally:
      await sb.stop()
  res = asyncio.run(go())
  ref = catalog.reference_scores()
  for g, finals in res.items():
    scores = [f["score"] for f in finals]
    assert all(f["done"] for f in finals), g
    assert min(scores) > 0, (g, scores)
    assert sum(scores) / len(scores) == pytest.approx(ref[g]), (g, scores)
