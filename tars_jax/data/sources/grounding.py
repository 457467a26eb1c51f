"""Grounding and perception examples from sandbox pages, at no rollout cost.

Before any task data, a GUI model learns where things are and what they say (UI-TARS-2 report,
section 2.3: GUI grounding and perception data in continual pre-training / SFT). From the first
screenshot of a MiniWoB++ page and its visible DOM elements (`SandboxClient.elements`: tag, text,
state and pixel box of every visible element of the task area), two kinds of one-turn examples are
made, in the policy's own episode format (the agent loop's first turn, `rollout/agent_loop.py`):

  where:  instruction `Where is the button "Submit"?` / `Where is "nam"?` / `Where is the text field?`
          reply       `Thought: \\nAction: click(start_box='(x,y)')`   x, y: a grid point inside the box
  what:   instruction `What is at (x,y)?`
          reply       `Thought: \\nAction: finished(content='<the element text>')`

Points are on the policy's coordinate grid (`agent/grammar.py` coord_format: 'tens3' = 000..990 in
tens, 'fixed3', 'int' on 0..1000), relative to the screenshot. Which elements (`page_targets`):

- where: leaf elements with text, and buttons, links, tabs, checkboxes, radio buttons, text fields
  and dropdowns, named by their text, label, placeholder or shown value (`_name`); a field without a
  name is asked for by its role alone when it is the page's only one. A question whose answer is not
  unique on the page (another element with the same role and name, or the same visible text) is
  skipped, and so is anything in the instruction bar (y < 50 px): the instruction is replaced by
  the question, so clicks should land on the task area.
- what: leaf elements whose text the grammar's `finished(content=...)` can write (printable ASCII
  without quote or backslash, at most `max_content_bytes`).
- neither when the point lies in another leaf element with another text, or such an element covers
  most of the box or most of it lies inside (overlays; inline text wrapped over two lines, whose box
  is the union of both).

A point is the element centre rounded to the grid; when that falls outside the box (less
`margin_px`), the nearest grid point inside is used per axis; an element with no grid point inside
is dropped (too small to hit on the grid). `grounding_accuracy` scores a policy's own samples on such
examples (a click inside the box; exact match of the normalised content).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from envs_bridge.client import client_for
from tars_jax.agent import actions as A
from tars_jax.agent import prompts
from tars_jax.agent.grammar import CONTENT_CHARSET, Grammar, walk
from tars_jax.agent.images import preprocess
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn
from tars_jax.rollout.episode import with_retries

KINDS = ("where", "what")
# Grid of each coord_format (agent/grammar.py): (largest value, step) on the 0..1000 relative grid.
GRID = {"tens3": (990, 10), "fixed3": (999, 1), "int": (1000, 1)}
INSTRUCTION_BAR_PX = 50  # MiniWoB's yellow instruction bar: y < 50 px of the 160 x 210 screen
NON_TEXT_INPUT_TYPES = ("checkbox", "radio", "button", "submit", "reset", "date", "time", "range",
                        "color", "file", "hidden", "image")
_CONTENT_OK = frozenset(CONTENT_CHARSET)
# MiniWoB++ tasks whose first page shows varied widgets with names (buttons, links, tabs, checkboxes,
# radio buttons, text / date / time fields, dropdowns, tables, lists, menus, calendars). Left out:
# pages without text targets (shapes, colours, canvases, sliders: click-shape, click-color, draw-*,
# use-colorwheel, tic-tac-toe), moving or timed ones (chase-circle, moving-items, simon-says) and
# list boxes that scroll inside (click-scroll-list: the sandbox's boxes are clipped to the viewport
# only, so the hidden options would get boxes below the list).
DEFAULT_TASKS = tuple("miniwob/" + t for t in (
    "click-test", "click-test-2", "click-button", "click-button-sequence", "click-checkboxes",
    "click-checkboxes-soft", "click-option", "click-link", "click-tab", "click-tab-2", "click-menu",
    "click-collapsible-2", "click-widget", "book-flight", "buy-ticket", "email-inbox", "enter-date",
    "enter-password", "enter-text", "enter-time", "form-sequence-3", "grid-coordinate", "identify-shape",
    "login-user", "multi-layouts", "navigate-tree", "order-food", "phone-book", "read-table",
    "search-engine", "social-media", "use-autocomplete", "use-spinner", "daily-calendar"))

# act(prompts, images) -> [(reply ids incl. EOS, logprobs, states)]: `BatchedPolicy.act`.
ActFn = Callable[[list[list[int]], list[list[np.ndarray]]], list[tuple[list[int], Any, Any]]]


@dataclasses.dataclass(frozen=True)
class Target:
  """One question about a page and its answer.

  kind: 'where' | 'what'. role: 'button', 'link', 'tab', 'checkbox', 'radio button', 'text field',
  'date field', 'time field', 'dropdown', or '' for plain text. text: the element's name (where) or
  visible text (what); '' for a role-only question. box: (x, y, width, height) pixels of the
  screenshot. point: the grid point (model coordinates) of the click / the question.
  """

  kind: str
  instruction: str
  reply: str
  text: str
  role: str
  box: tuple[float, float, float, float]
  point: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class EpisodeFormat:
  """How the policy reads a turn (`rollout/agent_loop.py`): system prompt, image slots and size, the
  reply grammar and its coordinate grid. `from_parts` takes them from `train.state.build(config)`."""

  tokenizer: ByteTokenizer
  system: str
  n_img_tokens: int
  image_hw: tuple[int, int]  # (H, W) pixels the policy sees
  grammar: Grammar
  coord_format: str  # 'tens3' | 'fixed3' | 'int'
  max_content_bytes: int  # the grammar's cap on finished(content=...)

  def __post_init__(self):
    if self.coord_format not in GRID:
      raise ValueError(f"unknown coord_format {self.coord_format!r}; expected one of {sorted(GRID)}")

  @classmethod
  def from_parts(cls, parts) -> "EpisodeFormat":
    """The format of `train.state.build(config)`'s parts (loop_cfg, grammar, config.grammar)."""
    g = parts.config.grammar
    return cls(parts.tokenizer, parts.loop_cfg.system, parts.loop_cfg.n_img_tokens, tuple(parts.image_hw),
               parts.grammar, g.coord_format, int(g.max_content_bytes))


@dataclasses.dataclass
class Page:
  """A sandbox page as collected: first observation of `task` / `seed`.

  image: [h, w, 3] uint8 screenshot as served (160 x 210 for MiniWoB); elements: `SandboxClient.elements`.
  """

  task: str
  seed: int
  instruction: str
  image: np.ndarray
  elements: list[dict]


@dataclasses.dataclass
class Example:
  """One one-turn training episode and the target it teaches (`extra()`: what records store)."""

  episode: Episode
  target: Target
  screen_wh: tuple[int, int]  # (W, H) pixels of the screenshot the box is measured in

  def extra(self) -> dict:
    """{'kind', 'box' [x, y, w, h] px, 'text', 'role', 'point' [x, y] grid, 'screen_wh' [W, H]}."""
    t = self.target
    return {"kind": t.kind, "box": [float(v) for v in t.box], "text": t.text, "role": t.role,
            "point": list(t.point), "screen_wh": list(self.screen_wh)}


# ---------------------------------------------------------------------------------------------------
# Grid points


def format_coord(v: int, coord_format: str) -> str:
  """A grid value as the grammar writes it: 'tens3' / 'fixed3' three digits, 'int' plain."""
  return str(v) if coord_format == "int" else f"{v:03d}"


def grid_value_inside(lo_px: float, hi_px: float, size_px: float, coord_format: str) -> int | None:
  """The grid value (0..1000 relative) nearest to the centre of [lo_px, hi_px] whose pixel
  (value / 1000 * size_px) lies in that interval; None when no grid value does.

  Raises: ValueError for an unknown coord_format or size_px <= 0.
  """
  if coord_format not in GRID:
    raise ValueError(f"unknown coord_format {coord_format!r}; expected one of {sorted(GRID)}")
  if size_px <= 0:
    raise ValueError(f"size_px must be > 0, got {size_px}")
  top, step = GRID[coord_format]
  eps = 1e-9  # a grid pixel exactly on the boundary counts as inside
  g_lo = max(0, math.ceil((lo_px * 1000 / size_px - eps) / step) * step)
  g_hi = min(top, math.floor((hi_px * 1000 / size_px + eps) / step) * step)
  if g_lo > g_hi:
    return None
  centre = (lo_px + hi_px) / 2 * 1000 / size_px
  g = int(round(centre / step)) * step
  return int(min(max(g, g_lo), g_hi))


def grid_point(box, screen_wh: tuple[int, int], coord_format: str,
               margin_px: float = 1.0) -> tuple[int, int] | None:
  """Grid point (model coordinates) nearest to the centre of `box` (x, y, w, h px) among those at
  least `margin_px` inside it; None when the box is too small for any."""
  x, y, w, h = box
  gx = grid_value_inside(x + margin_px, x + w - margin_px, screen_wh[0], coord_format)
  gy = grid_value_inside(y + margin_px, y + h - margin_px, screen_wh[1], coord_format)
  return None if gx is None or gy is None else (gx, gy)


def point_in_box(point_px: tuple[float, float], box) -> bool:
  x, y, w, h = box
  return x <= point_px[0] <= x + w and y <= point_px[1] <= y + h


# ---------------------------------------------------------------------------------------------------
# Elements -> targets


def normalize_text(s: str) -> str:
  """Casefolded, whitespace collapsed and stripped: how texts are compared (uniqueness, scoring)."""
  return " ".join(str(s).split()).casefold()


def content_ok(text: str, max_content_bytes: int) -> bool:
  """True if `finished(content='<text>')` is in the grammar: non-empty printable ASCII without quote
  or backslash, at most max_content_bytes bytes."""
  return 0 < len(text.encode()) <= max_content_bytes and all(c in _CONTENT_OK for c in text)


def _box(e: dict) -> tuple[float, float, float, float]:
  return (float(e["x"]), float(e["y"]), float(e["width"]), float(e["height"]))


def element_role(e: dict) -> str:
  """The role a person would name an element by ('' for plain text); see `Target.role`."""
  tag, typ, cls = e["tag"], (e.get("type") or "").lower(), (e.get("classes") or "").split()
  if tag == "button" or (tag == "input" and typ in ("button", "submit", "reset")):
    return "button"
  if tag == "input" and typ == "checkbox":
    return "checkbox"
  if tag == "input" and typ == "radio":
    return "radio button"
  if tag == "input" and typ in ("date", "time"):
    return f"{typ} field"
  # an unknown type (click-widget's type="input") is a text field to the browser
  if tag == "textarea" or (tag == "input" and typ not in NON_TEXT_INPUT_TYPES):
    return "text field"
  if tag == "select":
    return "dropdown"
  if "ui-tabs-anchor" in cls:
    return "tab"
  if tag == "a" or "alink" in cls:
    return "link"
  return ""


def _label_text(e: dict) -> str:
  return e["text"].strip().rstrip(":").strip()


def _is_label(p: dict) -> bool:
  """A leaf that labels the field after it: a <label>, a table header, or text ending in ':'."""
  return p["leaf"] and bool(p["text"]) and (p["tag"] in ("label", "th") or p["text"].rstrip().endswith(":"))


def _name(els: list[dict], i: int, role: str) -> str:
  """The name of element i: its text (buttons, links, tabs, plain text); for checkboxes and radio
  buttons the label wrapping them (the element just before, in document order) or the label just
  after on the same line; for fields the placeholder, else a label (`_is_label`) among the three
  elements before it, above or left of it, else the value it shows."""
  e = els[i]
  if role in ("", "button", "link", "tab"):
    return e["text"]
  x, y, w, h = _box(e)
  if role in ("checkbox", "radio button"):
    if i > 0 and els[i - 1]["tag"] == "label" and not els[i - 1]["leaf"]:
      return _label_text(els[i - 1])
    if i + 1 < len(els) and els[i + 1]["tag"] == "label":
      n = els[i + 1]
      if abs((n["y"] + n["height"] / 2) - (y + h / 2)) <= 8:
        return _label_text(n)
    return ""
  if role == "text field" and not e.get("value") and e["text"]:
    return _label_text(e)  # the placeholder (the sandbox gives value or placeholder as text)
  for j in range(i - 1, max(i - 4, -1), -1):
    p = els[j]
    if _is_label(p) and p["y"] <= y + h and p["x"] <= x + w and p["y"] + p["height"] >= y - 25:
      return _label_text(p)
  return (e.get("value") or "") if role == "text field" else ""


def _overlap_fraction(a, b) -> float:
  """Area shared by boxes a and b (x, y, w, h) over the smaller one's area (0 for an empty box)."""
  dx = min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0])
  dy = min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1])
  small = min(a[2] * a[3], b[2] * b[3])
  return max(dx, 0.0) * max(dy, 0.0) / small if small > 0 else 0.0


def page_targets(elements: Sequence[dict], screen_wh: tuple[int, int], *, coord_format: str,
                 max_content_bytes: int, kinds: Sequence[str] = KINDS, max_where_chars: int = 40,
                 margin_px: float = 1.0, skipped: collections.Counter | None = None) -> list[Target]:
  """The where / what targets of one page (module docstring for the rules), in document order.

  Args:
    elements: `SandboxClient.elements` of the page (boxes in screenshot pixels).
    screen_wh: (W, H) pixels of the screenshot (160, 210 for MiniWoB).
    coord_format: the grammar's ('tens3' | 'fixed3' | 'int').
    max_content_bytes: the grammar's cap on finished content (longer texts give no 'what').
    max_where_chars: longer names give no 'where' (paragraphs are no click targets).
    margin_px: a point must lie this far inside its box.
    skipped: if given, counts why elements were left out ('where/ambiguous', 'what/text', ...).
  Raises: ValueError for an unknown kind or coord_format, or an element without the sandbox's keys.
  """
  bad = sorted(set(kinds) - set(KINDS))
  if bad:
    raise ValueError(f"unknown kinds {bad}; expected a subset of {KINDS}")
  if coord_format not in GRID:
    raise ValueError(f"unknown coord_format {coord_format!r}; expected one of {sorted(GRID)}")
  els = list(elements)
  need = ("tag", "text", "leaf", "x", "y", "width", "height")
  for k, e in enumerate(els):
    missing = [key for key in need if key not in e]
    if missing:
      raise ValueError(f"element {k} lacks {missing} (expected SandboxClient.elements dicts): {e}")
  skipped = skipped if skipped is not None else collections.Counter()
  fmt = lambda p: f"({format_coord(p[0], coord_format)},{format_coord(p[1], coord_format)})"
  # <option>s of a list box scroll inside it: the viewport-clipped boxes of the sandbox would put
  # the hidden ones below it
  els = [e for e in els if e["tag"] != "option"]
  roles = [element_role(e) for e in els]
  names = [_name(els, i, r) for i, r in enumerate(roles)]
  leaves = [(k, _box(e), normalize_text(e["text"])) for k, e in enumerate(els) if e["leaf"]]
  # What a reader sees: the text of every leaf (the instruction bar's too), for uniqueness.
  visible = collections.Counter(t for _, _, t in leaves if t)
  by_role = collections.Counter((r, normalize_text(n)) for r, n in zip(roles, names) if r)
  role_count = collections.Counter(r for r in roles if r)
  out: list[Target] = []
  for i, e in enumerate(els):
    role, name, box, text = roles[i], names[i], _box(e), e["text"]
    wants_where = "where" in kinds and bool(role or (e["leaf"] and text))
    wants_what = "what" in kinds and e["leaf"] and bool(text) and role not in ("checkbox", "radio button", "dropdown")
    if not (wants_where or wants_what):
      continue
    pt = grid_point(box, screen_wh, coord_format, margin_px)
    # Another leaf with another text under the point, or mostly inside the box (an overlay, or an
    # inline element wrapped over two lines: its box is the union of both lines and its centre may
    # be on neither): which element is meant is unclear. Boxes that only touch (click-test-2's
    # randomly placed buttons) are fine.
    mine = normalize_text(text)
    px = None if pt is None else (pt[0] / 1000 * screen_wh[0], pt[1] / 1000 * screen_wh[1])
    overlap = any(k != i and t != mine and (_overlap_fraction(box, b) > 0.5 or (px and point_in_box(px, b)))
                  for k, b, t in leaves)
    if wants_where and box[1] + box[3] / 2 >= INSTRUCTION_BAR_PX:
      key = normalize_text(name)
      if pt is None:
        skipped["where/too_small"] += 1
      elif len(name) > max_where_chars or '"' in name or (name and not any(c.isalnum() for c in name)):
        skipped["where/text"] += 1
      elif not name and role not in ("text field", "date field", "time field", "dropdown"):
        skipped["where/unnamed"] += 1
      elif (by_role[(role, key)] > 1 if role and name else role_count[role] > 1 if role
            else visible[key] > 1):
        skipped["where/ambiguous"] += 1
      elif overlap:
        skipped["where/overlap"] += 1
      else:
        q = (f'the {role} "{name}"' if name else f"the {role}") if role else f'"{name}"'
        out.append(Target("where", f"Where is {q}?", f"Thought: \nAction: click(start_box='{fmt(pt)}')",
                          name, role, box, pt))
    if wants_what:
      if not content_ok(text, max_content_bytes):
        skipped["what/text"] += 1
      elif pt is None:
        skipped["what/too_small"] += 1
      elif overlap:
        skipped["what/overlap"] += 1
      else:
        out.append(Target("what", f"What is at {fmt(pt)}?", f"Thought: \nAction: finished(content='{text}')",
                          text, role, box, pt))
  return out


# ---------------------------------------------------------------------------------------------------
# Targets -> episodes


def make_episode(fmt: EpisodeFormat, target: Target, image: np.ndarray, task: str, seed: int) -> Episode:
  """A one-turn Episode exactly as the agent loop's first turn: prefix `BOS <system>\\n<question>\\n`,
  observation ids with `n_img_tokens` image slots, the screenshot preprocessed to `image_hw`
  ([H, W, 3] uint8), reply ids = reply bytes + EOS (loss on those), grammar states [n] int32,
  logprobs [n] float32 zeros (not sampled).

  Raises: ValueError when the grammar does not accept the reply (e.g. 'finished' is not among its
  actions, or another coord_format).
  """
  tok = fmt.tokenizer
  reply_ids = tok.encode(target.reply) + [tok.eos_id]
  states = walk(fmt.grammar, reply_ids)
  end = int(fmt.grammar.table[states[-1], reply_ids[-1]]) if states[-1] >= 0 else -1
  if (states < 0).any() or end != fmt.grammar.done:
    raise ValueError(f"the policy's grammar does not accept the {target.kind!r} reply {target.reply!r} "
                     f"(its actions need 'click' and 'finished', coord_format {fmt.coord_format!r})")
  turn = Turn(image=preprocess(image, fmt.image_hw), obs_ids=prompts.encode_observation(tok, fmt.n_img_tokens),
              reply_ids=reply_ids, logprobs=np.zeros(len(reply_ids), np.float32), states=states,
              text=target.reply, done=True)
  return Episode(task=task, seed=seed, instruction=target.instruction,
                 prefix_ids=prompts.encode_episode_prefix(tok, target.instruction, fmt.system), turns=[turn])


def page_examples(fmt: EpisodeFormat, page: Page, kinds: Sequence[str] = KINDS, max_where_chars: int = 40,
                  margin_px: float = 1.0, skipped: collections.Counter | None = None) -> list[Example]:
  """Every example of one page (`page_targets` -> `make_episode`), sharing one preprocessed image."""
  h, w = page.image.shape[:2]
  targets = page_targets(page.elements, (w, h), coord_format=fmt.coord_format,
                         max_content_bytes=fmt.max_content_bytes, kinds=kinds,
                         max_where_chars=max_where_chars, margin_px=margin_px, skipped=skipped)
  image = preprocess(page.image, fmt.image_hw)  # once per page: its examples share the array
  return [Example(make_episode(fmt, t, image, page.task, page.seed), t, (w, h)) for t in targets]


def count_examples(examples: Iterable[Example]) -> dict[str, dict[str, int]]:
  """{task: {'where': n, 'what': n}} (every kind present, 0 when none)."""
  out: dict[str, dict[str, int]] = {}
  for ex in examples:
    d = out.setdefault(ex.episode.task, dict.fromkeys(KINDS, 0))
    d[ex.target.kind] += 1
  return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------------
# Collection from sandbox servers


def split_jobs(tasks: Sequence[str], seeds: int, heldout_seeds: int, heldout_offset: int,
               train_offset: int = 0, heldout_tasks: Sequence[str] = ()
               ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
  """(train jobs, held-out jobs) of (task, seed): train = every task x train_offset + [0, seeds);
  held-out = (tasks + heldout_tasks) x heldout_offset + [0, heldout_seeds). heldout_tasks are never
  in train.

  Raises: ValueError when the two seed ranges overlap, a count is negative, or a task is both a
  train and a held-out-only task.
  """
  if seeds < 0 or heldout_seeds < 0:
    raise ValueError(f"seed counts must be >= 0, got {seeds}, {heldout_seeds}")
  if seeds and heldout_seeds and (train_offset < heldout_offset + heldout_seeds
                                  and heldout_offset < train_offset + seeds):
    raise ValueError(f"train seeds [{train_offset}, {train_offset + seeds}) overlap held-out seeds "
                     f"[{heldout_offset}, {heldout_offset + heldout_seeds})")
  both = sorted(set(tasks) & set(heldout_tasks))
  if both:
    raise ValueError(f"tasks {both} are both train and held-out-only tasks")
  train = [(t, train_offset + k) for t in tasks for k in range(seeds)]
  held = [(t, heldout_offset + k) for t in list(tasks) + list(heldout_tasks) for k in range(heldout_seeds)]
  return train, held


@dataclasses.dataclass
class CollectStats:
  pages: int = 0
  lost: int = 0  # pages given up after every retry (sandbox unavailable)
  retries: int = 0
  lost_jobs: list = dataclasses.field(default_factory=list)


async def _page(client, task: str, seed: int) -> Page:
  sid, obs = await client.open(task, seed)
  try:
    els = await client.elements(sid)
  finally:
    try:
      await client.close(sid)
    except Exception:  # best-effort: the server reclaims it by lease anyway
      pass
  return Page(task, seed, obs.info.get("instruction", ""), obs.image(), els)


async def collect_pages(clients: Sequence, jobs: Sequence[tuple[str, int]], *, concurrency: int = 8,
                        max_retries: int = 2, stats: CollectStats | None = None,
                        on_page: Callable[[Page], None] | None = None) -> list[Page]:
  """The first page (screenshot + elements, no step) of every (task, seed) job, `concurrency` sessions
  at a time over `clients` (`envs_bridge.client.SandboxClient`, round-robin); in job order, lost
  pages left out (counted in `stats`). `on_page` is called as each page arrives (a progress bar).

  A page whose session fails retryably is retried up to max_retries times (`episode.with_retries`).
  Raises: other sandbox errors at once (UnknownTask for a misspelt task, Unauthorized, ...).
  """
  if not clients:
    raise ValueError("collect_pages needs at least one sandbox client")
  stats = stats if stats is not None else CollectStats()
  sem = asyncio.Semaphore(max(1, concurrency))

  def lost(attempt: int, _: BaseException) -> None:
    if attempt < max_retries:
      stats.retries += 1

  async def one(k: int, task: str, seed: int) -> Page | None:
    async with sem:
      page = await with_retries(lambda attempt: _page(client_for(clients, task, k + attempt), task, seed),
                                retries=max_retries, what=f"page {task}/{seed}", on_loss=lost)
      if page is None:
        stats.lost += 1
        stats.lost_jobs.append((task, seed))
        return None
    stats.pages += 1
    if on_page:
      on_page(page)
    return page

  pages = await asyncio.gather(*[one(k, t, s) for k, (t, s) in enumerate(jobs)])
  return [p for p in pages if p is not None]


# ---------------------------------------------------------------------------------------------------
# Measurement


def _target_of(item) -> tuple[Episode, dict]:
  if isinstance(item, Example):
    return item.episode, item.extra()
  ep, extra = item
  if "kind" not in extra and isinstance(extra.get("extra"), dict):
    extra = extra["extra"]  # a records provenance dict with the extra nested
  return ep, extra


def score_reply(reply: str, extra: dict, screen_wh: tuple[int, int] = (160, 210)) -> bool:
  """True if a reply answers its target: where = a click whose point lies in extra['box'] (x, y, w, h
  px of a screen of extra['screen_wh'] or `screen_wh`); what = finished content equal to
  extra['text'] after `normalize_text`. A reply that does not parse is wrong.
  Raises: ValueError for an unknown extra['kind']."""
  kind = extra["kind"]
  if kind not in KINDS:
    raise ValueError(f"unknown target kind {kind!r}; expected one of {KINDS}")
  try:
    action = A.parse(reply)
  except A.ActionParseError:
    return False
  if kind == "where":
    if not isinstance(action, A.Click):
      return False
    w, h = extra.get("screen_wh", screen_wh)
    return point_in_box((action.x * w, action.y * h), extra["box"])
  return isinstance(action, A.Finished) and normalize_text(action.content) == normalize_text(extra["text"])


def grounding_accuracy(act_fn: ActFn, examples: Sequence, *, tokenizer: ByteTokenizer = ByteTokenizer(),
                       screen_wh: tuple[int, int] = (160, 210), chunk: int = 256) -> dict:
  """How well a policy's own samples answer grounding examples.

  Args:
    act_fn: `parts.batched_policy(params, batch_size, seed).act` (prompts, images) -> [(ids, ...)].
    examples: `Example`s, or (Episode, extra) pairs as stored in records (extra with 'kind', 'box',
      'text', optionally 'screen_wh'; a provenance dict holding them under 'extra' also works).
      The prompt is the episode's prefix + first observation; its first turn's image is shown.
    screen_wh: (W, H) px of the screenshots the boxes are in, when an extra has no 'screen_wh'.
    chunk: examples per act_fn call.
  Returns: {'where_hit': float, 'what_exact': float, 'n_where': int, 'n_what': int}; a rate is NaN
    when there are no examples of its kind.
  """
  items = [_target_of(x) for x in examples]
  hits = {k: [] for k in KINDS}
  for s in range(0, len(items), chunk):
    part = items[s:s + chunk]
    prompts_ids = [list(ep.prefix_ids) + list(ep.turns[0].obs_ids) for ep, _ in part]
    images = [[ep.turns[0].image] for ep, _ in part]
    replies = act_fn(prompts_ids, images)
    if len(replies) != len(part):
      raise ValueError(f"act_fn returned {len(replies)} replies for {len(part)} prompts")
    for (ep, extra), (ids, *_rest) in zip(part, replies):
      text = tokenizer.decode(ids)  # special ids (EOS, PAD) dropped
      hits[extra["kind"]].append(score_reply(text, extra, screen_wh))
  rate = lambda v: float(np.mean(v)) if v else float("nan")
  return {"where_hit": rate(hits["where"]), "what_exact": rate(hits["what"]),
          "n_where": len(hits["where"]), "n_what": len(hits["what"])}
