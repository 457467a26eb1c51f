"""Interactive annotation (`experiments/annotate.py`, `tars_jax/data/sources/annotation*.py`): the task
queue and the override composition as pure logic; then the real server (a tiny policy, a real sandbox
server with a token, real Chromium): several annotators at once, a refused override, a double
submission, a closed episode kept as incomplete, a killed browser recovered; and the page itself driven
by Playwright: accept a candidate, override with a click on the screenshot and a typed thought, finish,
and read the record back turn by turn."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from envs_bridge.launch import launch_server
from tars_jax.agent import actions as A
from tars_jax.agent.grammar import build_grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import episode_arrays
from tars_jax.data import records
from tars_jax.data.sources import annotation as ann

from test_distributed import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "annotate-token"
TOK = ByteTokenizer()


# ---- pure logic ----------------------------------------------------------------------------------------

def test_queue_offers_the_weakest_task_first_and_never_repeats_a_seed(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  (run / "eval_old.json").write_text(json.dumps({"results": {"t/a": {"success": 0.1}, "t/b": {"success": 0.9}}}))
  time.sleep(0.01)
  (run / "eval.json").write_text(json.dumps({"results": {"t/a": {"success": 0.8}, "t/b": {"success": 0.3}}}))
  q = ann.TaskQueue(["t/a", "t/b", "t/c"], str(run), [str(tmp_path / "out")])
  assert q.order == ["t/c", "t/b", "t/a"]  # no evaluation counts as 0; then the newest JSON's success
  assert [q.next() for _ in range(4)] == [("t/c", ann.SEED_OFFSET + 200_000), ("t/b", ann.SEED_OFFSET + 100_000),
                                          ("t/a", ann.SEED_OFFSET), ("t/c", ann.SEED_OFFSET + 200_001)]
  assert q.next("t/b") == ("t/b", ann.SEED_OFFSET + 100_001)
  with pytest.raises(ValueError, match="not one of"):
    q.next("t/unknown")
  assert all(s >= ann.SEED_OFFSET for _, s in [q.next() for _ in range(3)])


def test_an_override_is_the_grammars_text_or_refused():
  g = build_grammar(actions=("click", "type", "finished"), max_thought_bytes=24, max_content_bytes=8,
                    coord_format="tens3")
  r = ann.override_reply(g, TOK, "tens3", "the OK button", "click", x=0.5, y=0.25, screen_wh=(160, 210))
  thought, act = A.parse_response(r.text)
  assert thought == "the OK button" and isinstance(act, A.Click)
  assert abs(act.x - 0.5) < 0.02 and abs(act.y - 0.25) < 0.02  # one conversion, to the tens3 grid
  assert r.ids[-1] == TOK.eos_id and (r.states >= 0).all() and not r.logprobs.any()
  assert ann.override_reply(g, TOK, "tens3", "", "type", content="Bob").text == "Thought: \nAction: type(content='Bob')"
  with pytest.raises(ann.BadOverride, match="needs a point on the screenshot"):
    ann.override_reply(g, TOK, "tens3", "", "click", x=1.2, y=0.5)
  with pytest.raises(ann.BadOverride, match="grammar does not accept"):
    ann.override_reply(g, TOK, "tens3", "a thought far longer than twenty-four bytes", "finished")
  with pytest.raises(ann.BadOverride, match="does not parse"):
    ann.override_reply(g, TOK, "tens3", "", "click(nowhere)")


# ---- the real server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """A run dir of the smoke model (random init) on click-test and enter-text, with thoughts; clicks only
  (every candidate of the random policy is a click, so the page test can pick one that misses)."""
  from experiments.configs import miniwob_ppo
  from tars_jax.train import checkpoint as ckpt
  from tars_jax.train import state as state_lib
  run = tmp_path_factory.mktemp("ann") / "run"
  c = miniwob_ppo.get_config("smoke")
  c.tasks = ("miniwob/click-test", "miniwob/enter-text")
  c.grammar.actions = ("click",)
  c.grammar.max_thought_bytes = 32
  c.env.max_turns = 4
  os.makedirs(run)
  (run / "config.json").write_text(c.to_json_best_effort())
  parts = state_lib.build(c)
  mngr = ckpt.manager(str(run), 1)
  ckpt.save(mngr, 1, parts.init_state(c.seed), {"iteration": 1})
  mngr.wait_until_finished()
  return run


@pytest.fixture(scope="module")
def server(tiny_run):
  """experiments/annotate.py on the tiny run against a sandbox server with a token."""
  env = dict(os.environ, PYTHONPATH=ROOT, TARS_SANDBOX_TOKEN=TOKEN)
  with launch_server(token=TOKEN, lease_s=120.0) as sandbox:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.annotate", "--run", str(tiny_run), "--port",
                             str(port), "--servers", sandbox.url, "--candidates", "4"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        pass
      if proc.poll() is not None or time.time() > deadline:
        proc.kill()
        pytest.fail(proc.stdout.read())
      time.sleep(0.5)
    yield url, sandbox
    proc.terminate()
    proc.wait(timeout=60)


def _api(url, method, path, body=None, token=TOKEN):
  return httpx.request(method, url + path, json=body, timeout=300,
                       headers={"authorization": f"Bearer {token}"} if token else {})


def _records(directory):
  return [(ep, prov) for ep, prov in records.read_episodes(str(directory))] if os.path.exists(
      os.path.join(directory, records.INDEX_FILE)) else []


@pytest.mark.slow  # ~90 s: the annotation server compiles the tiny policy; real Chromium
@pytest.mark.browser
def test_annotators_decisions_and_faults_through_the_api(server, tiny_run):
  url, sandbox = server
  assert _api(url, "POST", "/api/sessions", {"annotator": "ann"}, token="wrong").status_code == 401
  # two annotators at once: their own sessions, the queue's weakest task, distinct seeds
  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    a, b = [f.result().json() for f in [ex.submit(_api, url, "POST", "/api/sessions", {"annotator": n})
                                         for n in ("alice", "bob")]]
  assert a["status"] == b["status"] == "deciding" and a["id"] != b["id"] and a["seed"] != b["seed"]
  assert len(a["candidates"]) == 4 and a["turn"] == 0 and a["screenshot_png_b64"]
  # an override the grammar refuses: 422, nothing executed
  r = _api(url, "POST", f"/api/sessions/{a['id']}/decide", {"turn": 0, "thought": "", "action": "click", "x": 1.5,
                                                            "y": 0.5})
  assert r.status_code == 422 and "point on the screenshot" in r.json()["reason"]
  r = _api(url, "POST", f"/api/sessions/{a['id']}/decide", {"turn": 0, "action": "type", "content": "x"})
  assert r.status_code == 422 and "grammar does not accept" in r.json()["reason"]  # clicks only here
  assert _api(url, "GET", f"/api/sessions/{a['id']}").json()["history"] == []
  # two submissions for the same turn: one runs, the other is told the turn moved on. Both accept a
  # candidate whose click misses the button, so the episode goes on (a hit would end it as complete)
  box = _button_box(sandbox, a["sandbox_session"])
  k = next(i for i, c in enumerate(a["candidates"]) if c["click"] and not _inside(c["click"], box, a["screen_wh"]))
  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    rs = [f.result() for f in [ex.submit(_api, url, "POST", f"/api/sessions/{a['id']}/decide",
                                         {"turn": 0, "accept": k}) for _ in range(2)]]
  assert sorted(r.status_code for r in rs) == [200, 409]
  moved = next(r for r in rs if r.status_code == 409).json()
  assert moved["error"] == "TurnMovedOn" and "turn 0 is not waiting" in moved["reason"]
  assert len(_api(url, "GET", f"/api/sessions/{a['id']}").json()["history"]) == 1  # one ran
  # the browser is killed -9 under bob's episode: his next step recovers (re-open, replay) and is marked
  pid = httpx.get(sandbox.url + "/health").json()["browsers"][0]["pid"]
  os.kill(pid, signal.SIGKILL)
  sb = _api(url, "POST", f"/api/sessions/{b['id']}/decide", {"turn": 0, "thought": "look", "action": "click",
                                                             "x": 0.03, "y": 0.97}).json()
  assert sb["recovered"] == 1 and sb["history"][0]["overridden"] and sb["status"] in ("deciding", "done")
  # closed half-way: written to incomplete/, never to the training directory
  for s in (a, b):
    closed = _api(url, "POST", f"/api/sessions/{s['id']}/close").json()
    assert closed["status"] in ("incomplete", "done")
  inc = _records(tiny_run / "annotations" / "incomplete")
  by_annotator = {prov["extra"]["annotator"]: (ep, prov) for ep, prov in inc}
  ep, prov = by_annotator["alice"]
  assert prov["source"] == "annotation" and prov["extra"]["complete"] is False and len(ep.turns) == 1
  t0 = prov["extra"]["turns"][0]
  assert t0["overridden"] is False and t0["accepted"] == k and len(t0["candidates"]) == 4
  assert ep.turns[0].text == t0["candidates"][t0["accepted"]]["text"]
  assert by_annotator["bob"][1]["extra"]["recovered"] == 1
  # a newer policy (here the same run, re-read) and its queue: the run's newest checkpoint and eval JSON
  (tiny_run / "eval.json").write_text(json.dumps({"results": {"miniwob/click-test": {"success": 0.9},
                                                              "miniwob/enter-text": {"success": 0.1}}}))
  re = _api(url, "POST", "/api/reload", {}).json()
  assert re["version"] == 1 and re["order"] == ["miniwob/enter-text", "miniwob/click-test"]
  (tiny_run / "eval.json").unlink()


@pytest.mark.slow  # ~60 s with the server above: a real page in headless Chromium
@pytest.mark.browser
def test_the_page_accept_override_finish_and_the_record(server, tiny_run, tmp_path):
  from playwright.sync_api import sync_playwright

  from envs_bridge.browser import sessions as S
  url, sandbox = server
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=S.DEFAULT_CHROMIUM, args=S.CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.goto(url)
    page.fill("#token", TOKEN)
    page.fill("#annotator", "carol")
    page.select_option("#task", "miniwob/click-test")
    page.click("#start")
    page.wait_for_selector(".candidate")
    sid = next(k for k, v in _api(url, "GET", "/health").json()["sessions"].items() if v == "deciding")
    st = _api(url, "GET", f"/api/sessions/{sid}").json()
    box = _button_box(sandbox, st["sandbox_session"])
    # accept a candidate whose click misses the button (the episode goes on)
    k = next(i for i, c in enumerate(st["candidates"]) if c["click"] and not _inside(c["click"], box, st["screen_wh"]))
    page.click(f'button.accept[data-k="{k}"]')
    page.wait_for_function("document.querySelectorAll('#history li').length == 1")
    # override: a typed thought and a click on the button in the screenshot
    canvas = page.locator("#shot").bounding_box()
    w, h = st["screen_wh"]
    cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.click(canvas["x"] + cx / w * canvas["width"], canvas["y"] + cy / h * canvas["height"])
    page.fill("#thought", "the button is here")
    page.select_option("#action", "click")
    page.screenshot(path=str(tmp_path / "annotation_page.png"))
    page.click("#override")
    page.wait_for_function("document.querySelector('#result').textContent.includes('episode done')")
    browser.close()
  eps = {prov["extra"]["annotator"]: (ep, prov) for ep, prov in _records(tiny_run / "annotations")}
  ep, prov = eps["carol"]
  t = prov["extra"]["turns"]
  assert prov["source"] == "annotation" and prov["extra"]["complete"] is True and ep.task == "miniwob/click-test"
  assert len(ep.turns) == 2 and t[0]["accepted"] == k and not t[0]["overridden"] and t[1]["overridden"]
  assert ep.turns[0].text == st["candidates"][k]["text"]
  thought, act = A.parse_response(ep.turns[1].text)
  assert thought == "the button is here" and isinstance(act, A.Click)
  assert _inside((act.x, act.y), box, st["screen_wh"]) and ep.turns[1].done and ep.turns[1].env_reward > 0
  assert not np.any(ep.turns[1].logprobs)  # the annotator's reply: no behaviour log-probs
  # what the SFT stage reads (`records.episodes`, the stream under experiments/sft.py): the same
  # episode, its loss on exactly the two replies' tokens, the screenshots as recorded
  (same,) = [e for e, _ in records.episodes(str(tiny_run / "annotations")) if e.seed == ep.seed]
  flat = episode_arrays(same)
  assert ep.turns[1].reply_ids == TOK.encode(ep.turns[1].text) + [TOK.eos_id]
  assert flat["loss"].sum() == sum(len(x.reply_ids) for x in ep.turns)
  for x, y in zip(same.turns, ep.turns):
    np.testing.assert_array_equal(x.image, y.image)


def _button_box(sandbox, sandbox_session):
  r = httpx.get(f"{sandbox.url}/debug/sessions/{sandbox_session}/element_box", params={"selector": "#subbtn"},
                headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
  r.raise_for_status()
  return r.json()["box"]


def _inside(unit_xy, box, screen_wh):
  x, y = unit_xy[0] * screen_wh[0], unit_xy[1] * screen_wh[1]
  return box["x"] <= x <= box["x"] + box["width"] and box["y"] <= y <= box["y"] + box["height"]
