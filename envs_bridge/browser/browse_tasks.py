"""GUI-Browsing tasks 'browse/<family>' for the browser sandbox: the questions of `browsing.py` asked over
the Python documentation, served by the sandbox itself over loopback HTTP (issue #26 item 1).

An episode of `browse/multi-condition` or `browse/multi-hop` with (seed, data_mode) asks question
`seed % n` of that family's split (data_mode 'train' -> train split, 'test' -> held-out split). It
starts on the question's start page; the instruction is the question; the agent reads screenshots,
clicks links, scrolls, types into the page's search box (Sphinx's client-side search over
searchindex.js, offline) and ends with `finished(content='<answer>')`: reward 1 when the content
equals the answer after `browsing.normalize` (lowercase, no punctuation or whitespace), else 0;
`call_user()` ends with 0. An episode of `browse/find-page` asks to open a module's page from its
chapter page and pays 1 for `finished(...)` on that page (`judge`), in a smaller viewport, with the
chapter page's list compacted and in an order drawn from (seed, data_mode) (`VIEWPORTS`,
`FIND_PAGE_CSS`, `SHUFFLE_SCRIPT`). Observation.info carries `page`, the corpus path shown
('library/json.html').

Serving: the corpus directory (Debian's python3-doc) is served read-only by a `ThreadingHTTPServer` on
127.0.0.1 and a free port, started in the sandbox process at the first browse page (`base_url`). One
file is served changed: `_static/documentation_options.js` with SHOW_SEARCH_SUMMARY false (the search
page would otherwise fetch every result page asynchronously to show a summary, and the screenshot
would depend on network timing).

Navigation is made deterministic: an init script (`INIT_SCRIPT`, in every document of the page)
holds back link clicks and form submissions to other pages of the corpus (`__tarsNav`), and the
sandbox then loads that URL itself (`page.goto`, waiting for the load) before it advances the virtual
clock and takes the screenshot, so a step that follows a link always shows the new page. In-page
links (#anchors) behave natively; links that leave the corpus (python.org, GitHub) do nothing, as
the sandbox is offline. The same script makes keyboard scrolling (pagedown, space, arrows, home, end)
immediate, since Chromium animates it in wall-clock time, and `CSS` squares the theme's rounded
corners, whose anti-aliased edges differed by one level between loads of the same page: the same
seed and actions give byte-equal screenshots (tests/test_browsing.py).
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import sys
import threading
import urllib.parse

from envs_bridge.browser import browsing
from tars_jax.agent import actions as A

PREFIX = "browse/"
FAMILIES = {PREFIX + f: f for f in browsing.FAMILIES}
# Below 1024 px Sphinx's python-docs theme shows its narrow layout: no sidebars, a fixed 40 px top bar
# with the search box; the main text is 14 px, readable at this size.
WIDTH, HEIGHT = 640, 480
# find-page is sized for the policy's own screenshot (168 x 224 px in the MiniWoB++ configs): at 240 x 320
# its 14 px text is still ~10 px after the resize; at 640 x 480 it was ~4 px, and squashed.
VIEWPORTS = {"find-page": (240, 320)}
SPLIT_OF_MODE = {"train": "train", "test": "test"}  # data_mode -> question split
SUITE_SEED = 0  # generation seed of the served suite

# Runs in every document of a browse page before the page's own scripts (context init script).
INIT_SCRIPT = """(() => {
  if (globalThis.__tarsNavInstalled) return;
  globalThis.__tarsNavInstalled = true;
  globalThis.__tarsNav = null;
  const sameDoc = (u) => u.origin === location.origin && u.pathname === location.pathname
      && u.search === location.search;
  const follow = (e) => {
    const a = e.target && e.target.closest ? e.target.closest('a[href]') : null;
    if (!a) return;
    const u = new URL(a.href, location.href);
    if (sameDoc(u)) return;  // #anchor on this page: native scroll
    e.preventDefault();  // the sandbox loads corpus pages itself; other sites are unreachable offline
    if (u.origin === location.origin) globalThis.__tarsNav = u.href;
  };
  document.addEventListener('click', follow, true);
  document.addEventListener('auxclick', follow, true);  // middle click: no new tab
  // Keyboard scrolling at once: Chromium animates it in real time (a screenshot right after a
  // pagedown caught the page mid-scroll, measured), so the keys scroll here without animation, by
  // Chromium's own amounts (a page: 87.5% of the viewport; an arrow: 40 px). Keys typed into a
  // field or pressed on a button keep their native meaning; wheel scrolls are not animated.
  window.addEventListener('keydown', (e) => {
    const t = e.target;
    if (e.defaultPrevented || e.ctrlKey || e.altKey || e.metaKey) return;
    if (t && t.closest && (t.isContentEditable || t.closest('input, textarea, select, button'))) return;
    const page = Math.floor(window.innerHeight * 0.875);
    const dy = {PageDown: page, PageUp: -page, ' ': e.shiftKey ? -page : page, ArrowDown: 40, ArrowUp: -40}[e.key];
    const dx = {ArrowRight: 40, ArrowLeft: -40}[e.key];
    if (e.key === 'Home' || e.key === 'End') {
      e.preventDefault();
      window.scrollTo({top: e.key === 'Home' ? 0 : document.documentElement.scrollHeight, behavior: 'instant'});
    } else if (dy !== undefined || dx !== undefined) {
      e.preventDefault();
      window.scrollBy({left: dx || 0, top: dy || 0, behavior: 'instant'});
    }
  }, true);
  document.addEventListener('submit', (e) => {
    const f = e.target;
    e.preventDefault();
    const u = new URL(f.getAttribute('action') || location.href, location.href);
    u.search = new URLSearchParams(new FormData(f)).toString();
    u.hash = '';
    if (u.origin === location.origin) globalThis.__tarsNav = u.href;
  }, true);
})();"""

STATE_SCRIPT = """() => {
  const nav = globalThis.__tarsNav || null;
  globalThis.__tarsNav = null;
  return {done: false, reward: 0, raw_reward: 0, reason: null, nav,
          page: decodeURIComponent(location.pathname).replace(/^\\/+/, '')};
}"""
UTTERANCE_SCRIPT = "() => globalThis.__tarsQuestion"
CLEAN_SCRIPT = """() => {
  if (document.activeElement && document.activeElement !== document.body) document.activeElement.blur();
  window.scrollTo(0, 0);
}"""
INFO_KEYS = ("page",)
# Rounded corners (the theme's notes and code boxes) came out of Chromium's software raster with
# +-1 differences in a few edge pixels from one load of the same page to the next (measured): square
# corners make the screenshots of the same episode byte-equal.
CSS = "* { border-radius: 0 !important; }"
# find-page: a chapter page's list of modules without each module's nested list of sections (one line
# or two per module instead of a screen or more)
FIND_PAGE_CSS = CSS + " .toctree-wrapper li.toctree-l1 > ul { display: none !important; }"


def task_names() -> tuple[str, ...]:
  """'browse/find-page', 'browse/multi-condition', 'browse/multi-hop'."""
  return tuple(sorted(FAMILIES))


def family(task: str) -> str:
  """'browse/multi-hop' -> 'multi-hop'. Raises KeyError for other names."""
  return FAMILIES[task]


def viewport(task: str) -> tuple[int, int]:
  """(width, height) px of `task`'s page. Raises KeyError for other names than browse tasks."""
  return VIEWPORTS.get(family(task), (WIDTH, HEIGHT))


def css(task: str) -> str:
  """The style added to every page of `task`. Raises KeyError for other names than browse tasks."""
  return FIND_PAGE_CSS if family(task) == "find-page" else CSS


def check_installed() -> str:
  """The corpus directory. Raises browsing.CorpusMissing (apt-get install python3-doc)."""
  return browsing.corpus_dir()


_prepare_lock = threading.Lock()


def prepare() -> browsing.Suite:
  """Builds (or loads the cached) question suite; the sandbox runs it in a thread before the first
  browse episode so generation never blocks the event loop. Raises browsing.CorpusMissing."""
  with _prepare_lock:
    return browsing.suite(SUITE_SEED)


def question(task: str, seed: int, data_mode: str = "train") -> browsing.Question:
  """The question an episode of `task` with (seed, data_mode) asks. Raises KeyError (unknown task or
  data_mode), browsing.CorpusMissing."""
  if data_mode not in SPLIT_OF_MODE:
    raise KeyError(f"data_mode {data_mode!r} not in {tuple(SPLIT_OF_MODE)}")
  return prepare().question(family(task), seed, SPLIT_OF_MODE[data_mode])


# -- the corpus over HTTP -----------------------------------------------------------------------------
PATCHED = {"_static/documentation_options.js": ("SHOW_SEARCH_SUMMARY: true", "SHOW_SEARCH_SUMMARY: false")}


class _Handler(http.server.SimpleHTTPRequestHandler):
  """Static files of the corpus (read-only, GET/HEAD), PATCHED files changed, no request log."""

  def log_message(self, format, *args):  # noqa: A002 - the base class's signature
    pass

  def do_GET(self):  # noqa: N802
    rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
    if rel in PATCHED:
      old, new = PATCHED[rel]
      with open(os.path.join(self.directory, rel), encoding="utf-8") as f:
        body = f.read().replace(old, new).encode()
      self.send_response(200)
      self.send_header("Content-Type", "text/javascript; charset=utf-8")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)
      return
    super().do_GET()


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    """A client that goes away mid-response (a page navigating on) is normal here; others are printed."""
    if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
      super().handle_error(request, client_address)


class CorpusServer:
  """The corpus on http://127.0.0.1:<port>/ from a daemon thread (`ThreadingHTTPServer`)."""

  def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0):
    handler = functools.partial(_Handler, directory=root)
    self.httpd = _Server((host, port), handler)
    self.root = root
    self.url = f"http://{host}:{self.httpd.server_address[1]}/"
    self.thread = threading.Thread(target=self.httpd.serve_forever, name="browse-corpus", daemon=True)
    self.thread.start()

  def close(self) -> None:
    self.httpd.shutdown()
    self.httpd.server_close()


_server: CorpusServer | None = None
_server_lock = threading.Lock()


def base_url() -> str:
  """URL of the corpus root, starting the corpus server at the first call. Raises CorpusMissing."""
  global _server
  with _server_lock:
    if _server is None:
      _server = CorpusServer(check_installed())
    return _server.url


def start_url(task: str, seed: int, data_mode: str = "train") -> str:
  """The page an episode starts on (the question's start page, on the corpus server)."""
  return base_url() + question(task, seed, data_mode).start


# find-page: the chapter page's list of modules in an order drawn from the episode (Fisher-Yates on
# mulberry32, seeded from Python): held-out episodes show orders the training ones did not
SHUFFLE_SCRIPT = """(() => {
  const ul = document.querySelector('div.toctree-wrapper > ul');
  if (!ul) return;
  let a = %d >>> 0;
  const rnd = () => {
    a = (a + 0x6D2B79F5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), a | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const items = Array.from(ul.children);
  for (let i = items.length - 1; i > 0; i--) {
    const j = Math.floor(rnd() * (i + 1));
    [items[i], items[j]] = [items[j], items[i]];
  }
  items.forEach((li) => ul.appendChild(li));
})();"""


def list_order_seed(seed: int, data_mode: str) -> int:
  """The 32-bit seed of find-page's list order for an episode (seed, data_mode)."""
  return int.from_bytes(hashlib.sha256(f"find-page/{data_mode}/{seed}".encode()).digest()[:4], "big")


def start_script(task: str, seed: int, data_mode: str = "train") -> str:
  """JS statements that put the episode's question where UTTERANCE_SCRIPT reads it (and for find-page
  put the chapter's list in the episode's order)."""
  out = f"globalThis.__tarsQuestion = {json.dumps(question(task, seed, data_mode).question)};"
  if family(task) == "find-page":
    out += "\n" + SHUFFLE_SCRIPT % list_order_seed(seed, data_mode)
  return out


def judge(task: str, seed: int, data_mode: str, action, page: str | None = None) -> tuple[float, str]:
  """(reward, reason) of the action that ended the episode, on `page` (the corpus path shown, as in
  Observation.info['page']): 1.0 for `finished(content=...)` whose content matches the answer
  (`browsing.matches`), or for find-page a `finished(...)` on the page asked for, else 0.0. The reason
  never shows the answer."""
  if not isinstance(action, A.Finished):
    return 0.0, "ended without finished(content=...)"
  q = question(task, seed, data_mode)
  if q.family == "find-page":
    return (1.0, "on the page asked for") if page == q.answer_page else (0.0, "not on the page asked for")
  if browsing.matches(action.content, q.answer):
    return 1.0, "answer matches"
  return 0.0, "answer does not match"
