"""Which MiniWoB tasks look different on a reused page than on a fresh one (same seed)?

  .venv/bin/python -m benchmarks.reuse_parity

For every task: episode on a fresh page (seed 7, two actions), close (the page goes idle), the same
seed again on the reused page; the first screenshots must be byte-equal. Tasks that differ belong in
`sessions.REUSE_UNSAFE_TASKS` (they always get a fresh page). Found 2026-11-23: 12 tasks.
"""

import asyncio

from envs_bridge.browser import miniwob_tasks as mw
from envs_bridge.browser import sessions


async def main() -> list[str]:
  saved, sessions.REUSE_UNSAFE_TASKS = sessions.REUSE_UNSAFE_TASKS, frozenset()  # test every task
  sb = sessions.BrowserSandbox(max_idle_pages=1, gc_interval_s=3600)
  await sb.start()
  bad = []
  try:
    for t in mw.task_names():
      sid, fresh = await sb.open(t, 7)
      for act in ("click(start_box='(500,600)')", "wait()"):
        await sb.step(sid, act)
      await sb.close(sid)
      sid, reused = await sb.open(t, 7)
      if fresh.screenshot_png_b64 != reused.screenshot_png_b64:
        bad.append(t)
      await sb.close(sid)
      for pool in sb.idle.values():  # one task's pages at a time
        while pool:
          await sb._discard_page(pool.pop())
  finally:
    await sb.stop()
    sessions.REUSE_UNSAFE_TASKS = saved
  print(f"{len(bad)} tasks differ on a reused page: {bad}")
  return bad


if __name__ == "__main__":
  asyncio.run(main())
