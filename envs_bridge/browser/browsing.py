"""GUI-Browsing questions over a real linked HTML corpus: Debian's Python documentation (`python3-doc`).

Report section 2.5.1 ("GUI-Browsing") synthesises information-seeking questions that an agent answers
only by reading screenshots, in two ways; here both run over the Python 3 documentation that Debian's
`python3-doc` package installs (`/usr/share/doc/python3/html`; scripts/setup.sh installs it), with the
entities being the standard-library module pages (`library/<module>.html`):

  multi-condition  "Multi-Condition Obfuscation": a page's attributes (the chapter of the library
                   reference that files it, functions / classes / exceptions it documents, words of its
                   section headings, the version it was new in or deprecated since) are scored for
                   distinctiveness: the number of module pages that share them, where the report asks an
                   LLM. Highly revealing ones (no other page has them) are removed, and the rest are
                   combined until together they identify exactly one page; every condition alone fits
                   at least two. The episode starts on the library reference's index.
  multi-hop        "Multi-Hop Chain-Like Conditions": from a module page, follow a link to another module
                   page that one obfuscated feature singles out among the pages it links to, then from
                   there again (2 or 3 hops); the hops are integrated into one question and the answer
                   is read on the last page. The episode starts on the first page of the chain.
  find-page        The navigation half of a browsing question, sized for a small policy: "Open the
                   documentation page of the <module> module." The episode starts on the chapter page of
                   the library reference that lists that module (chapters of FIND_PAGE_ENTRIES modules),
                   its list shown one line per module in an order drawn from the episode's seed and data
                   mode, at the family's 240 x 320 viewport (browse_tasks.VIEWPORTS, FIND_PAGE_CSS,
                   start_script); success is ending with `finished()` on the module's page
                   (`Question.answer_page`), whatever the content. Both splits ask about every module;
                   what is held out is the list's order (a policy cannot have memorised where the link
                   is). Held out by module, as the other families are, it asks to read a module name never
                   seen in training (RESULTS.md, "find-page").

The answer of the two question families is a short string read on the answer page: the file named after
"Source code:", the title of the first section, or the page title after the module name. It is given with
`finished(content='...')` and checked by `normalize`d exact match (lowercase, punctuation and
whitespace removed).

Filters, each counted in `Suite.stats` (report: "we filter the synthesized data by discarding instances
that can be trivially solved"):
  trivial      the answer is visible on the start page (its words appear in the start page's text);
  unreachable  no chain of followable links (`Page.followable`) of at most `max_hops` leads from the
               start page to the answer page (issue #26, "Bad input");
  ambiguous    no set of non-revealing conditions identifies the page alone (multi-condition), or no
               feature singles out a linked page (multi-hop).
Every kept question carries its solution `plan`: the links (anchor text, target page) from the start
page to the answer page, what the scripted expert (tars_jax/data/sources/browse_expert.py) follows.

Generation is pure Python over the parsed corpus (a small tokenizer, `parse_page`), deterministic for a seed; the
held-out split is by answer page (a page's questions are all train or all test), so test questions
ask about pages no train question answers. `suite()` builds it once per process (10-25 s on the
2-core machine, mostly parsing the 28 MB of library pages) and caches it as JSON (~0.5 MB) under
~/.cache/tars_jax/browsing/, keyed by the installed corpus (paths, sizes, mtimes), the seed and a hash
of this module's source. Why generate rather than commit a JSON: the corpus comes from the machine's
Debian package, so questions are always made from the very pages that will be served (another
python3-doc version gets its own, consistent suite; `Suite.corpus_version` records which).

  python -m envs_bridge.browser.browsing            # counts and a few questions of each family
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import heapq
import html
import json
import os
import posixpath
import random
import re
import sys
import unicodedata

GENERATOR_VERSION = 1  # format of the cached suite (the cache key also hashes this module's source)
CORPUS_ENV = "TARS_BROWSE_CORPUS"  # overrides the corpus directory
CORPUS_CANDIDATES = ("/usr/share/doc/python3/html", "/usr/share/doc/python3-doc/html")
START_PAGE = "library/index.html"  # multi-condition questions start on the library reference
FAMILIES = ("multi-condition", "multi-hop", "find-page")
ANSWER_KINDS = ("source", "first_section", "title")
SPLITS = ("train", "test")
TEST_FRACTION = 0.2  # share of answer pages held out
MAX_HOPS = 4  # longest link chain from the start page to the answer page
MAX_DF = 40  # attributes shared by more module pages than this say too little to be a condition
MAX_ANCHOR_CHARS = 80  # followable links have short anchor texts (the expert finds them by text)
CHARS_PER_SCREEN = 1500  # rough body characters per screen at 640 x 480 (plan cost of scrolling)
# find-page: chapters listing this many modules (shown one line per module, browse_tasks.FIND_PAGE_CSS):
# fewer have too few orders to hold out (2 modules: 2 orders), more take many screens to scroll
FIND_PAGE_ENTRIES = (4, 12)
STOPWORDS = frozenset("""about above after again against along also among and another any are around
based before being below between both but by can could does doing down during each every few from further
have having here into itself more most much must other over same should some such than that their them
then there these they this those through under until very what when where which while with within would
your using used uses other others""".split())
_SKIP_TAGS = frozenset({"script", "style", "noscript", "head", "title"})
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
                   "source", "track", "wbr"})
_BLOCK = frozenset({"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "section", "pre", "tr",
                    "td", "th", "table", "ul", "ol", "dl", "br", "aside", "blockquote", "hr", "caption"})


class CorpusMissing(RuntimeError):
  """The Python documentation HTML is not installed (apt-get install python3-doc; scripts/setup.sh)."""


# -- answers ----------------------------------------------------------------------------------------
class _CharMap(dict):
  """str.translate table built on demand: each character's mapping is computed once (unicodedata)."""

  def __init__(self, fn):
    super().__init__()
    self.fn = fn

  def __missing__(self, code: int):
    v = self.fn(chr(code))
    self[code] = v
    return v


def _is_punct(c: str) -> bool:
  return unicodedata.category(c).startswith("P")


_DROP = _CharMap(lambda c: None if c.isspace() or _is_punct(c) else c)  # normalize: punctuation, spaces out
_SPACE = _CharMap(lambda c: " " if _is_punct(c) else c)  # _words: punctuation -> space


def normalize(text: str) -> str:
  """Answer normalisation for exact match: NFKC, lowercase, every punctuation character (Unicode
  category P*) and all whitespace removed. 'Lib/json/__init__.py' -> 'libjsoninitpy'."""
  return unicodedata.normalize("NFKC", text or "").lower().translate(_DROP)


def matches(answer: str, expected: str) -> bool:
  """True when `answer` equals `expected` after `normalize` (and `expected` is not empty)."""
  e = normalize(expected)
  return bool(e) and normalize(answer) == e


@functools.lru_cache(maxsize=2048)
def _words(text: str) -> str:
  """Lowercase words separated by single spaces, punctuation as spaces (for 'is it visible' checks)."""
  return " ".join(unicodedata.normalize("NFKC", text or "").lower().translate(_SPACE).split())


def visible_in(answer: str, text: str) -> bool:
  """True when the answer's words appear, in order and whole, in `text` (punctuation ignored)."""
  a = _words(answer)
  return bool(a) and f" {a} " in f" {_words(text)} "


# -- corpus -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Link:
  """A link of a page's main text to another page of the corpus (fragment dropped)."""

  target: str  # corpus-relative path, e.g. 'library/json.html'
  text: str  # anchor text, whitespace collapsed (what the page shows; the sandbox's `elements` text)
  offset: int  # characters of main text before it (a proxy for how far down the page it is)


@dataclasses.dataclass
class Page:
  """What generation reads from one HTML page (its main text: Sphinx's `div.body`)."""

  path: str
  title: str = ""  # h1 text ('json — JSON encoder and decoder')
  module: str | None = None  # module of the page's top section (`section#module-json`)
  source: str | None = None  # first 'Source code:' file ('Lib/json/__init__.py')
  sections: list[str] = dataclasses.field(default_factory=list)  # h2 and h3 titles, in order
  first_section: str | None = None  # first h2 title
  functions: list[str] = dataclasses.field(default_factory=list)  # documented names (last component)
  classes: list[str] = dataclasses.field(default_factory=list)
  exceptions: list[str] = dataclasses.field(default_factory=list)
  new_in: str | None = None  # module-level 'New in version X'
  deprecated: str | None = None  # module-level 'Deprecated since version X'
  links: list[Link] = dataclasses.field(default_factory=list)
  other_link_texts: list[str] = dataclasses.field(default_factory=list)  # footer / external link texts
  text: str = ""  # main text, whitespace collapsed

  @property
  def description(self) -> str | None:
    """The title after the module name ('JSON encoder and decoder'), None if the title has no dash."""
    if self.module and " — " in self.title:
      return self.title.split(" — ", 1)[1].strip() or None
    return None

  def answer(self, kind: str) -> str | None:
    """The answer of `kind` (ANSWER_KINDS) read on this page, None where the page has none."""
    if kind == "source":
      return self.source
    if kind == "first_section":
      return self.first_section
    if kind == "title":
      return self.description
    if kind == "page":  # find-page: the page itself is the answer; its module names it
      return self.module
    raise ValueError(f"unknown answer kind {kind!r}; expected one of {ANSWER_KINDS}")

  @functools.cached_property
  def followable(self) -> dict[str, Link]:
    """target -> the link the expert (and an agent) can follow there by its text: anchor text of 2 to
    MAX_ANCHOR_CHARS characters that no link of the page to another target (nor a footer link)
    shares; the first such link on the page."""
    by_text: dict[str, set] = collections.defaultdict(set)
    for l in self.links:
      by_text[l.text].add(l.target)
    for t in self.other_link_texts:
      by_text[t].add(None)
    out: dict[str, Link] = {}
    for l in self.links:
      if (l.target != self.path and l.target not in out and 2 <= len(l.text) <= MAX_ANCHOR_CHARS
          and len(by_text[l.text]) == 1):
        out[l.target] = l
    return out


_TOKEN = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)((?:[^>\"']|\"[^\"]*\"|'[^']*')*)>"  # tag, attributes
                    r"|<!--.*?-->|<![^>]*>|<\?[^>]*>"  # comment, doctype, processing instruction
                    r"|([^<]+|<)", re.S)  # text
_ATTR = re.compile(r"""([a-zA-Z_:][-a-zA-Z0-9_:.]*)(?:\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+)))?""")
_RAW = re.compile(r"<(script|style)\b.*?</\1\s*>", re.S | re.I)
# Pygments' and Sphinx's one-class inline spans (`<span class="n">x</span>`, `<span class="pre">`):
# most tags of a page, none of them matter here; unwrapped before tokenizing (3x faster).
_TRIVIAL_SPAN = re.compile(r'<span class="[a-z0-9]{1,3}">([^<]*)</span>')


class _PageParser:
  """One Sphinx page -> Page fields (see `parse_page`): a small tokenizer (tags, text) with an element
  stack; Python's html.parser took six times as long on the 28 MB of library pages."""

  def __init__(self, path: str):
    self.page = Page(path)
    self.stack: list[tuple[str, str]] = []  # (tag, class) of open non-void elements
    self.body_depth: int | None = None  # stack depth of div.body while it is open
    self.footer_depth: int | None = None
    self.skip = 0  # open elements whose text is not shown
    self.text: list[str] = []
    self.n = 0  # characters of main text so far
    self.capture: list[tuple[str, list[str], dict, int]] = []  # (what, text parts, attrs, depth)
    self.dl_kinds: list[str] = []  # 'py function', 'py class', ... of open <dl>s
    self.saw_h2 = False
    self.saw_dl = False
    self.module_section = False

  def feed(self, text: str) -> None:
    text = _TRIVIAL_SPAN.sub(r"\1", _RAW.sub("", text))
    for m in _TOKEN.finditer(text):
      close, tag, attrs, data = m.groups()
      if data is not None:
        self.handle_data(html.unescape(data) if "&" in data else data)
      elif tag is not None:
        tag = tag.lower()
        if close:
          self.handle_endtag(tag)
        else:
          a = {k.lower(): html.unescape(v1 or v2 or v3 or "") for k, v1, v2, v3 in _ATTR.findall(attrs)}
          self.handle_starttag(tag, a)
          if attrs.rstrip().endswith("/") and tag not in _VOID:
            self.handle_endtag(tag)

  def close(self) -> None:
    pass

  def handle_starttag(self, tag, a):
    cls = a.get("class") or ""
    classes = cls.split()
    if tag in _BLOCK:
      self._data(" ")
    if tag in _VOID:
      return
    self.stack.append((tag, cls))
    depth = len(self.stack)
    if tag in _SKIP_TAGS or (tag == "a" and "headerlink" in classes):
      self.skip += 1
    if tag == "div" and a.get("role") == "main" and "body" in classes and self.body_depth is None:
      self.body_depth = depth
    if tag == "div" and "footer" in classes and self.footer_depth is None:
      self.footer_depth = depth
    if self.footer_depth is not None:
      if tag == "a":
        self.capture.append(("footer-a", [], a, depth))
      return
    if self.body_depth is None:
      return
    if (tag == "section" and a.get("id", "").startswith("module-") and self.page.module is None
        and not self.page.title):
      self.page.module = a["id"][len("module-"):]
      self.module_section = True
    if tag in ("h1", "h2", "h3"):
      self.capture.append((tag, [], a, depth))
      if tag == "h2":
        self.saw_h2 = True
    elif tag == "a" and "href" in a and "headerlink" not in classes:
      self.capture.append(("a", [], {**a, "offset": self.n}, depth))
    elif tag == "p":
      self.capture.append(("p", [], a, depth))
    elif tag == "dl":
      self.dl_kinds.append(" ".join(c for c in classes if c in ("py", "function", "class", "exception",
                                                                 "method", "data")))
      self.saw_dl = True
    elif tag == "dt" and self.dl_kinds and "sig-object" in classes and a.get("id"):
      name = a["id"].rsplit(".", 1)[-1]
      kind = self.dl_kinds[-1]
      if kind == "py function":
        self.page.functions.append(name)
      elif kind == "py class":
        self.page.classes.append(name)
      elif kind == "py exception":
        self.page.exceptions.append(name)
    elif tag == "span" and "versionmodified" in classes:
      self.capture.append(("versionmod", [], a, depth))

  def handle_endtag(self, tag):
    if tag in _VOID:
      return
    # close up to the matching open tag (Sphinx output is well nested; stray end tags are ignored)
    idx = next((i for i in range(len(self.stack) - 1, -1, -1) if self.stack[i][0] == tag), None)
    if idx is None:
      return
    while len(self.stack) > idx:
      depth = len(self.stack)
      t, cls = self.stack.pop()
      if t in _SKIP_TAGS or (t == "a" and "headerlink" in cls.split()):
        self.skip -= 1
      while self.capture and self.capture[-1][3] >= depth:
        self._finish(*self.capture.pop()[:3])
      if t == "dl" and self.dl_kinds and self.body_depth is not None:
        self.dl_kinds.pop()
      if self.body_depth == depth:
        self.body_depth = None
      if self.footer_depth == depth:
        self.footer_depth = None
    if tag in _BLOCK:
      self._data(" ")

  def handle_data(self, data):
    if self.skip:
      return
    for c in self.capture:
      c[1].append(data)
    self._data(data)

  def _data(self, s: str):
    if self.body_depth is not None and not self.skip:
      self.text.append(s)
      self.n += len(s)

  def _finish(self, what: str, parts: list[str], a: dict):
    text = " ".join("".join(parts).split())
    p = self.page
    if what == "h1" and not p.title:
      p.title = text
    elif what in ("h2", "h3"):
      p.sections.append(text)
      if what == "h2" and p.first_section is None:
        p.first_section = text
    elif what == "a":
      target = _resolve(p.path, a.get("href", ""))
      if target is not None and text:
        p.links.append(Link(target, text, a["offset"]))
      elif text:
        p.other_link_texts.append(text)
    elif what == "footer-a":
      if text:
        p.other_link_texts.append(text)
    elif what == "p":
      if p.source is None and text.startswith("Source code:"):
        p.source = text[len("Source code:"):].strip() or None
    elif what == "versionmod" and self.module_section and not self.saw_h2 and not self.saw_dl:
      m = re.match(r"(New in version|Deprecated since version) (\d+\.\d+)", text)
      if m and m.group(1).startswith("New"):
        p.new_in = p.new_in or m.group(2)
      elif m:
        p.deprecated = p.deprecated or m.group(2)


def _resolve(page_path: str, href: str) -> str | None:
  """A link's corpus-relative target page, or None for external links, pure fragments and non-HTML
  targets. '/license.html' (root-relative, served by the corpus server at its root) -> 'license.html'."""
  if not href or href.startswith("#") or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", href):
    return None
  href = href.split("#", 1)[0].split("?", 1)[0]
  if not href.endswith(".html"):
    return None
  if href.startswith("/"):
    return posixpath.normpath(href.lstrip("/"))
  out = posixpath.normpath(posixpath.join(posixpath.dirname(page_path), href))
  return None if out.startswith("..") else out


def parse_page(path: str, text: str) -> Page:
  """Parses one page of the documentation: `path` relative to the corpus root, `text` its HTML."""
  ps = _PageParser(path)
  ps.feed(text)
  ps.close()
  ps.page.text = " ".join("".join(ps.text).split())
  return ps.page


@dataclasses.dataclass
class Corpus:
  """Parsed pages by path, the chapter of each library page (from the library index), and the
  corpus's identity (root, version, fingerprint)."""

  root: str
  pages: dict[str, Page]
  chapters: dict[str, str]  # page -> chapter title of the library reference that lists it
  version: str = ""
  fingerprint: str = ""
  chapter_pages: dict[str, str] = dataclasses.field(default_factory=dict)  # chapter's own page -> its title

  def modules(self) -> list[Page]:
    """The standard-library module pages (entities), sorted by path."""
    return [p for _, p in sorted(self.pages.items()) if p.path.startswith("library/") and p.module]


def corpus_dir() -> str:
  """Root of the documentation HTML: $TARS_BROWSE_CORPUS, else the first of CORPUS_CANDIDATES holding
  library/index.html. Raises CorpusMissing (with the install command) when there is none."""
  env = os.environ.get(CORPUS_ENV)
  cands = [env] if env else list(CORPUS_CANDIDATES)
  for c in cands:
    if c and os.path.isfile(os.path.join(c, START_PAGE)):
      return os.path.realpath(c)
  raise CorpusMissing(f"no Python documentation HTML in {cands}: install Debian's python3-doc "
                      "(sudo apt-get install python3-doc, or scripts/setup.sh)"
                      + (f" or fix ${CORPUS_ENV}" if env else ""))


_TOCTREE = re.compile(r'<li class="toctree-l([12])"><a class="reference internal" href="([^"]*)">(.*?)</a>', re.S)


def _chapters(index: str) -> tuple[dict[str, str], dict[str, str]]:
  """(page -> chapter title, chapter page -> chapter title), in one pass over the library index's
  toctree (li.toctree-l1: chapters; li.toctree-l2 without a fragment: the pages the chapter lists)."""
  out, pages, chapter = {}, {}, None
  for level, href, inner in _TOCTREE.findall(index):
    text = " ".join(re.sub(r"<[^>]+>", "", html.unescape(inner)).split())
    path = posixpath.normpath(posixpath.join("library", href))
    if level == "1":
      chapter = text
      if "#" not in href:
        pages[path] = text
    elif chapter and "#" not in href:
      out.setdefault(path, chapter)
  return out, pages


def load_corpus(root: str | None = None, section: str = "library") -> Corpus:
  """Parses every page under `section` of the documentation at `root` (default `corpus_dir()`): the
  library reference holds the start page, every entity and every link of the plans (a route through
  another part of the documentation is never cheaper). Raises CorpusMissing."""
  root = root or corpus_dir()
  pages, h = {}, hashlib.sha256()
  base = os.path.join(root, section)
  if not os.path.isdir(base):
    raise CorpusMissing(f"{root} has no {section}/ directory")
  for f in sorted(os.listdir(base)):
    if not f.endswith(".html"):
      continue
    path = posixpath.join(section, f)
    with open(os.path.join(base, f), encoding="utf-8", errors="replace") as fh:
      text = fh.read()
    h.update(path.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    pages[path] = parse_page(path, text)
  if START_PAGE not in pages:
    raise CorpusMissing(f"{root} has no {START_PAGE}")
  with open(os.path.join(root, START_PAGE), encoding="utf-8") as fh:
    index = fh.read()
  chapters, chapter_pages = _chapters(index)
  version = ""
  opts = os.path.join(root, "_static", "documentation_options.js")
  if os.path.isfile(opts):
    with open(opts, encoding="utf-8") as fh:
      m = re.search(r"VERSION:\s*'([^']+)'", fh.read())
      version = m.group(1) if m else ""
  return Corpus(root, pages, chapters, version, h.hexdigest()[:16], chapter_pages)


# -- questions --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hop:
  """One link of a plan: on page `page`, follow the link showing `text` to page `target`."""

  page: str
  text: str
  target: str
  target_title: str  # h1 of the target (how a reader knows it arrived)


@dataclasses.dataclass(frozen=True)
class Question:
  """One browsing question. `plan`: a link path from `start` to `answer_page` (the expert's route;
  for multi-hop the chain itself); `conditions`: the attributes behind the wording."""

  id: str
  family: str
  split: str
  start: str
  question: str
  answer: str
  answer_kind: str
  answer_page: str
  plan: tuple[Hop, ...]
  conditions: tuple[str, ...]

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "Question":
    return cls(**{**d, "plan": tuple(Hop(**h) for h in d["plan"]), "conditions": tuple(d["conditions"])})


@dataclasses.dataclass
class Suite:
  """Generated questions by family and split, and the generation counts (`stats[family]`: candidates,
  kept, trivial, unreachable, ambiguous)."""

  questions: list[Question]
  stats: dict[str, dict[str, int]]
  corpus_version: str = ""
  corpus_fingerprint: str = ""
  seed: int = 0

  @functools.cached_property
  def _by(self) -> dict[tuple[str, str], list[Question]]:
    out = collections.defaultdict(list)
    for q in self.questions:
      out[(q.family, q.split)].append(q)
    return out

  def split(self, family: str, split: str) -> list[Question]:
    """Questions of `family` in `split` ('train' / 'test'), in generation order.
    Raises KeyError for an unknown family or split."""
    if family not in FAMILIES or split not in SPLITS:
      raise KeyError(f"no split {family!r}/{split!r}; families {FAMILIES}, splits {SPLITS}")
    return self._by[(family, split)]

  def question(self, family: str, seed: int, split: str = "train") -> Question:
    """The question an episode with `seed` asks: question seed % n of the split (any int seed)."""
    qs = self.split(family, split)
    if not qs:
      raise KeyError(f"no {family} questions in split {split!r}")
    return qs[int(seed) % len(qs)]

  def as_dict(self) -> dict:
    return {"generator_version": GENERATOR_VERSION, "seed": self.seed, "corpus_version": self.corpus_version,
            "corpus_fingerprint": self.corpus_fingerprint, "stats": self.stats,
            "questions": [q.as_dict() for q in self.questions]}

  @classmethod
  def from_dict(cls, d: dict) -> "Suite":
    return cls([Question.from_dict(q) for q in d["questions"]], d["stats"], d["corpus_version"],
               d["corpus_fingerprint"], d["seed"])


def split_of(page: str, test_fraction: float = TEST_FRACTION) -> str:
  """'test' for a stable `test_fraction` of answer pages (sha256 of the path), else 'train'."""
  h = int.from_bytes(hashlib.sha256(page.encode()).digest()[:8], "big") / 2 ** 64
  return "test" if h < test_fraction else "train"


def plan_route(corpus: Corpus, start: str, goal: str, max_hops: int = MAX_HOPS) -> tuple[Hop, ...] | None:
  """Cheapest chain of followable links from `start` to `goal` of at most `max_hops` links, cost
  1 per link plus the screens scrolled to reach it (offset / CHARS_PER_SCREEN); () when start == goal;
  None when `goal` is unreachable that way."""
  if start == goal:
    return ()
  if start not in corpus.pages or goal not in corpus.pages:
    return None
  best = {(start, 0): 0.0}
  heap = [(0.0, 0, 0, start, ())]  # (cost, hops, push order: ties never compare paths, page, path)
  pushed = 0
  while heap:
    cost, hops, _, page, path = heapq.heappop(heap)
    if page == goal:
      return path
    if hops == max_hops or cost > best.get((page, hops), float("inf")):
      continue
    for target, link in corpus.pages[page].followable.items():
      if target not in corpus.pages:
        continue
      c = cost + 1 + link.offset / CHARS_PER_SCREEN
      if c < best.get((target, hops + 1), float("inf")):
        best[(target, hops + 1)] = c
        pushed += 1
        heapq.heappush(heap, (c, hops + 1, pushed, target,
                              path + (Hop(page, link.text, target, corpus.pages[target].title),)))
  return None


def _chain_is_followable(corpus: Corpus, plan: tuple[Hop, ...], start: str, goal: str, max_hops: int) -> bool:
  p = start
  for h in plan:
    if h.page != p or corpus.pages.get(p) is None or h.target not in corpus.pages[p].followable:
      return False
    p = h.target
  return p == goal and len(plan) <= max_hops


# attributes: (type, value) -> how a condition states it
def _attributes(corpus: Corpus, p: Page) -> set[tuple[str, str]]:
  mod = (p.module or "").lower()
  last = mod.split(".")[-1]
  title_words = set(_words(p.title).split())

  def ok(name: str) -> bool:  # a name that spells the module's name reveals the page
    n = name.lower()
    return len(n) >= 3 and n not in mod.split(".") and not (len(last) >= 4 and last in n)
  out = set()
  if p.path in corpus.chapters:
    out.add(("chapter", corpus.chapters[p.path]))
  out |= {("function", n) for n in p.functions if ok(n) and not n.startswith("_")}
  out |= {("class", n) for n in p.classes if ok(n) and not n.startswith("_")}
  out |= {("exception", n) for n in p.exceptions if ok(n) and not n.startswith("_")}
  for s in p.sections:
    for w in _words(s).split():
      if len(w) >= 5 and w.isalpha() and w not in STOPWORDS and w not in title_words and w not in mod:
        out.add(("section_word", w))
  if p.new_in:
    out.add(("new_in", p.new_in))
  if p.deprecated:
    out.add(("deprecated", p.deprecated))
  return out


def _say(attr: tuple[str, str], linked: bool = False) -> str:
  """A condition in words: about the page itself ('it documents ...'), or with linked=True as a
  relative clause about a page reached by a link ('that documents ...')."""
  t, v = attr
  if t == "chapter":
    return (f'that the Library Reference files under the chapter "{v}"' if linked
            else f'the Library Reference files it under the chapter "{v}"')
  if t in ("function", "class", "exception"):
    what = f'{"an" if t == "exception" else "a"} {t} named "{v}"'
    return f"that documents {what}" if linked else f"it documents {what}"
  if t == "section_word":
    return (f'with a section heading that contains the word "{v}"' if linked
            else f'one of its section headings contains the word "{v}"')
  if t == "new_in":
    return f"of a module that was new in Python {v}" if linked else f"the module was new in Python {v}"
  if t == "deprecated":
    return (f"of a module deprecated since Python {v}" if linked
            else f"the module is marked deprecated since Python {v}")
  raise ValueError(f"unknown attribute type {t!r}")


_ASK = {
    "source": "What file does that page name after \"Source code:\"?",
    "first_section": "What is the title of the first section below that page's main heading?",
    "title": "What does that page's main heading say after the module name and the dash?",
}


def _ask(kind: str, last: bool = False) -> str:
  return _ASK[kind].replace("that page", "the last page") if last else _ASK[kind]


def _multi_condition(corpus: Corpus, rng: random.Random, stats: dict, max_hops: int) -> list[Question]:
  mods = corpus.modules()
  attrs = {p.path: _attributes(corpus, p) for p in mods}
  holders: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
  for path, aa in attrs.items():
    for a in aa:
      holders[a].add(path)
  start = corpus.pages[START_PAGE]
  out = []
  for p in mods:
    for kind in ANSWER_KINDS:
      answer = p.answer(kind)
      if not answer:
        continue
      stats["candidates"] += 1
      # distinctiveness = pages sharing the attribute: unique ones reveal the page, common ones say little
      usable = sorted(a for a in attrs[p.path] if 2 <= len(holders[a]) <= MAX_DF)
      rng.shuffle(usable)
      usable.sort(key=lambda a: a[0] == "section_word")  # stable: named objects and chapters first
      cand, chosen, used_types = set(attrs), [], collections.Counter()
      for a in sorted(usable, key=lambda a: used_types[a[0]]):
        new = cand & holders[a]
        if len(new) < len(cand):
          chosen.append(a)
          used_types[a[0]] += 1
          cand = new
        if len(cand) == 1:
          break
      if cand != {p.path}:
        stats["ambiguous"] += 1
        continue
      # drop conditions the others make redundant (each kept one narrows the set)
      for a in list(chosen):
        rest = [b for b in chosen if b != a]
        if len(rest) >= 2 and set.intersection(*(holders[b] for b in rest)) == {p.path}:
          chosen = rest
      conds = "; ".join(_say(a) for a in chosen)
      text = (f"In the Python {corpus.version or '3'} documentation, find the page of the standard-library "
              f"module for which all of this holds: {conds}. {_ask(kind)}")
      if visible_in(answer, start.title + " " + start.text) or visible_in(answer, text):
        stats["trivial"] += 1
        continue
      plan = plan_route(corpus, START_PAGE, p.path, max_hops)
      if plan is None:
        stats["unreachable"] += 1
        continue
      out.append(Question(f"multi-condition/{p.path}/{kind}", "multi-condition", split_of(p.path), START_PAGE,
                          text, answer, kind, p.path, plan, tuple(f"{t}={v}" for t, v in chosen)))
      stats["kept"] += 1
  return out


def _single_out(corpus: Corpus, page: Page, target: str, rng: random.Random,
                holders_of: dict[str, set]) -> tuple[str, str] | None:
  """An attribute of `target` that no other module page that `page` links to has (by any link)."""
  others = {l.target for l in page.links if l.target != target and l.target in holders_of}
  own = sorted(holders_of[target])
  rng.shuffle(own)
  anchor = _words(page.followable[target].text)
  for a in own:
    if a[0] == "section_word" and a[1] in anchor.split():
      continue
    if a[0] != "chapter" and _words(a[1]) in anchor:
      continue
    if all(a not in holders_of[t] for t in others):
      return a
  return None


def _multi_hop(corpus: Corpus, rng: random.Random, stats: dict, max_hops: int,
               depths: tuple[int, ...] = (2, 3), per_start: int = 2) -> list[Question]:
  mods = {p.path: p for p in corpus.modules()}
  attrs = {path: _attributes(corpus, p) for path, p in mods.items()}
  out = []
  for s in sorted(mods):
    for k in range(per_start):
      depth = depths[k % len(depths)]
      kind = ANSWER_KINDS[rng.randrange(len(ANSWER_KINDS))]
      stats["candidates"] += 1
      chain, feats, cur, seen = [], [], s, {s}
      while len(chain) < depth:
        page = corpus.pages[cur]
        # module pages it links to, near the top first (fewer screens to scroll)
        nexts = [t for t, l in sorted(page.followable.items(), key=lambda kv: kv[1].offset)
                 if t in mods and t not in seen and l.offset < 6 * CHARS_PER_SCREEN]
        rng.shuffle(nexts)
        step = None
        for t in nexts:
          f = _single_out(corpus, page, t, rng, attrs)
          if f is not None and (len(chain) + 1 < depth or mods[t].answer(kind)):
            step = (t, f)
            break
        if step is None:
          break
        t, f = step
        chain.append(Hop(cur, page.followable[t].text, t, mods[t].title))
        feats.append(f)
        seen.add(t)
        cur = t
      if len(chain) < depth:
        stats["ambiguous"] += 1
        continue
      last = mods[cur]
      answer = last.answer(kind)
      parts = [f"Start on the documentation page of the {mods[s].module} module."]
      for i, f in enumerate(feats):
        who = "It links to" if i == 0 else "That page in turn links to"
        parts.append(f"{who} another module's page {_say(f, linked=True)}.")
      text = " ".join(parts) + " " + _ask(kind, last=True)
      start = corpus.pages[s]
      if visible_in(answer, start.title + " " + start.text) or visible_in(answer, text):
        stats["trivial"] += 1
        continue
      plan = tuple(chain)
      if not _chain_is_followable(corpus, plan, s, cur, max_hops):
        stats["unreachable"] += 1
        continue
      out.append(Question(f"multi-hop/{s}/{k}", "multi-hop", split_of(cur), s, text, answer, kind, cur, plan,
                          tuple(f"{t}={v}" for t, v in feats)))
      stats["kept"] += 1
  return out


def _find_page(corpus: Corpus, stats: dict, entries_range: tuple[int, int] = FIND_PAGE_ENTRIES) -> list[Question]:
  """One question per module of a chapter whose page lists between entries_range[0] and [1] modules (the
  toctree links showing their module page's title), in each split; a candidate (module, split) of a
  chapter with too few entries counts as trivial, of one with too many as unreachable."""
  mods = {p.path: p for p in corpus.modules()}
  out = []
  for chapter_page, chapter in sorted(corpus.chapter_pages.items()):
    page = corpus.pages.get(chapter_page)
    if page is None:
      continue
    entries, seen = [], set()
    for link in page.links:  # document order: the list's entries show their page's title
      if link.target in mods and link.target not in seen and link.text == mods[link.target].title:
        seen.add(link.target)
        entries.append(link)
    own = [l for l in entries if corpus.chapters.get(l.target) == chapter]  # not those filed elsewhere
    stats["candidates"] += len(own) * len(SPLITS)
    if len(entries) < entries_range[0] or len(entries) > entries_range[1]:
      stats["trivial" if len(entries) < entries_range[0] else "unreachable"] += len(own) * len(SPLITS)
      continue
    for link in own:
      m = mods[link.target]
      for split in SPLITS:
        out.append(Question(f"find-page/{link.target}/{split}", "find-page", split, chapter_page,
                            f"Open the documentation page of the {m.module} module.", m.module, "page",
                            link.target, (Hop(chapter_page, link.text, link.target, m.title),),
                            (f"chapter={chapter}", f"entries={len(entries)}")))
        stats["kept"] += 1
  return out


def generate(corpus: Corpus, seed: int = 0, max_hops: int = MAX_HOPS) -> Suite:
  """Every question of every family from `corpus`, deterministic for `seed` (see the module docstring)."""
  stats = {f: collections.Counter(candidates=0, kept=0, trivial=0, unreachable=0, ambiguous=0) for f in FAMILIES}
  qs = _multi_condition(corpus, random.Random(f"{seed}/multi-condition"), stats["multi-condition"], max_hops)
  qs += _multi_hop(corpus, random.Random(f"{seed}/multi-hop"), stats["multi-hop"], max_hops)
  qs += _find_page(corpus, stats["find-page"])
  return Suite(qs, {f: dict(c) for f, c in stats.items()}, corpus.version, corpus.fingerprint, seed)


def cache_dir() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "tars_jax", "browsing")


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
  """sha256 of this module's source: an edited generator never reads a suite cached by another."""
  with open(__file__, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:12]


def _quick_fingerprint(root: str) -> str:
  """Cheap identity of the installed corpus for the cache key: paths, sizes and mtimes of its pages."""
  h = hashlib.sha256(root.encode())
  for d, _, files in sorted(os.walk(root)):
    for f in sorted(files):
      if f.endswith(".html"):
        st = os.stat(os.path.join(d, f))
        h.update(f"{os.path.relpath(os.path.join(d, f), root)}:{st.st_size}:{int(st.st_mtime)}\0".encode())
  return h.hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def suite(seed: int = 0, root: str | None = None, use_cache: bool = True) -> Suite:
  """The question suite of the installed corpus (generated once per process; cached on disk, see the
  module docstring). Raises CorpusMissing."""
  root = root or corpus_dir()
  path = os.path.join(cache_dir(), f"v{GENERATOR_VERSION}-{_code_hash()}-{_quick_fingerprint(root)}-seed{seed}.json")
  if use_cache and os.path.isfile(path):
    try:
      with open(path) as f:
        return Suite.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
      pass  # a broken cache file is rebuilt
  s = generate(load_corpus(root), seed)
  if use_cache:
    try:
      os.makedirs(cache_dir(), exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        json.dump(s.as_dict(), f)
      os.replace(tmp, path)
    except OSError:
      pass  # read-only home: generate again next time
  return s


def main(argv=None) -> int:
  import argparse
  ap = argparse.ArgumentParser(description="Generate the GUI-Browsing questions and print their counts.")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--show", type=int, default=2, help="questions printed per family")
  ap.add_argument("--no-cache", action="store_true")
  a = ap.parse_args(argv)
  s = suite(a.seed, use_cache=not a.no_cache)
  print(f"corpus: Python {s.corpus_version} documentation ({corpus_dir()}), fingerprint {s.corpus_fingerprint}")
  for fam in FAMILIES:
    st = s.stats[fam]
    print(f"{fam}: {len(s.split(fam, 'train'))} train + {len(s.split(fam, 'test'))} test kept of "
          f"{st['candidates']} candidates; filtered: trivial {st['trivial']}, unreachable {st['unreachable']}, "
          f"ambiguous {st['ambiguous']}")
    for q in s.split(fam, "test")[:a.show]:
      print(f"  [{q.id}] {q.question}\n    -> {q.answer!r} ({len(q.plan)} links from {q.start})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
