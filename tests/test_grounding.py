"""Grounding and perception data (tars_jax/data/sources/grounding.py, experiments/grounding.py).

Pure logic on element lists copied from real sandbox pages (click-checkboxes, login-user seeds of
`SandboxClient.elements`), with hand-worked grid points; then real pages: the computed "where" click,
sent through the sandbox, earns the page's own reward on click-test / click-button / click-link /
click-tab, and the CLI's collection over a real server writes what it counts.
"""

import collections
import itertools
import json
import math
import os
import re

import numpy as np
import pytest

from envs_bridge.client import SandboxClient
from tars_jax.agent import prompts
from tars_jax.agent.grammar import accepts, build_grammar, walk
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import episode_arrays
from tars_jax.data.sources import grounding as G
from _shared import run

TOK = ByteTokenizer()
W, H = 160, 210
SYSTEM = "GUI agent. Actions: click,finished."


def el(tag, text="", box=(0, 0, 10, 10), leaf=True, type="", id="", classes="", value=""):
  x, y, w, h = box
  return dict(tag=tag, id=id, classes=classes, type=type, text=text, value=value, checked=False,
              focused=False, leaf=leaf, x=x, y=y, width=w, height=h)


# click-checkboxes, seed 1 (boxes as the sandbox reports them)
CHECKBOXES = [
    el("div", "Select HF2 and click Submit.", (0, 0, 160, 50), id="query"),
    el("div", "AU HF2 Submit", (0, 50, 160, 84), leaf=False, id="area"),
    el("div", "AU HF2", (2, 52, 156, 38), leaf=False, id="boxes"),
    el("label", "AU", (2, 59, 46, 11), leaf=False),
    el("input", "", (6, 55, 20, 13), type="checkbox", id="ch0"),
    el("label", "HF2", (2, 78, 61, 11), leaf=False),
    el("input", "", (6, 74, 20, 13), type="checkbox", id="ch1"),
    el("button", "Submit", (2, 101, 95, 31), id="subbtn", classes="secondary-action"),
]
# login-user: its instruction bar holds a bold "username" (so a plain "Username" is ambiguous)
LOGIN = [
    el("div", 'Enter the username "karrie" and the password "AU" into the text fields and press login.',
       (0, 0, 160, 50), leaf=False, id="query"),
    el("span", "username", (46, 3, 47, 11), classes="bold"),
    el("span", "password", (20, 14, 47, 11), classes="bold"),
    el("div", "Username Password Login", (2, 62, 156, 135), leaf=False, id="form"),
    el("label", "Username", (2, 62, 48, 11), classes="bold"),
    el("input", "", (7, 78, 128, 21), type="text", id="username"),
    el("label", "Password", (2, 114, 47, 11), classes="bold"),
    el("input", "", (7, 130, 108, 21), type="password", id="password"),
    el("button", "Login", (2, 166, 87, 31), id="subbtn"),
]


def targets(els, **kw):
  kw = {"coord_format": "tens3", "max_content_bytes": 16, **kw}
  return G.page_targets(els, (W, H), **kw)


def test_grid_point_is_the_nearest_grid_point_inside_the_box_by_brute_force():
  rng = np.random.default_rng(0)
  for fmt, size in itertools.product(("tens3", "fixed3", "int"), (160, 210)):
    top, step = G.GRID[fmt]
    grid = np.arange(0, top + 1, step)
    pix = grid / 1000 * size
    for _ in range(300):
      lo = rng.uniform(-5, size)
      hi = lo + rng.uniform(0, 6) ** 2
      got = G.grid_value_inside(lo, hi, size, fmt)
      inside = grid[(pix >= lo - 1e-9) & (pix <= hi + 1e-9)]
      if inside.size == 0:
        assert got is None, (fmt, lo, hi)
      else:
        best = np.abs(inside / 1000 * size - (lo + hi) / 2).min()
        assert got in inside and abs(got / 1000 * size - (lo + hi) / 2) == pytest.approx(best, abs=1e-9)


def test_grid_point_hand_worked():
  # Submit (2, 101, 95, 31), 1 px margin: x [3, 96] px, centre 49.5 px = 309.4 -> 310; y centre 116.5 px
  # = 554.8 -> 550 (and 550 / 1000 * 210 = 115.5 px lies in [102, 131])
  assert G.grid_point((2, 101, 95, 31), (W, H), "tens3") == (310, 550)
  assert G.grid_point((2, 101, 95, 31), (W, H), "fixed3") == (309, 555)
  # 1.2 px between the 1.6 px grid steps 70 (11.2 px) and 80 (12.8 px): nothing to hit
  assert G.grid_point((11.4, 100, 1.2, 30), (W, H), "tens3", margin_px=0) is None
  # a box at the right edge: 990 (158.4 px) is the last 'tens3' column; 'int' reaches 1000
  assert G.grid_point((157.5, 100, 2.5, 30), (W, H), "tens3", margin_px=0)[0] == 990
  assert G.grid_point((158.6, 100, 1.4, 30), (W, H), "tens3", margin_px=0) is None
  assert G.grid_point((158.6, 100, 1.4, 30), (W, H), "int", margin_px=0)[0] == 996
  with pytest.raises(ValueError, match="coord_format"):
    G.grid_point((0, 0, 10, 10), (W, H), "hex")


def test_checkbox_page_targets():
  sk = collections.Counter()
  got = [(t.kind, t.instruction, t.reply) for t in targets(CHECKBOXES, skipped=sk)]
  assert got == [
      # x [7, 25] px -> 100; y [56, 67] px, centre 61.5 px = 292.9 -> 290
      ("where", 'Where is the checkbox "AU"?', "Thought: \nAction: click(start_box='(100,290)')"),
      ("where", 'Where is the checkbox "HF2"?', "Thought: \nAction: click(start_box='(100,380)')"),
      ("where", 'Where is the button "Submit"?', "Thought: \nAction: click(start_box='(310,550)')"),
      ("what", "What is at (310,550)?", "Thought: \nAction: finished(content='Submit')"),
  ]
  assert sk == {"what/text": 1}  # the instruction bar's 28 characters do not fit 16 content bytes
  grammar = build_grammar(TOK, ("click", "finished"), max_thought_bytes=0, max_content_bytes=16,
                          coord_format="tens3")
  assert all(accepts(grammar, r) for _, _, r in got)


def test_login_page_targets_fields_by_label_and_ambiguity():
  sk = collections.Counter()
  got = [(t.kind, t.instruction, t.reply[18:]) for t in targets(LOGIN, skipped=sk)]
  assert got == [
      ("what", "What is at (430,040)?", "finished(content='username')"),  # x centre 69.5 px = 434 -> 430
      ("what", "What is at (270,090)?", "finished(content='password')"),
      ("what", "What is at (160,320)?", "finished(content='Username')"),
      ("where", 'Where is the text field "Username"?', "click(start_box='(440,420)')"),
      ("what", "What is at (160,570)?", "finished(content='Password')"),
      ("where", 'Where is the text field "Password"?', "click(start_box='(380,670)')"),
      ("where", 'Where is the button "Login"?', "click(start_box='(280,860)')"),
      ("what", "What is at (280,860)?", "finished(content='Login')"),
  ]
  # the plain labels read like the bar's bold words: "Where is "Username"?" has two answers
  assert sk == {"where/ambiguous": 2}
  # without the bar's words, the labels are unique and asked for; the bar is never a 'where' target
  plain = [t.instruction for t in targets([e for e in LOGIN if e["classes"] != "bold" or e["y"] > 50])]
  assert 'Where is "Username"?' in plain and 'Where is "Password"?' in plain


def test_skips_ambiguous_overlapping_and_unwritable():
  els = [
      el("button", "okay", (2, 63, 44, 21)), el("button", "okay", (46, 63, 44, 21)),  # same role and name
      el("span", "it's", (2, 90, 30, 11)),  # a quote: no 'what', but a fine 'where'
      el("span", "a" * 17, (2, 105, 100, 11)),  # 17 bytes > 16: no 'what'
      # an inline span wrapped over two lines: its box covers the name beside it
      el("span", "Carmella", (9, 150, 42, 11)), el("span", "10h ago", (9, 151, 124, 21)),
      el("input", "", (2, 180, 60, 20), type="text"), el("input", "", (80, 180, 60, 20), type="text"),
      el("span", "x", (100, 90, 1.0, 11)),  # narrower than a grid step
  ]
  sk = collections.Counter()
  got = [(t.kind, t.instruction) for t in targets(els, skipped=sk)]
  # the second "okay": x [47, 89] px, centre 68 px = 425 -> 420 (round half to even)
  assert got == [("what", "What is at (150,350)?"), ("what", "What is at (420,350)?"),
                 ("where", "Where is \"it's\"?"), ("where", f'Where is "{"a" * 17}"?')]
  assert sk == {"where/ambiguous": 4, "what/text": 2, "where/overlap": 2, "what/overlap": 2,
                "where/too_small": 1, "what/too_small": 1}
  # click-test-2 seed 2: buttons placed at random overlap at a corner; both centres are clear
  both = [el("button", "ONE", (43, 121, 40, 40)), el("button", "TWO", (26, 87, 40, 40))]
  assert [t.instruction for t in targets(both)] == ['Where is the button "ONE"?', "What is at (390,670)?",
                                                    'Where is the button "TWO"?', "What is at (290,510)?"]
  # one unnamed text field is asked for by its role
  assert [t.instruction for t in targets(els[6:7])] == ["Where is the text field?"]
  with pytest.raises(ValueError, match="unknown kinds"):
    targets(els, kinds=("why",))
  with pytest.raises(ValueError, match="lacks"):
    targets([{"tag": "div"}])


def _fmt(grammar_actions=("click", "finished"), n_img=4, hw=(56, 42)):
  grammar = build_grammar(TOK, grammar_actions, max_thought_bytes=0, max_content_bytes=16, coord_format="tens3")
  return G.EpisodeFormat(TOK, SYSTEM, n_img, hw, grammar, "tens3", 16)


def _page(els=CHECKBOXES, task="miniwob/click-checkboxes", seed=1):
  img = np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8)
  return G.Page(task, seed, "Select HF2 and click Submit.", img, els)


def test_episodes_are_the_agent_loops_first_turn():
  fmt = _fmt()
  exs = G.page_examples(fmt, _page())
  assert [e.target.kind for e in exs] == ["where", "where", "where", "what"]
  template = prompts.ChatTemplate(TOK, SYSTEM, n_img_tokens=4)  # the chat layout's own reference
  for ex in exs:
    ep, t = ex.episode, ex.target
    ids, mask = template.episode(t.instruction, [(None, t.reply)])
    assert ep.token_ids() == ids and ep.instruction == t.instruction
    assert episode_arrays(ep)["loss"].tolist() == [float(m) for m in mask]
    (turn,) = ep.turns
    assert turn.obs_ids == prompts.encode_observation(TOK, 4)  # what agent_loop's first turn uses
    assert turn.reply_ids[-1] == TOK.eos_id and TOK.decode(turn.reply_ids) == t.reply
    assert turn.image.shape == (56, 42, 3) and turn.image.dtype == np.uint8
    assert np.array_equal(turn.states, walk(fmt.grammar, turn.reply_ids)) and (turn.states >= 0).all()
    assert turn.logprobs.shape == (len(turn.reply_ids),)
    assert ex.extra() == {"kind": t.kind, "box": list(t.box), "text": t.text, "role": t.role,
                          "point": list(t.point), "screen_wh": [W, H]}
  assert G.count_examples(exs) == {"miniwob/click-checkboxes": {"where": 3, "what": 1}}
  with pytest.raises(ValueError, match="does not accept"):  # a click-only policy cannot answer 'what'
    G.page_examples(_fmt(("click",)), _page())


def _scripted(answer):
  """act_fn answering each prompt with answer(instruction) + EOS."""
  def act(prompt_ids, images):
    assert all(len(im) == 1 and im[0].shape == (56, 42, 3) for im in images)
    out = []
    for p in prompt_ids:
      instr = TOK.decode(p).split("\n")[1]  # BOS system \n instruction \n ...
      ids = TOK.encode(answer(instr)) + [TOK.eos_id]
      out.append((ids, np.zeros(len(ids)), np.zeros(len(ids), np.int32)))
    return out
  return act


def test_grounding_accuracy_scores_scripted_policies():
  fmt = _fmt()
  exs = G.page_examples(fmt, _page()) + G.page_examples(fmt, _page(LOGIN, "miniwob/login-user", 2))
  truth = {e.target.instruction: e.target.reply for e in exs}
  n = {"n_where": 6, "n_what": 6}
  assert G.grounding_accuracy(_scripted(truth.get), exs) == {"where_hit": 1.0, "what_exact": 1.0, **n}
  wrong = lambda i: ("Thought: \nAction: click(start_box='(000,000)')" if i.startswith("Where")
                     else "Thought: \nAction: finished(content='nope')")
  assert G.grounding_accuracy(_scripted(wrong), exs, chunk=5) == {"where_hit": 0.0, "what_exact": 0.0, **n}
  # the right answer in other case and spacing still counts; a reply that does not parse does not
  def sloppy(i):
    if i.startswith("Where"):
      return "click here"
    content = re.search(r"content='(.*)'", truth[i]).group(1)
    return f"Thought: \nAction: finished(content=' {content.upper()}  ')"
  assert G.grounding_accuracy(_scripted(sloppy), exs) == {"where_hit": 0.0, "what_exact": 1.0, **n}
  # records' (episode, extra) pairs, the extra also nested in a provenance dict
  pairs = [(e.episode, e.extra()) for e in exs[:3]] + [(e.episode, {"extra": e.extra()}) for e in exs[3:]]
  assert G.grounding_accuracy(_scripted(truth.get), pairs)["where_hit"] == 1.0
  nan = G.grounding_accuracy(_scripted(truth.get), [e for e in exs if e.target.kind == "where"])
  assert nan["n_what"] == 0 and math.isnan(nan["what_exact"])


def test_score_reply_box_edges():
  extra = {"kind": "where", "box": [2, 101, 95, 31], "text": "Submit"}
  click = lambda x, y: f"Thought: \nAction: click(start_box='({x},{y})')"
  assert G.score_reply(click(310, 550), extra)  # (49.6, 115.5) px
  assert G.score_reply(click(600, 550), extra)  # x = 96.0 px <= 97
  assert not G.score_reply(click(610, 550), extra)  # x = 97.6 px
  assert not G.score_reply(click(310, 630), extra)  # y = 132.3 px > 132
  assert not G.score_reply("Thought: \nAction: finished(content='Submit')", extra)
  with pytest.raises(ValueError, match="kind"):
    G.score_reply(click(0, 0), {"kind": "how"})


def test_split_jobs_disjoint_seeds():
  train, held = G.split_jobs(["a", "b"], 3, 2, 100, heldout_tasks=["c"])
  assert train == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
  assert held == [("a", 100), ("a", 101), ("b", 100), ("b", 101), ("c", 100), ("c", 101)]
  with pytest.raises(ValueError, match="overlap"):
    G.split_jobs(["a"], 50, 10, 40)
  with pytest.raises(ValueError, match="both"):
    G.split_jobs(["a"], 1, 1, 10, heldout_tasks=["a"])


# ---------------------------------------------------------------------------------------------------
# Real sandbox pages

# The element each task's instruction asks to click: (regex on the instruction -> (role, name)).
_ASKED = {
    "miniwob/click-test": lambda s: ("button", "Click Me!"),
    "miniwob/click-test-2": lambda s: ("button", re.search(r"button (\w+)", s).group(1)),
    "miniwob/click-button": lambda s: ("button", re.search(r'"(.+)" button', s).group(1)),
    "miniwob/click-link": lambda s: ("link", re.search(r'link "(.+)"', s).group(1)),
    "miniwob/click-tab": lambda s: ("tab", re.search(r"on (Tab #\d+)", s).group(1)),
}


@pytest.mark.browser
def test_where_clicks_earn_the_pages_reward(server):
  """The 'where' reply for the element a task asks for, sent as the agent's action, gets the page's
  own reward; so does a click at the 'what' question's point, whose answer is the asked name."""
  async def go():
    checked = collections.Counter()
    async with SandboxClient(server.url) as c:
      for task, seed in itertools.product(_ASKED, range(4)):
        sid, obs = await c.open(task, seed)
        els = await c.elements(sid)
        role, name = _ASKED[task](obs.info["instruction"])
        ts = G.page_targets(els, (W, H), coord_format="tens3", max_content_bytes=16)
        where = [t for t in ts if t.kind == "where" and (t.role, t.text) == (role, name)]
        what = [t for t in ts if t.kind == "what" and t.text == name and t.role == role]
        if not where:  # skipped on this page (e.g. click-link's "eget" beside "Eget")
          await c.close(sid)
          continue
        out = await c.step(sid, where[0].reply)
        assert out.done and out.reward > 0, (task, seed, where[0])
        checked[task] += 1
        if what:  # the question's point is the same element: clicking there also rewards
          sid2, _ = await c.open(task, seed)
          x, y = what[0].point
          out = await c.step(sid2, f"Thought: \nAction: click(start_box='({x:03d},{y:03d})')")
          assert out.done and out.reward > 0, (task, seed, what[0])
          checked["what"] += 1
    assert all(checked[t] >= 2 for t in _ASKED) and checked["what"] >= 8, checked
  run(go())


@pytest.mark.browser
def test_cli_collects_both_splits_from_a_real_server(server, tmp_path):
  from tars_jax.data.sources import grounding_collect as cli
  from experiments.configs.miniwob_ppo import get_config
  sinks = {}

  def sink_factory(directory, fmt):
    sinks[os.path.basename(directory)] = s = cli.CountingSink(keep=True)
    return s

  tasks = ["miniwob/click-checkboxes", "miniwob/login-user"]
  summary = cli.run(get_config(""), str(tmp_path), tasks, seeds=2, heldout_seeds=1, heldout_offset=500,
                    heldout_tasks=["miniwob/click-button"], servers=[server.url], concurrency=3,
                    sink_factory=sink_factory)
  with open(tmp_path / "grounding.json") as f:
    assert json.load(f)["train"]["counts"] == summary["train"]["counts"]
  assert summary["format"]["grammar_actions"] == ["click", "finished"]  # 'finished' added for 'what'
  grammar = build_grammar(TOK, ("click", "finished"), max_thought_bytes=0, max_content_bytes=16,
                          coord_format="tens3")
  off = get_config("").data.grounding_seed_offset  # training pages apart from PPO's and evaluation's seeds
  for name, seeds, all_tasks in (("train", {off, off + 1}, tasks), ("heldout", {500}, tasks + ["miniwob/click-button"])):
    exs = sinks[name].examples
    assert summary[name]["pages"] == len(seeds) * len(all_tasks) and summary[name]["lost"] == 0
    assert {e.episode.seed for e in exs} == seeds and {e.episode.task for e in exs} == set(all_tasks)
    assert {t: dict(c) for t, c in G.count_examples(exs).items()} == summary[name]["counts"]
    assert all(accepts(grammar, e.target.reply) for e in exs)
    assert all(e.episode.turns[0].image.shape == (224, 168, 3) for e in exs)
    assert all(e.episode.prefix_ids[:len(SYSTEM) + 1] == [TOK.bos_id] + TOK.encode(SYSTEM) for e in exs)
  # login-user: the two fields and the button in every page (hand-checked above)
  assert summary["train"]["counts"]["miniwob/login-user"]["where"] >= 6


@pytest.mark.browser
def test_where_clicks_check_boxes_and_focus_fields(server):
  """Clicking a 'where' checkbox / radio button checks that very element, and clicking a 'where'
  text field focuses it, as the page's own DOM state reports after the step."""
  async def go():
    seen = collections.Counter()
    async with SandboxClient(server.url) as c:
      for task, seed in itertools.product(("miniwob/click-checkboxes", "miniwob/click-option",
                                           "miniwob/login-user", "miniwob/enter-password"), range(2)):
        sid, obs = await c.open(task, seed)
        els = await c.elements(sid)
        for t in G.page_targets(els, (W, H), coord_format="tens3", max_content_bytes=16):
          if t.kind != "where" or t.role not in ("checkbox", "radio button", "text field"):
            continue
          out = await c.step(sid, t.reply)
          assert not out.done
          after = {(e["x"], e["y"], e["width"], e["height"]): e for e in await c.elements(sid)}
          e = after[t.box]
          state = "checked" if t.role != "text field" else "focused"
          assert e[state], (task, seed, t)
          seen[t.role] += 1
        await c.close(sid)
    assert seen["checkbox"] >= 4 and seen["radio button"] >= 4 and seen["text field"] >= 8, seen
  run(go())


@pytest.mark.slow
def test_grounding_accuracy_runs_the_real_batched_policy():
  """The SFT trainer's call: a config's own batched policy (random init, smoke model) samples replies
  for the examples' prompts and images; every reply is in the grammar, so each is scored."""
  from tars_jax.data.sources import grounding_collect as cli
  from experiments.configs.miniwob_ppo import get_config
  from tars_jax.train.state import build
  parts = build(cli.grounding_config(get_config("smoke"), G.KINDS))
  fmt = G.EpisodeFormat.from_parts(parts)
  assert fmt.system == "GUI agent. Actions: click,finished." and fmt.image_hw == (224, 168)
  exs = G.page_examples(fmt, _page()) + G.page_examples(fmt, _page(LOGIN, "miniwob/login-user", 2))
  policy = parts.batched_policy(parts.init_state(0)["policy"], batch_size=8, seed=0)
  replies = []

  def act(prompt_ids, images):
    out = policy.act(prompt_ids, images)
    replies.extend(TOK.decode(ids) for ids, _, _ in out)
    return out
  res = G.grounding_accuracy(act, exs)
  assert (res["n_where"], res["n_what"]) == (6, 6) and 0 <= res["where_hit"] <= 1 and 0 <= res["what_exact"] <= 1
  assert len(replies) == 12 and all(accepts(parts.grammar, r) for r in replies)
  hits = [G.score_reply(r, e.extra()) for r, e in zip(replies, exs)]
  assert res["where_hit"] == np.mean([h for h, e in zip(hits, exs) if e.target.kind == "where"])
