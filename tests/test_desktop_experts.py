"""Scripted experts of the desktop and hybrid tasks (tars_jax/data/sources/desktop_experts.py): pure decisions
against hand-built window trees, the hybrid experts' shell commands run by bash on the task's own files
(against the task's check), and the experts playing real sessions (Xvfb, xterm, xedit, xmessage) to
success through `demos.collect`, the path of experiments/demos.py."""

import asyncio
import subprocess

import pytest

from envs_bridge.client import SandboxClient
from envs_bridge.desktop import tasks
from envs_bridge.launch import launch_server
from experiments.configs import verticals
from tars_jax.agent import actions as A
from tars_jax.agent.grammar import SDK_ACTIONS, accepts, build_grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.data.sources import demos
from tars_jax.data.sources import desktop_experts as D
from tars_jax.data.sources import experts as E

TOK = ByteTokenizer()
W, H = 640, 480


def win(x, y, w, h, depth, cls="", name=""):
  return {"id": hash((x, y, w, h, depth, cls)), "name": name, "class": cls, "x": x, "y": y, "width": w,
          "height": h, "depth": depth}


def view(windows, programs=None, evaluator=None, entries=()):
  return {"windows": windows, "width": W, "height": H, "programs": programs or {}, "evaluator": evaluator or {},
          "entries": list(entries), "work": "/nonexistent", "outputs": {}}


XTERM = [win(0, 0, 484, 316, 0, "XTerm", "bash"), win(1, 1, 484, 316, 1)]
# xedit at +0+0 as the sandbox reports it: top row Quit / Save / Load / file name, text area at depth 4
# with the scroll bar (depth 5) over its left edge
XEDIT = [win(0, 0, 400, 300, 0, "Xedit", "xedit"), win(1, 1, 400, 300, 1), win(1, 1, 400, 18, 2),
         win(1, 1, 36, 18, 3), win(38, 1, 36, 18, 3), win(75, 1, 36, 18, 3), win(112, 1, 289, 18, 3),
         win(1, 20, 400, 18, 2), win(1, 39, 400, 50, 2), win(1, 90, 400, 211, 2), win(1, 90, 400, 211, 3),
         win(1, 90, 400, 18, 4), win(309, 91, 90, 15, 5), win(3, 91, 306, 15, 5), win(1, 109, 400, 192, 4),
         win(0, 108, 14, 192, 5)]


def dialog(left=200, top=200, widths=(50, 57, 50)):
  """xmessage's tree: its buttons listed right to left (X stacking order), as the sandbox reports them."""
  out = [win(left, top, 179, 52, 0, "Xmessage", "xmessage"), win(left + 1, top + 1, 179, 52, 1)]
  xs, x = [], left + 5
  for w in widths:
    xs.append(x)
    x += w + 6
  out += [win(bx, top + 30, bw, 17, 2) for bx, bw in reversed(list(zip(xs, widths)))]
  return out + [win(left + 5, top + 5, 106, 18, 2), win(left + 5, top + 5, 14, 18, 3)]


def unit_point(text):
  """Parsed click of a reply -> pixel (truncated, as the executor clicks)."""
  a = A.parse_action(text)
  return int(a.x * W), int(a.y * H)


def inside(px, box):
  return box["x"] <= px[0] < box["x"] + box["width"] and box["y"] <= px[1] < box["y"] + box["height"]


def play(task, instruction, v, turns, coord_format="tens3"):
  return [E.decide(task, instruction, v, t, coord_format=coord_format) for t in range(turns)]


# -- pure decisions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("task,instruction,command", [
    ("desktop/terminal-write-file", "In the terminal, save the word violet into a new file named answer.txt.",
     "echo violet > answer.txt"),
    ("desktop/terminal-mkdir", "In the terminal, create a directory named harbor.", "mkdir harbor"),
    ("desktop/terminal-rename", "In the terminal, rename the file draft.txt to walnut.txt.",
     "mv draft.txt walnut.txt")])
def test_terminal_experts_click_type_enter_then_keep_the_focus(task, instruction, command):
  replies = play(task, instruction, view(XTERM), 5)
  actions = [a for _, a in replies]
  assert inside(unit_point(actions[0]), XTERM[0]) and actions[3] == actions[4] == actions[0]
  assert actions[1:3] == [f"type(content='{command}')", "hotkey(key='enter')"]
  assert all(0 < len(t) <= E.MAX_THOUGHT_BYTES for t, _ in replies)


def test_terminal_expert_without_a_terminal_or_with_another_instruction_is_an_expert_error():
  with pytest.raises(E.ExpertError, match="no XTerm window"):
    E.decide("desktop/terminal-mkdir", "In the terminal, create a directory named harbor.", view(XEDIT), 0)
  with pytest.raises(E.ExpertError, match="does not match"):
    E.decide("desktop/terminal-mkdir", "Make a folder.", view(XTERM), 0)


def test_editor_expert_clicks_the_text_off_the_scroll_bar_types_and_saves():
  instruction = "In the text editor, type orchid into notes.txt and save the file."
  for fmt in E.COORD_FORMATS:
    (_, click), (_, typed), (_, save), (_, again) = play("desktop/editor-type-save", instruction, view(XEDIT), 4, fmt)
    text_area, scroll_bar, save_button = XEDIT[14], XEDIT[15], XEDIT[4]
    p = unit_point(click)
    assert inside(p, text_area) and not inside(p, scroll_bar), (fmt, p)
    assert typed == "type(content='orchid')"
    assert inside(unit_point(save), save_button) and again == save, fmt


@pytest.mark.parametrize("target", ["apple", "piano", "lantern"])
def test_dialog_expert_clicks_the_button_of_the_label_in_argv_order(target):
  labels = ["apple", "piano", "lantern"]
  wins = dialog()
  v = view(wins, {"dialog": ["xmessage", "-print", "-buttons", ",".join(labels), "-geometry", "+200+200", "Click x"]})
  (thought, click), = play("desktop/dialog-choose", f"Click the button labelled {target} in the dialog.", v, 1)
  buttons = sorted((w for w in wins if w["depth"] == 2 and w["y"] == 230), key=lambda w: w["x"])
  hit = [b for b in buttons if inside(unit_point(click), b)]
  assert hit == [buttons[labels.index(target)]] and thought == f"the button labelled {target}"
  with pytest.raises(E.ExpertError, match="no dialog button labelled 'tundra'"):
    E.decide("desktop/dialog-choose", "Click the button labelled tundra in the dialog.", v, 0)


def test_every_desktop_and_hybrid_task_has_an_expert_reading_the_desktop_state():
  table = E.experts()
  for t in tasks.TASKS:
    assert table[t].reads == "desktop_state", t
  assert not any(t.endswith(tasks.GUI_SUFFIX) for t in table)


def _hybrid_view(task, seed):
  spec, _ = tasks.make(task, seed)
  wins = XTERM + dialog(420, 20, (36, 36, 36, 36)[:len(spec.programs[-1].argv[3].split(","))]) \
      if spec.end_on_exit else XTERM
  return spec, view(wins, {p.label: list(p.argv) for p in spec.programs}, spec.evaluator)


@pytest.mark.parametrize("task,seed", [("hybrid/dialog-sum-file", 3), ("hybrid/dialog-count-errors", 5)])
def test_hybrid_dialog_experts_compute_with_the_shell_then_click_the_answer(task, seed, tmp_path):
  """The expert's command, run by bash on the task's own files, prints the answer the task checks; the
  next turn clicks the button of that label."""
  spec, v = _hybrid_view(task, seed)
  (_, cmd), (_, click) = play(task, spec.instruction, v, 2)
  for name, text in spec.files.items():
    (tmp_path / name).write_text(text)
  command = A.parse_action(cmd, sdk=True).command
  out = subprocess.run(["bash", "--noprofile", "--norc", "-c", command], cwd=tmp_path, capture_output=True,
                       text=True, check=True).stdout.strip()
  assert out == str(spec.evaluator["expected"])
  labels = v["programs"]["dialog"][3].split(",")
  buttons = D.dialog_buttons(v)
  assert list(buttons) == labels and inside(unit_point(click), buttons[out])


def test_code_docs_and_download_experts():
  spec, v = _hybrid_view("hybrid/dialog-code-to-file", 8)
  (_, act), = play("hybrid/dialog-code-to-file", spec.instruction, v, 1)
  code = spec.evaluator["expected"]
  assert A.parse_action(act, sdk=True) == A.WriteFile("code.txt", code) and f"The code is {code}" in v["programs"]["dialog"][-1]

  spec, _ = tasks.make("hybrid/docs-lookup-editor", 1)
  v = view(XTERM + XEDIT, {}, spec.evaluator)
  (_, search), (_, click), (_, typed), (_, save) = play("hybrid/docs-lookup-editor", spec.instruction, v, 4)
  call = A.parse_action(search, sdk=True)
  assert (call.server, call.tool, call.args()) == ("docs", "search_docs",
                                                  {"query": "the clip-higher upper bound of UI-TARS-2", "k": 1})
  assert inside(unit_point(click), XEDIT[14]) and typed == "type(content='0.28')"
  assert inside(unit_point(save), XEDIT[4])

  page = win(0, 0, 640, 192, 0, "Chromium", "Chromium")
  (_, first), = play("hybrid/browser-download-total", "Download sales.csv ...", view(XTERM + [page]), 1)
  assert inside(unit_point(first), {"x": 0, "y": 0, "width": 300, "height": 80})
  (_, then), = play("hybrid/browser-download-total", "Download sales.csv ...",
                    view(XTERM + [page], entries=["sales.csv"]), 1)
  assert A.parse_action(then, sdk=True) == A.RunCommand(D.SUM_AMOUNTS)


def test_download_expert_sums_the_amount_column_like_the_check(tmp_path):
  spec, _ = tasks.make("hybrid/browser-download-total", 6)
  (tmp_path / "sales.csv").write_text(spec.web["sales.csv"][1])
  out = subprocess.run(["bash", "--noprofile", "--norc", "-c", D.SUM_AMOUNTS], cwd=tmp_path, capture_output=True,
                       text=True, check=True).stdout
  assert out == f"{spec.evaluator['expected']}\n" and (tmp_path / "answer.txt").read_text() == out


def test_desktop_and_hybrid_replies_fit_the_verticals_grammar():
  """Every reply of the desktop and hybrid experts is in the GUI-General vertical's grammar (verticals.py:
  clicks, typing, keys and the SDK functions the hybrid experts call, 72 content bytes, 48 thought bytes,
  tens3); without the SDK functions the hybrid experts' calls are not."""
  c = verticals.get_config("sft")
  g = c.grammar
  full = build_grammar(TOK, tuple(g.actions), g.max_thought_bytes, g.max_content_bytes, g.coord_format)
  gui = build_grammar(TOK, tuple(a for a in g.actions if a not in SDK_ACTIONS), g.max_thought_bytes,
                      g.max_content_bytes, g.coord_format)
  for task in tasks.DESKTOP_TASKS:
    for seed in range(3):
      spec, _ = tasks.make(task, seed)
      v = view(XTERM + XEDIT + dialog(), {p.label: list(p.argv) for p in spec.programs}, spec.evaluator)
      for thought, act in play(task, spec.instruction, v, 4):
        assert accepts(full, E.reply_text(thought, act), TOK), (task, act)
  for task, v_of in [("hybrid/dialog-sum-file", _hybrid_view), ("hybrid/dialog-count-errors", _hybrid_view),
                     ("hybrid/dialog-code-to-file", _hybrid_view)]:
    spec, v = v_of(task, 2)
    replies = [E.reply_text(thought, act) for thought, act in play(task, spec.instruction, v, 2)]
    assert all(accepts(full, r, TOK) for r in replies), (task, replies)
    assert not all(accepts(gui, r, TOK) for r in replies), (task, replies)  # its SDK call needs the functions
  assert accepts(full, E.reply_text("", f"run_command(command='{D.SUM_AMOUNTS}')"), TOK)


# -- real sessions ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def desk():
  with launch_server("envs_bridge.desktop.server", step_ms=300, lease_s=120.0, max_sessions=4) as h:
    yield h


def _collect(url, jobs):
  config = verticals.get_config("sft+smoke")  # the verticals' grammar: GUI actions and the SDK functions
  from tars_jax.train import state as state_lib
  spec = demos.DemoSpec.from_parts(state_lib.build(config))

  async def go():
    async with SandboxClient(url) as c:
      w = demos.MemoryWriter()
      return await demos.collect([c], jobs, spec, w, concurrency=2, progress=False), w
  return asyncio.run(go())


def test_desktop_experts_play_real_sessions_to_success(desk):
  """Two seeds of each desktop task on real X programs: every episode succeeds by the task's own check
  and is written as a demonstration in the verticals' grammar."""
  jobs = [(t, s) for t in tasks.DESKTOP_TASKS for s in (21, 22)]
  stats, w = _collect(desk.url, jobs)
  assert {t: (s.episodes, s.successes) for t, s in stats.items()} == {t: (2, 2) for t in tasks.DESKTOP_TASKS}
  assert sorted((ep.task, ep.seed) for ep, _ in w.episodes) == sorted(jobs)
  for ep, prov in w.episodes:
    assert prov["source"] == "expert" and ep.success and ep.turns[-1].env_reward == 1.0
    assert ep.instruction == tasks.make(ep.task, ep.seed)[0].instruction


def test_hybrid_experts_play_real_sessions_with_sdk_calls(desk):
  """One seed of each hybrid task but the browser one: GUI clicks and typing plus SDK calls, each
  episode a success whose SDK turns came back with tool output."""
  names = [t for t in tasks.HYBRID_TASKS if t != "hybrid/browser-download-total"]
  stats, w = _collect(desk.url, [(t, 4) for t in names])
  assert {t: s.successes for t, s in stats.items()} == {t: 1 for t in names}
  for ep, _ in w.episodes:
    sdk_turns = [t for t in ep.turns if A.is_sdk(A.parse(t.text, sdk=True))]
    assert sdk_turns and all(t.info.get("tool_output") for t in sdk_turns), ep.task


@pytest.mark.browser
def test_download_expert_plays_a_real_session(desk):
  stats, _ = _collect(desk.url, [("hybrid/browser-download-total", 4)])
  assert stats["hybrid/browser-download-total"].successes == 1


def test_collect_keeps_within_the_servers_sessions():
  """Three episodes at once on a desktop server of one session: `collect` holds them to its
  `max_sessions` (health), so none is lost to ServerBusy replies using up its retries."""
  with launch_server("envs_bridge.desktop.server", step_ms=300, lease_s=120.0, max_sessions=1) as one:
    config = verticals.get_config("sft+smoke")
    from tars_jax.train import state as state_lib
    spec = demos.DemoSpec.from_parts(state_lib.build(config))

    async def go():
      async with SandboxClient(one.url) as c:
        caps = await demos.session_caps([c])
        stats = await demos.collect([c], [("desktop/dialog-choose", s) for s in range(3)], spec, demos.MemoryWriter(),
                                    concurrency=3, progress=False)
        return caps, stats
    caps, stats = asyncio.run(go())
  assert [s._value for s in caps.values()] == [1]
  st = stats["desktop/dialog-choose"]
  assert (st.episodes, st.successes, st.lost) == (3, 3, 0)
