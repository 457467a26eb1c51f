"""Hybrid GUI + SDK tasks on the desktop sandbox: the shared session directory (terminal, editor,
browser downloads and SDK see the same files), each hybrid task solved with GUI + SDK actions, and
the GUI-only variant refusing SDK calls."""

import asyncio
import re
import time

import pytest

from envs_bridge.client import SandboxClient
from envs_bridge.desktop import tasks
from envs_bridge.launch import launch_server
from tests.test_desktop import buttons, centre, pt, settle, state, wait_for_file, xedit_save_button


@pytest.fixture(scope="module")
def desk():
  with launch_server("envs_bridge.desktop.server", step_ms=250, lease_s=120.0, max_sessions=4) as h:
    yield h


def dialog_labels(task: str, seed: int) -> list[str]:
  spec, _ = tasks.make(task, seed)
  argv = next(p.argv for p in spec.programs if p.label == "dialog")
  return argv[argv.index("-buttons") + 1].split(",")


async def click_dialog_button(c, url, sid, labels, label):
  btn = buttons(state(url, sid)["windows"], left=420)[labels.index(label)]
  return await settle(c, sid, await c.step(sid, f"click(start_box={centre(btn)})"))


def test_dialog_sum_file_gui_plus_sdk(desk):
  task, seed = "hybrid/dialog-sum-file", 4
  labels = dialog_labels(task, seed)

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, _ = await c.open(task, seed)
      tool = await c.step(sid, "Action: run_command(command='awk \"{s+=\\\\$1} END {print s}\" numbers.txt')")
      total = tool.info["tool_output"].split("\n")[0]
      end = await click_dialog_button(c, desk.url, sid, labels, total)
      await c.close(sid)
      return tool, total, end
  tool, total, end = asyncio.run(go())
  spec, _ = tasks.make(task, seed)
  assert int(total) == sum(map(int, spec.files["numbers.txt"].split()))  # independent sum of the task's file
  assert tool.info["tool_output"] == f"{total}\n[exit code 0]" and tool.reward == 0 and not tool.done
  assert (end.reward, end.done) == (1.0, True)


def test_dialog_count_errors_with_search_files(desk):
  task, seed = "hybrid/dialog-count-errors", 1
  labels = dialog_labels(task, seed)

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, _ = await c.open(task, seed)
      found = await c.step(sid, "search_files(pattern='ERROR', path='app.log')")
      n = len(found.info["tool_output"].splitlines())
      end = await click_dialog_button(c, desk.url, sid, labels, str(n))
      await c.close(sid)
      return n, end
  n, end = asyncio.run(go())
  spec, _ = tasks.make(task, seed)
  assert n == spec.files["app.log"].count(" ERROR ")
  assert (end.reward, end.done) == (1.0, True)


def test_code_from_the_dialog_written_with_the_sdk_and_read_back_in_the_terminal(desk):
  task, seed = "hybrid/dialog-code-to-file", 2
  spec, _ = tasks.make(task, seed)
  code = re.search(r"The code is (\d+)", spec.programs[1].argv[-1]).group(1)  # what the dialog shows

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, _ = await c.open(task, seed)
      wrong = await c.step(sid, "write_file(path='code.txt', content='000000x')")
      # the same file through the GUI terminal: the shell sees what the SDK wrote
      await c.step(sid, f"click(start_box={pt(200, 150)})")
      await c.step(sid, "type(content='cat code.txt > seen_by_shell.txt\\n')")
      wait_for_file(desk.url, sid, "seen_by_shell.txt")  # the shell runs it in real time, maybe steps later
      seen = await c.step(sid, "read_file(path='seen_by_shell.txt')")
      right = await settle(c, sid, await c.step(sid, f"write_file(path='code.txt', content='{code}')"))
      await c.close(sid)
      return wrong, seen, right
  wrong, seen, right = asyncio.run(go())
  assert wrong.info["tool_output"] == "wrote 7 bytes to code.txt" and wrong.reward == 0 and not wrong.done
  assert seen.info["tool_output"] == "000000x"
  assert (right.reward, right.done) == (1.0, True)


def test_docs_lookup_through_mcp_then_the_editor(desk):
  task, seed = "hybrid/docs-lookup-editor", 0  # seed 0: the magic number of the test suite

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, obs = await c.open(task, seed)
      tools = await c.step(sid, "mcp_list_tools(server='docs')")
      hit = await c.step(sid, "mcp_call(server='docs', tool='search_docs', arguments='{\"query\": \"magic number\", \"k\": 1}')")
      answer = re.search(r"is (\d+)\.", hit.info["tool_output"]).group(1)
      editor = [w for w in state(desk.url, sid)["windows"] if w["name"] == "xedit"][0]
      await c.step(sid, f"click(start_box={pt(editor['x'] + 200, editor['y'] + 200)})")
      await c.step(sid, f"type(content='{answer}')")
      save = xedit_save_button(state(desk.url, sid)["windows"], top=editor["y"])
      end = await settle(c, sid, await c.step(sid, f"click(start_box={centre(save)})"))
      await c.close(sid)
      return obs, tools, hit, end
  obs, tools, hit, end = asyncio.run(go())
  assert obs.info["mcp_servers"] == ["docs"]
  assert tools.info["tool_output"].splitlines()[0].startswith("search_docs(query, k)")
  assert hit.info["tool_output"] == "mcp.md: The magic number of the test suite is 4817."
  assert (end.reward, end.done) == (1.0, True), end.info["reason"]


def test_gui_only_variant_refuses_sdk_but_plays_by_gui(desk):
  task, seed = "hybrid/dialog-sum-file@gui", 4
  labels = dialog_labels(task, seed)
  spec, gui = tasks.make(task, seed)
  total = str(sum(map(int, spec.files["numbers.txt"].split())))

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, obs = await c.open(task, seed)
      refused = await c.step(sid, "run_command(command='cat numbers.txt')")
      end = await click_dialog_button(c, desk.url, sid, labels, total)
      await c.close(sid)
      return obs, refused, end
  obs, refused, end = asyncio.run(go())
  assert gui and obs.info["gui_only"] is True
  assert refused.info["error"] == "invalid action: SDK functions are disabled in this session (GUI-only)"
  assert "tool_output" not in refused.info
  assert (end.reward, end.done) == (1.0, True)


@pytest.mark.browser
def test_browser_download_lands_in_the_shared_directory(desk):
  """A file downloaded by clicking a link in real Chromium is visible to the SDK and the shell."""
  task, seed = "hybrid/browser-download-total", 3
  spec, _ = tasks.make(task, seed)
  csv = spec.web["sales.csv"][1]
  want = sum(int(line.split(",")[1]) for line in csv.splitlines()[1:])

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, _ = await c.open(task, seed)
      browser = [w for w in state(desk.url, sid)["windows"] if w["class"].lower().startswith("chromium")][0]
      # The window maps before the page paints: wait for the link's blue (#36c) before clicking it.
      deadline = time.monotonic() + 60
      while True:
        img = (await c.observe(sid)).image()
        seen = tuple(int(v) for v in img[browser["y"] + 40, browser["x"] + 150])
        if seen == (0x33, 0x66, 0xcc):
          break
        if time.monotonic() > deadline:
          raise AssertionError(f"the link never painted: pixel {seen} after 60 s")
        await asyncio.sleep(0.1)
      await c.step(sid, f"click(start_box={pt(browser['x'] + 150, browser['y'] + 40)})")  # the big link
      # Chromium names the file sales.csv only once the download is complete (.crdownload before);
      # polled on disk, not with steps, so a slow download does not use up the episode's steps.
      wait_for_file(desk.url, sid, "sales.csv")
      listing = await c.step(sid, "list_files()")
      shell = await c.step(sid, "run_command(command='awk -F, \"NR>1 {s+=\\$2} END {print s}\" sales.csv')")
      total = shell.info["tool_output"].split("\n")[0]
      end = await settle(c, sid, await c.step(sid, f"write_file(path='answer.txt', content='{total}')"))
      await c.close(sid)
      return listing, shell, end
  listing, shell, end = asyncio.run(go())
  assert f"sales.csv  {len(csv)}" in listing.info["tool_output"].splitlines()
  assert shell.info["tool_output"] == f"{want}\n[exit code 0]"
  assert (end.reward, end.done) == (1.0, True)


def test_mcp_servers_from_the_config_and_a_broken_one_as_an_observation():
  """Servers named in the sandbox config reach every session; one that cannot start is a typed
  error naming it, in the observation, and the session goes on."""
  import sys

  from envs_bridge.desktop.sessions import DesktopSandbox
  cfg = {"kb": {"command": sys.executable, "args": ["-m", "envs_bridge.mcp_tools.docsearch_server"]},
         "broken": {"command": sys.executable, "args": ["-c", "raise SystemExit('no config file')"]}}

  async def go():
    sb = DesktopSandbox(step_ms=50, mcp_servers=cfg)
    await sb.start()
    try:
      sid, first = await sb.open("desktop/terminal-mkdir", 0)
      bad = await sb.step(sid, "mcp_list_tools(server='broken')")
      good = await sb.step(sid, "mcp_call(server='kb', tool='search_docs', arguments='{\"query\": \"displayfd\"}')")
      return first, bad, good
    finally:
      await sb.stop()
  first, bad, good = asyncio.run(go())
  assert first.info["mcp_servers"] == ["broken", "kb"]
  assert bad.info["tool_error"].startswith("McpServerError: MCP server 'broken': failed to start")
  assert "no config file" in bad.info["tool_error"] and not bad.done and bad.info["error"] is None
  assert good.info["tool_output"].startswith("xvfb.md: ") and good.info["tool_error"] is None


def test_flooding_command_and_traversal_through_the_server(desk):
  async def go():
    async with SandboxClient(desk.url) as c:
      sid, _ = await c.open("hybrid/dialog-code-to-file", 0)
      flood = await c.step(sid, "run_command(command='yes flood')")
      escape = await c.step(sid, "write_file(path='../../../tmp/escaped.txt', content='x')")
      after = await c.step(sid, "run_command(command='echo alive')")
      await c.close(sid)
      return flood, escape, after
  flood, escape, after = asyncio.run(go())
  out = flood.info["tool_output"]
  assert out.startswith("flood\n" * 100) and out.endswith("[output truncated]\n[killed: too much output]")
  assert len(out) < 8192 + 100
  assert escape.info["tool_error"] == "PathRefused: path '../../../tmp/escaped.txt' is outside the session directory"
  assert after.info["tool_output"] == "alive\n[exit code 0]" and not after.done


def test_agent_loop_shows_sdk_output_to_the_policy_next_turn(desk):
  """The rollout loop puts an SDK result (`info.tool_output`) into the next observation's text, so a
  policy can act on what a command printed (scripted policy: it echoes a marker, then reads it)."""
  import numpy as np

  from tars_jax.agent.tokenizer import ByteTokenizer
  from tars_jax.rollout.agent_loop import run_episodes
  from tars_jax.rollout.episode import LoopConfig
  tok = ByteTokenizer()
  seen = []

  def act(prompts, images):
    out = []
    for ids, imgs in zip(prompts, images):
      seen.append(tok.decode(ids))
      reply = "Action: run_command(command='echo marker-$((6*7))')" if len(imgs) == 1 else "Action: wait()"
      r = tok.encode(reply) + [tok.eos_id]
      out.append((r, np.zeros(len(r), np.float32), np.zeros(len(r), np.int32)))
    return out

  async def go():
    async with SandboxClient(desk.url) as c:
      return await run_episodes(act, [c], [("hybrid/dialog-sum-file", 4)], LoopConfig(max_turns=2), tok)
  ep, = asyncio.run(go())
  assert ep.turns[0].info["tool_output"] == "marker-42\n[exit code 0]"  # the shell computed 6*7
  assert "marker-42" not in seen[0] and "marker-42\n[exit code 0]" in seen[1]


def test_constrained_sdk_replies_run_on_the_real_sandbox(desk):
  """Replies drawn from the constrained-decoding automaton with SDK functions (random walks, as an
  untrained constrained policy writes them) are executed by the real desktop sandbox: none comes back
  as an invalid action, files read back equal what the task put in the session directory, and
  mcp_list_tools of the task's docs server lists its real tools."""
  import numpy as np

  from tars_jax.agent.grammar import build_grammar
  from tars_jax.agent.tokenizer import ByteTokenizer
  from tests.test_grammar import random_reply
  tok = ByteTokenizer()
  g = build_grammar(actions=("list_files", "search_files", "read_file"), max_thought_bytes=4, max_content_bytes=8)
  rng = np.random.default_rng(0)
  replies = [tok.decode(random_reply(g, rng)[:-1]) for _ in range(12)]
  task, seed = "hybrid/docs-lookup-editor", 0
  spec, _ = tasks.make(task, seed)
  name = next(n for n in sorted(spec.files) if n.startswith("docs/") and spec.files[n].strip())

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, _ = await c.open(task, seed)
      outs = [await c.step(sid, r) for r in replies]
      read = await c.step(sid, f"Thought: \nAction: read_file(path='{name}')")
      tools = await c.step(sid, "Thought: \nAction: mcp_list_tools(server='docs')")
      await c.close(sid)
      return outs, read, tools
  outs, read, tools = asyncio.run(go())
  for reply, o in zip(replies, outs):
    assert not (o.info.get("error") or "").startswith("invalid action"), (reply, o.info)
    assert o.info.get("tool_output") is not None or o.info.get("error"), (reply, o.info)  # output or a tool error
  assert read.info["tool_output"].startswith(spec.files[name].splitlines()[0]), read.info
  assert "search_docs" in tools.info["tool_output"] and "read_doc" in tools.info["tool_output"], tools.info
