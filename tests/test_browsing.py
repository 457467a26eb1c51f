"""GUI-Browsing tasks (issue #26 item 1): question generation over Debian's Python documentation
(envs_bridge/browser/browsing.py), the 'browse/<family>' tasks of the browser sandbox
(browse_tasks.py) and their scripted expert (tars_jax/data/sources/browse_expert.py).

Pure logic first: normalised match; a hand-made corpus of Sphinx-like pages whose filter outcomes are
known (an orphan page -> unreachable, an answer printed on the start page -> trivial); the real
corpus's suite (>= 200 questions, disjoint held-out split, every answer read again from its page,
every plan made of followable links). Then the real sandbox with real Chromium: the expert solves
held-out questions with the reward read from the sandbox, a wrong answer gets 0, scrolling and the
search box work through the normal action set, and a link-following episode is reproducible.
"""

import base64
import json
import os
import urllib.request

import pytest

from envs_bridge import protocol as P
from envs_bridge.browser import browse_tasks as bt
from envs_bridge.browser import browsing as B
from envs_bridge.browser import tasks
from envs_bridge.client import SandboxClient
from tars_jax.agent import actions as A
from tars_jax.data.sources import browse_expert as X
from tars_jax.data.sources import experts as E

from _shared import run

try:
  B.corpus_dir()
  HAVE_CORPUS = True
except B.CorpusMissing:
  HAVE_CORPUS = False
needs_corpus = pytest.mark.skipif(not HAVE_CORPUS, reason="python3-doc not installed (scripts/setup.sh)")


# -- normalised exact match ---------------------------------------------------------------------------
def test_normalize_drops_case_punctuation_and_whitespace():
  assert B.normalize("Lib/json/__init__.py") == "libjsoninitpy"
  assert B.normalize("  Basic\tUsage! ") == "basicusage"
  assert B.normalize("__name__ == '__main__'") == "name==main"  # '=' is a symbol, not punctuation
  assert B.normalize("Ｌｉｂ") == "lib"  # NFKC: full-width letters
  assert B.matches("basic usage", "Basic Usage") and B.matches("'Basic Usage.'", "Basic Usage")
  assert not B.matches("Basic Usages", "Basic Usage") and not B.matches("", "") and not B.matches("x", "")
  assert B.visible_in("Basic Usage", "See the basic usage, below") and not B.visible_in("Basic Usage", "basic usages")


# -- a hand-made corpus -------------------------------------------------------------------------------
def module_page(name, desc, *, source=None, functions=(), classes=(), sections=("Functions",), links=()):
  """A library page shaped like Sphinx's python-docs output (body, module section, dl.py, headerlinks)."""
  body = [f'<section id="module-{name}">',
          f'<h1><a class="reference internal" href="#module-{name}"><code class="xref py py-mod"><span class="pre">'
          f'{name}</span></code></a> — {desc}<a class="headerlink" href="#module-{name}">¶</a></h1>']
  if source:
    body.append(f'<p><strong>Source code:</strong> <a class="reference external" '
                f'href="https://github.com/python/cpython/tree/3.11/{source}">{source}</a></p>')
  body.append("<p>" + " ".join(f'See <a class="reference internal" href="{h}">{t}</a>.' for h, t in links) + "</p>")
  for i, s in enumerate(sections):
    sid = s.lower().replace(" ", "-")
    body.append(f'<section id="{sid}"><h2>{s}<a class="headerlink" href="#{sid}">¶</a></h2>')
    if i == 0:
      for f in functions:
        body.append(f'<dl class="py function"><dt class="sig sig-object py" id="{name}.{f}">'
                    f'<span class="sig-name descname"><span class="pre">{f}</span></span>()</dt>'
                    '<dd><p>Doc.</p></dd></dl>')
      for c in classes:
        body.append(f'<dl class="py class"><dt class="sig sig-object py" id="{name}.{c}">class {c}</dt>'
                    '<dd><p>Doc.</p></dd></dl>')
    body.append("</section>")
  body.append("</section>")
  return page_html(f"{name} — {desc}", "\n".join(body))


def page_html(title, body):
  return (f"<!DOCTYPE html><html><head><title>{title}</title><script>var x = '<a href=\"no.html\">';</script>"
          '</head><body><div class="related"><a href="index.html">Index</a></div>'
          f'<div class="document"><div class="body" role="main">{body}</div></div>'
          '<div class="footer"><a href="../copyright.html">Copyright</a></div></body></html>')


def index_html(chapters, extra=""):
  items = []
  for ch, pages in chapters:
    items.append(f'<li class="toctree-l1"><a class="reference internal" href="{ch[0]}">{ch[1]}</a><ul>')
    items += [f'<li class="toctree-l2"><a class="reference internal" href="{p}.html"><code><span class="pre">'
              f'{p}</span></code> — {d}</a></li>' for p, d in pages]
    items.append("</ul></li>")
  return page_html("The Python Standard Library", "<section id='the-python-standard-library'>"
                   f"<h1>The Python Standard Library</h1><p>{extra}</p><ul>{''.join(items)}</ul></section>")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """Six module pages: alpha..delta listed under two chapters; 'orphan' linked from nowhere (its
  conditions still single it out -> unreachable); gamma's first section title printed on the start
  page (-> trivial)."""
  root = tmp_path_factory.mktemp("docs")
  lib = root / "library"
  lib.mkdir()
  (lib / "index.html").write_text(index_html(
      [(("text.html", "Text Processing"), [("alpha", "Alpha parsing"), ("beta", "Beta parsing")]),
       (("data.html", "Data Types"), [("gamma", "Gamma values"), ("delta", "Delta values")])],
      extra="Read the Overview Of Gamma first."))
  (lib / "text.html").write_text(page_html("Text Processing", "<h1>Text Processing</h1>"))
  (lib / "data.html").write_text(page_html("Data Types", "<h1>Data Types</h1>"))
  pages = {
      "alpha": dict(desc="Alpha parsing", source="Lib/alpha.py", functions=("load", "dump"),
                    sections=("Basic Usage", "Exceptions"), links=[("beta.html", "the beta module")]),
      "beta": dict(desc="Beta parsing", source="Lib/beta.py", functions=("load", "parse"),
                   sections=("Parser Objects", "Examples"), links=[("gamma.html#x", "gamma values")]),
      "gamma": dict(desc="Gamma values", source="Lib/gamma/", functions=("dump", "parse"), classes=("Reader",),
                    sections=("Overview of Gamma", "Examples"), links=[("delta.html", "delta")]),
      "delta": dict(desc="Delta values", source="Lib/delta.py", functions=("emit",), classes=("Reader",),
                    sections=("Value Objects",), links=[("alpha.html", "alpha")]),
      "orphan": dict(desc="Orphan tools", source="Lib/orphan.py", functions=("load", "dump", "parse"),
                     sections=("Orphan Objects",)),
  }
  for name, kw in pages.items():
    (lib / f"{name}.html").write_text(module_page(name, **kw))
  return B.load_corpus(str(root))


def test_pages_parse_like_the_browser_shows_them(toy):
  a = toy.pages["library/alpha.html"]
  assert (a.title, a.module, a.source, a.first_section) == ("alpha — Alpha parsing", "alpha", "Lib/alpha.py",
                                                             "Basic Usage")
  assert a.description == "Alpha parsing" and a.functions == ["load", "dump"]
  assert a.sections == ["Basic Usage", "Exceptions"]
  assert [(l.target, l.text) for l in a.links] == [("library/beta.html", "the beta module")]
  assert "¶" not in a.text and "no.html" not in a.text  # headerlinks and scripts are not shown text
  b = toy.pages["library/beta.html"]
  assert [(l.target, l.text) for l in b.links] == [("library/gamma.html", "gamma values")]  # fragment dropped
  assert toy.chapters["library/alpha.html"] == "Text Processing" and "library/orphan.html" not in toy.chapters
  assert set(toy.pages["library/index.html"].followable) == {
      "library/text.html", "library/data.html", *(f"library/{m}.html" for m in ("alpha", "beta", "gamma", "delta"))}
  assert [p.module for p in toy.modules()] == ["alpha", "beta", "delta", "gamma", "orphan"]


def test_unreachable_answer_pages_are_rejected_and_counted(toy):
  s = B.generate(toy, seed=0)
  st = s.stats["multi-condition"]
  assert st["unreachable"] >= 1  # orphan: load + dump + parse single it out, but no link leads there
  assert st["candidates"] == st["kept"] + st["trivial"] + st["unreachable"] + st["ambiguous"]
  assert all(q.answer_page != "library/orphan.html" for q in s.questions)
  assert B.plan_route(toy, B.START_PAGE, "library/orphan.html") is None
  # reachable with a long enough chain only: index -> alpha -> beta -> gamma
  assert len(B.plan_route(toy, "library/alpha.html", "library/gamma.html")) == 2
  assert B.plan_route(toy, "library/alpha.html", "library/gamma.html", max_hops=1) is None


def test_trivial_questions_are_filtered_and_counted(toy):
  s = B.generate(toy, seed=0)
  assert s.stats["multi-condition"]["trivial"] >= 1  # gamma's "Overview of Gamma" is on the start page
  start = toy.pages[B.START_PAGE]
  for q in s.questions:
    assert not B.visible_in(q.answer, toy.pages[q.start].text)
  assert not any(q.answer_page == "library/gamma.html" and q.answer_kind == "first_section" and
                 q.start == B.START_PAGE for q in s.questions)
  assert B.visible_in("Overview of Gamma", start.text)


def test_kept_questions_are_consistent_and_deterministic(toy):
  s = B.generate(toy, seed=0)
  assert s.questions, s.stats
  for q in s.questions:
    page = toy.pages[q.answer_page]
    assert page.answer(q.answer_kind) == q.answer and q.split == B.split_of(q.answer_page)
    p = q.start
    for h in q.plan:  # a chain of followable links from the start page to the answer page
      assert h.page == p and toy.pages[p].followable[h.target].text == h.text
      p = h.target
    assert p == q.answer_page
    if q.family == "multi-condition":  # every condition fits >= 2 pages, together they fit one
      assert len(q.conditions) >= 2
  assert B.generate(toy, seed=0).as_dict() == s.as_dict()
  back = B.Suite.from_dict(json.loads(json.dumps(s.as_dict())))  # the on-disk cache's round trip
  assert back.questions == s.questions and back.stats == s.stats


def test_missing_corpus_is_a_typed_error(monkeypatch, tmp_path):
  monkeypatch.setenv(B.CORPUS_ENV, str(tmp_path))
  with pytest.raises(B.CorpusMissing, match="python3-doc"):
    B.corpus_dir()
  tasks._spec.cache_clear()
  try:
    with pytest.raises(P.TaskError, match="python3-doc"):
      tasks.get("browse/multi-hop")
  finally:
    tasks._spec.cache_clear()


# -- the real corpus --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def suite():
  return bt.prepare()  # cached on disk after the first generation (~10-20 s of parsing on 2 cores)


@needs_corpus
def test_real_suite_has_200_questions_and_a_disjoint_held_out_split(suite):
  assert len(suite.questions) >= 200
  ids = [q.id for q in suite.questions]
  assert len(ids) == len(set(ids))
  for fam in B.FAMILIES:
    train, test = suite.split(fam, "train"), suite.split(fam, "test")
    assert len(train) >= 50 and len(test) >= 20, (fam, len(train), len(test))
    assert not {q.id for q in train} & {q.id for q in test}
    if fam == "find-page":  # every module in both splits: the list's order is what is held out
      assert {q.answer_page for q in train} == {q.answer_page for q in test}
    else:
      assert not {q.answer_page for q in train} & {q.answer_page for q in test}  # held-out pages
    st = suite.stats[fam]
    assert st["kept"] == len(train) + len(test)
    assert st["candidates"] == st["kept"] + st["trivial"] + st["unreachable"] + st["ambiguous"]
  assert suite.stats["multi-condition"]["trivial"] > 50  # titles listed on the library index
  assert {q.answer_kind for q in suite.questions} == {*B.ANSWER_KINDS, "page"}
  held_out = suite.split("multi-hop", "test")
  assert suite.question("multi-hop", 7, "test") == held_out[7 % len(held_out)]


@needs_corpus
def test_real_pages_parse():
  with open(os.path.join(B.corpus_dir(), "library/json.html"), encoding="utf-8") as f:
    p = B.parse_page("library/json.html", f.read())
  assert (p.title, p.module, p.source, p.first_section) == ("json — JSON encoder and decoder", "json",
                                                             "Lib/json/__init__.py", "Basic Usage")
  assert {"dump", "dumps", "load", "loads"} <= set(p.functions) and "JSONDecoder" in p.classes
  assert p.exceptions == ["JSONDecodeError"]
  assert "library/pickle.html" in p.followable and p.followable["library/pickle.html"].text == "pickle"


@needs_corpus
def test_real_find_page_questions_start_on_the_chapter_that_lists_their_module(suite):
  corpus = B.load_corpus()
  for q in suite.split("find-page", "train") + suite.split("find-page", "test"):
    (hop,) = q.plan
    assert (hop.page, hop.target) == (q.start, q.answer_page) and q.answer_kind == "page"
    assert corpus.chapter_pages[q.start] == corpus.chapters[q.answer_page]  # the chapter that files it
    assert hop.text == corpus.pages[q.answer_page].title  # the list entry shows the page's title
    assert any(l.target == q.answer_page and l.text == hop.text for l in corpus.pages[q.start].links)
    assert q.answer == corpus.pages[q.answer_page].module and q.answer in q.question
    lo, hi = B.FIND_PAGE_ENTRIES
    assert lo <= int(dict(c.split("=") for c in q.conditions)["entries"]) <= hi
  text = next(q for q in suite.split("find-page", "train") + suite.split("find-page", "test")
              if q.answer_page == "library/re.html")
  assert text.start == "library/text.html" and text.plan[0].text == "re — Regular expression operations"


@needs_corpus
def test_judge_scores_find_page_by_the_page_shown(suite):
  q = bt.question("browse/find-page", 3, "test")
  assert bt.judge("browse/find-page", 3, "test", A.Finished(""), q.answer_page) == (1.0, "on the page asked for")
  assert bt.judge("browse/find-page", 3, "test", A.Finished(q.answer), q.start) == (0.0, "not on the page asked for")
  assert bt.judge("browse/find-page", 3, "test", A.Finished(q.answer), None)[0] == 0.0
  assert bt.judge("browse/find-page", 3, "test", A.CallUser(), q.answer_page)[0] == 0.0


@needs_corpus
def test_judge_scores_finished_content_by_normalised_match(suite):
  for task in ("browse/multi-condition", "browse/multi-hop"):
    q = bt.question(task, 3, "test")
    assert q in suite.split(bt.family(task), "test")
    assert bt.judge(task, 3, "test", A.Finished(q.answer)) == (1.0, "answer matches")
    assert bt.judge(task, 3, "test", A.Finished(f"  {q.answer.upper()}. "))[0] == 1.0
    assert bt.judge(task, 3, "test", A.Finished(q.answer + " x")) == (0.0, "answer does not match")
    assert bt.judge(task, 3, "test", A.CallUser())[0] == 0.0
    assert q.answer not in bt.judge(task, 3, "test", A.Finished("wrong"))[1]


@needs_corpus
def test_browse_tasks_are_registered_and_served_over_http(suite):
  names = tasks.task_names()
  assert {"browse/multi-condition", "browse/multi-hop", "browse/find-page"} <= set(names)
  ts = tasks.get("browse/multi-hop")
  assert (ts.kind, ts.width, ts.height, ts.url) == ("browse", 640, 480, "about:blank")
  fp = tasks.get("browse/find-page")
  assert (fp.width, fp.height) == (240, 320) and fp.css == bt.FIND_PAGE_CSS and ts.css == bt.CSS
  q = bt.question("browse/multi-hop", 2, "train")
  assert ts.start_script(2) == f"globalThis.__tarsQuestion = {json.dumps(q.question)};"
  url = ts.start_url(2, "train")
  assert url.startswith("http://127.0.0.1:") and url.endswith(q.start)
  with urllib.request.urlopen(url, timeout=10) as r:
    assert r.status == 200 and b"<h1>" in r.read()
  with urllib.request.urlopen(bt.base_url() + "_static/documentation_options.js", timeout=10) as r:
    assert b"SHOW_SEARCH_SUMMARY: false" in r.read()
  with urllib.request.urlopen(bt.base_url() + "searchindex.js", timeout=10) as r:
    assert r.read(16).startswith(b"Search.setIndex(")


# -- the expert's decisions ----------------------------------------------------------------------------
def el(tag, x, y, w, h, text="", leaf=True):
  return dict(tag=tag, id="", classes="", type="", text=text, value="", checked=False, focused=False, leaf=leaf,
              x=x, y=y, width=w, height=h)


def _q(kind="source"):
  plan = (B.Hop("library/index.html", "json — JSON encoder and decoder", "library/json.html", "json — JSON"),)
  return B.Question("t", "multi-condition", "test", "library/index.html", "?", "Lib/json/__init__.py", kind,
                    "library/json.html", plan, ())


def test_expert_clicks_the_plan_link_scrolls_and_answers():
  ex = X.BrowseExpert(_q())
  h1 = el("h1", 10, 60, 600, 30, "The Python Standard Library", leaf=False)
  link = el("a", 40, 300, 250, 18, "json — JSON encoder and decoder", leaf=False)
  t, a = ex.decide([h1], "library/index.html")
  assert a == X.PAGE_DOWN and "scroll" in t
  t, a = ex.decide([link], "library/index.html")
  assert isinstance(a, E.ClickAt) and a.box is link
  x, y = E.grid_point(a.box, "int", 640, 480)
  assert 40 <= x / 1000 * 640 < 290 and 300 <= y / 1000 * 480 < 318
  assert ex.decide([dict(link, y=20)], "library/index.html")[1] == X.PAGE_DOWN  # under the top bar
  # the answer page, entered at a #fragment: first back to the top, then read the Source code line
  assert ex.decide([el("p", 10, 200, 600, 20, "Some text")], "library/json.html")[1] == X.HOME
  src = el("p", 10, 100, 600, 20, "Source code: Lib/json/__init__.py", leaf=False)
  t, a = ex.decide([dict(h1, text="json — JSON encoder and decoder"), src], "library/json.html")
  assert a == A.Finished("Lib/json/__init__.py")
  assert ex.reply([dict(h1, text="json — JSON encoder and decoder"), src], "library/json.html").endswith(
      "Action: finished(content='Lib/json/__init__.py')")
  with pytest.raises(E.ExpertError, match="not on the plan"):
    ex.decide([h1], "library/pickle.html")


def test_find_page_expert_steps_down_to_a_link_cut_by_the_bottom_edge_and_names_the_module():
  hop = B.Hop("library/text.html", "re — Regular expression operations", "library/re.html", "re — Regular")
  q = B.Question("find-page/library/re.html", "find-page", "test", "library/text.html", "Open ...", "re", "page",
                 "library/re.html", (hop,), ())
  ex = X.BrowseExpert(q)
  assert (ex.width, ex.height) == bt.VIEWPORTS["find-page"] == (240, 320)
  h1 = el("h1", 10, 50, 200, 30, "Text Processing Services", leaf=False)
  cut = el("a", 32, 300, 170, 36, "re — Regular expression operations", leaf=False)  # bottom at 336 > 319
  assert ex.decide([h1, cut], "library/text.html")[1] == X.ARROW_DOWN
  assert ex.decide([h1], "library/text.html")[1] == X.PAGE_DOWN  # not in view yet: a page down
  t, a = ex.decide([dict(cut, y=260)], "library/text.html")
  assert isinstance(a, E.ClickAt)
  assert ex.decide([el("h1", 10, 50, 200, 30, "re — Regular expression operations")], "library/re.html")[1] == \
      A.Finished("re")


def test_expert_reads_each_answer_kind_and_aims_inside_wrapped_links():
  h1 = el("h1", 10, 60, 600, 30, "json — JSON encoder and decoder", leaf=False)
  els = [h1, el("p", 10, 100, 600, 20, "Source code: Lib/json/__init__.py"),
         el("h2", 10, 300, 600, 25, "Basic Usage")]
  assert X.BrowseExpert(_q("first_section")).decide(els, "library/json.html")[1] == A.Finished("Basic Usage")
  assert X.BrowseExpert(_q("title")).decide(els, "library/json.html")[1] == A.Finished("JSON encoder and decoder")
  wrapped = el("a", 20, 200, 600, 40, "json — JSON encoder and decoder", leaf=True)  # two lines
  a = X.BrowseExpert(_q()).decide([el("h1", 0, 60, 10, 10), wrapped], "library/index.html")[1]
  assert a.box["y"] >= 220 and a.box["x"] == 20  # on the last line, at its start


# -- the real sandbox (real Chromium) --------------------------------------------------------------------
@needs_corpus
@pytest.mark.browser
def test_expert_solves_held_out_questions_and_a_wrong_answer_gets_zero(server, suite):
  async def go():
    async with SandboxClient(server.url) as c:
      out = [await X.solve(c, task, 0, "test", max_turns=40) for task in bt.task_names()]  # ~20 turns each
      sid, obs = await c.open("browse/multi-condition", 0, data_mode="test")
      bad = await c.step(sid, "Thought: a guess\nAction: finished(content='certainly not the answer')")
      await c.close(sid)
      return out, obs, bad
  results, obs, bad = run(go())
  for r in results:
    assert r.reward == 1.0 and r.stopped is None, r
    assert B.matches(r.answer, bt.question(r.task, r.seed, "test").answer)
  assert obs.info["instruction"] == bt.question("browse/multi-condition", 0, "test").question
  assert obs.image().shape == (480, 640, 3)
  assert bad.done and bad.reward == 0.0 and bad.info["reason"] == "answer does not match"
  assert bad.info["page"] == B.START_PAGE


@needs_corpus
@pytest.mark.browser
@pytest.mark.long  # ~1.5 min: 20 episodes of ~20 turns
def test_expert_success_on_ten_held_out_questions_per_family(server, suite):
  async def go():
    async with SandboxClient(server.url) as c:
      return await X.evaluate([c], bt.task_names(), "test", limit=10, concurrency=1, max_turns=60)
  res = run(go())
  for task, rs in res.items():
    assert len(rs) == 10 and sum(r.reward == 1.0 for r in rs) >= 9, X.format_results(res)


@needs_corpus
@pytest.mark.browser
def test_scroll_search_box_and_reproducible_link_following(server, suite):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, o0 = await c.open("browse/multi-condition", 0, data_mode="test")
      before = await c.elements(sid)
      o1 = await c.step(sid, "scroll(start_box='(500,600)', direction='down')")
      after = await c.elements(sid)
      o1b = await c.step(sid, "hotkey(key='pagedown')")
      after_b = await c.elements(sid)
      box = next(e for e in before if e["tag"] == "input" and e["type"] == "text")  # the top bar's search box
      x, y = E.grid_point(box, "int", 640, 480)
      await c.step(sid, f"click(start_box='({x},{y})')")
      o2 = await c.step(sid, "type(content='json\\n')")
      results = await c.elements(sid)
      await c.close(sid)
      # the same seed twice, following the plan's first link: the same screenshots
      shots = []
      for _ in range(2):
        sid, o = await c.open("browse/multi-hop", 1, data_mode="test")
        q = bt.question("browse/multi-hop", 1, "test")
        ex = X.BrowseExpert(q)
        seq = [o.screenshot_png_b64]
        for _ in range(12):
          o = await c.step(sid, ex.reply(await c.elements(sid), o.info.get("page", q.start)))
          seq.append(o.screenshot_png_b64)
          if o.info["page"] != q.start:
            break
        shots.append((seq, o.info["page"]))
        await c.close(sid)
      return o0, o1, o1b, before, after, after_b, o2, results, shots
  o0, o1, o1b, before, after, after_b, o2, results, shots = run(go())
  assert o1.screenshot_png_b64 != o0.screenshot_png_b64 != o1b.screenshot_png_b64 and not o1.done

  def y_of(els, tag, text):
    return next(e["y"] for e in els if e["tag"] == tag and e["text"] == text)
  mark = next(e for e in before if e["tag"] == "p" and 150 < e["y"] < 300)  # a paragraph on the first screen
  assert y_of(after, "p", mark["text"]) == pytest.approx(mark["y"] - 100, abs=1)  # scroll: 100 px
  # pagedown: 87.5% of the 480 px viewport more, at once (not animated: the init script's scroll)
  low = next(e for e in after if e["tag"] == "a" and 425 < e["y"] < 460 and e["height"] >= 15)
  assert y_of(after_b, "a", low["text"]) == pytest.approx(low["y"] - 420, abs=1)
  assert o2.info["page"] == "search.html" and o2.info["error"] is None
  links = [e["text"] for e in results if e["tag"] == "a"]
  assert "json" in links and "json — JSON encoder and decoder" in links, links[:20]  # the search's results
  (seq_a, page_a), (seq_b, page_b) = shots
  q = bt.question("browse/multi-hop", 1, "test")
  assert page_a == page_b == q.plan[0].target and seq_a == seq_b
  assert base64.b64decode(seq_a[-1]) != base64.b64decode(seq_a[0])


@needs_corpus
@pytest.mark.browser
def test_find_page_episode_in_its_small_viewport(server, suite):
  """The expert opens a held-out question's module page and is paid on it; finished() on the chapter
  page pays 0; the chapter page's list shows the modules without their nested lists of sections, in an
  order that the episode's seed and data mode draw (the same episode: the same order)."""
  train = suite.split("find-page", "train")
  re_seed = next(k for k, q in enumerate(train) if q.answer_page == "library/re.html")

  async def listed(c, seed, data_mode):
    sid, _ = await c.open("browse/find-page", seed, data_mode=data_mode)
    shown = []
    for _ in range(4):
      shown += [e["text"] for e in await c.elements(sid) if e["tag"] == "a" and e["text"] not in shown]
      await c.step(sid, "hotkey(key='pagedown')")
    await c.close(sid)
    return shown

  async def go():
    async with SandboxClient(server.url) as c:
      r = await X.solve(c, "browse/find-page", 1, "test", max_turns=12)
      sid, obs = await c.open("browse/find-page", 1, data_mode="test")
      early = await c.step(sid, "Thought: here\nAction: finished(content='x')")
      await c.close(sid)
      orders = [await listed(c, s, m) for s, m in ((re_seed, "train"), (re_seed, "train"),
                                                   (re_seed + len(train), "train"), (re_seed, "test"))]
      return r, obs, early, orders
  r, obs, early, orders = run(go())
  shown = orders[0]
  q = bt.question("browse/find-page", 1, "test")
  assert r.reward == 1.0 and r.stopped is None and 2 <= r.turns <= 8, r
  assert obs.image().shape == (320, 240, 3) and obs.info["instruction"] == q.question
  assert early.done and early.reward == 0.0 and early.info["reason"] == "not on the page asked for"
  assert early.info["page"] == q.start
  assert "re — Regular expression operations" in shown and "difflib — Helpers for computing deltas" in shown
  assert "Regular Expression Syntax" not in shown  # re's nested section list: hidden by FIND_PAGE_CSS
  modules = [[t for t in o if " — " in t and t.split(" — ")[0] in {"string", "re", "difflib", "textwrap", "unicodedata",
                                                                   "stringprep", "readline", "rlcompleter"}]
             for o in orders]
  assert all(sorted(m) == sorted(modules[0]) and len(m) == 8 for m in modules), modules
  assert modules[0] == modules[1]  # the same episode, the same order
  assert modules[0] != modules[2] and modules[0] != modules[3]  # another seed / the held-out mode: another
