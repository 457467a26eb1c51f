"""The sandbox's fast step path (issue #5 item 5) against Playwright's own API on real Chromium:
one `page.evaluate` for clock advance + state read must give what `page.clock.run_for` followed by
`page.evaluate(state_script)` gives, and the CDP `Page.captureScreenshot` (caret hidden by a style)
the same PNG bytes as `page.screenshot`."""

import asyncio
import base64

import pytest
from playwright.async_api import async_playwright

from envs_bridge.browser import sessions as S
from envs_bridge.browser import tasks

pytestmark = pytest.mark.browser


async def _page(browser, task: str, seed: int):
  """A task page set up as the sandbox sets up its pages (clock installed and paused, then loaded)."""
  ts = tasks.get(task)
  ctx = await browser.new_context(viewport={"width": ts.width, "height": ts.height}, device_scale_factor=1,
                                  timezone_id="UTC", locale="en-US")
  page = await ctx.new_page()
  await page.clock.install(time=S.EPOCH_MS)
  await page.clock.pause_at(S.EPOCH_MS + 1000)
  await page.goto(ts.url)
  await page.add_style_tag(content=(ts.css or "") + S.HIDE_CARET_CSS)
  await page.evaluate(ts.start_script(seed))
  return S._Page(ctx, page, slot=None, generation=0)


async def _twin_episodes(task: str, seed: int, keys: list[str | None]):
  """The same episode on two pages: one stepped with Playwright's clock API and page.screenshot
  (reference), one with the sandbox's fast path -> (reference, fast): lists of (state, png)."""
  ts = tasks.get(task)
  pw = await async_playwright().start()
  browser = await pw.chromium.launch(executable_path=S.DEFAULT_CHROMIUM, args=S.CHROMIUM_ARGS)
  try:
    ref, fast = await _page(browser, task, seed), await _page(browser, task, seed)
    out_ref, out_fast = [], []
    for key in keys:
      for pg in (ref, fast):
        if key:
          await pg.page.keyboard.press(key)
      await ref.page.clock.run_for(1000)
      out_ref.append((await ref.page.evaluate(ts.state_script), await ref.page.screenshot(type="png")))
      st = await S._advance_and_read(fast.page, 1000, ts.state_script)
      out_fast.append((st, base64.b64decode(await S._capture_png_b64(fast))))
    return out_ref, out_fast
  finally:
    await browser.close()
    await pw.stop()


def test_fast_clock_matches_playwright_clock_on_a_real_time_game():
  # snake moves one cell per virtual second: positions, score and pixels depend on the clock
  keys = ["ArrowUp", None, "ArrowLeft", None, None, "ArrowDown"]
  ref, fast = asyncio.run(_twin_episodes("games/snake", 4, keys))
  assert [s for s, _ in fast] == [s for s, _ in ref]
  assert [p for _, p in fast] == [p for _, p in ref]
  assert len({p for _, p in ref}) == len(keys)  # every step moved the picture: the clock did advance


def test_fast_clock_matches_playwright_clock_on_miniwob_timeout():
  # untouched, a MiniWoB episode ends after core.EPISODE_MAX_TIME = 10 s of virtual time with reward -1
  ref, fast = asyncio.run(_twin_episodes("miniwob/click-test", 7, [None] * 11))
  assert [s for s, _ in fast] == [s for s, _ in ref]
  assert [p for _, p in fast] == [p for _, p in ref]
  done = [s["done"] for s, _ in fast]
  assert done == [False] * 9 + [True, True]  # done at 10 000 virtual ms, not before
  assert fast[9][0]["reward"] == -1.0 and fast[9][0]["raw_reward"] == -1.0


def test_cdp_screenshot_equals_page_screenshot_with_focused_text_input():
  async def go():
    pw = await async_playwright().start()
    browser = await pw.chromium.launch(executable_path=S.DEFAULT_CHROMIUM, args=S.CHROMIUM_ARGS)
    try:
      pg = await _page(browser, "miniwob/enter-text", 3)
      box = await (await pg.page.query_selector("#tt")).bounding_box()
      await pg.page.mouse.click(box["x"] + 5, box["y"] + 5)  # focus: a caret would be drawn in it
      await pg.page.keyboard.type("hello")
      fast = base64.b64decode(await S._capture_png_b64(pg))
      ref = await pg.page.screenshot(type="png")
      value = await pg.page.evaluate("() => document.querySelector('#tt').value")
      return fast, ref, value
    finally:
      await browser.close()
      await pw.stop()
  fast, ref, value = asyncio.run(go())
  assert value == "hello"
  assert fast[:8] == b"\x89PNG\r\n\x1a\n" and fast == ref
