"""File operations of the GUI-SDK, confined to one session directory (report sections 2.1-2.2).

Every path an agent writes is relative to the session directory (a leading '/' means the session
root, as in a container); `resolve` refuses any path whose real location — after '..' and symlinks
— is outside it, with the reason. Outputs are capped (`MAX_READ_BYTES`, `MAX_LIST`, `MAX_MATCHES`)
and marked when truncated, so a huge file cannot flood an observation.
"""

from __future__ import annotations

import os

MAX_READ_BYTES = 16_384  # read_file shows at most this many bytes
MAX_WRITE_BYTES = 1 << 20  # write_file refuses more
MAX_LIST = 200  # list_files entries shown
MAX_MATCHES = 100  # search_files matching lines shown
MAX_SEARCH_FILE_BYTES = 1 << 20  # files larger than this are skipped by search_files
TRUNC = "\n[truncated: {what}]"


class PathRefused(ValueError):
  """A path outside the session directory (or otherwise unusable); `.reason` says why."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def resolve(root: str, path: str) -> str:
  """Real absolute path of `path` inside `root`.

  Args: root: the session directory (absolute); path: as the agent wrote it, relative to root
    ('/x' = root/x).
  Raises: PathRefused if the path is empty, contains NUL, or its real path (symlinks followed)
    leaves root.
  """
  if not isinstance(path, str) or not path.strip():
    raise PathRefused("empty path")
  if "\x00" in path:
    raise PathRefused("path contains a NUL byte")
  root = os.path.realpath(root)
  full = os.path.realpath(os.path.join(root, path.lstrip("/")))
  if full != root and not full.startswith(root + os.sep):
    raise PathRefused(f"path {path!r} is outside the session directory")
  return full


def _rel(root: str, full: str) -> str:
  r = os.path.relpath(full, os.path.realpath(root))
  return "." if r == "." else r


def read_file(root: str, path: str) -> str:
  """Text of a file (UTF-8, undecodable bytes replaced), at most MAX_READ_BYTES, marked if cut.

  Raises: PathRefused (outside root, missing, a directory).
  """
  full = resolve(root, path)
  if not os.path.isfile(full):
    raise PathRefused(f"{path!r} is not a file" if os.path.exists(full) else f"{path!r} does not exist")
  with open(full, "rb") as f:
    data = f.read(MAX_READ_BYTES + 1)
  text = data[:MAX_READ_BYTES].decode("utf-8", errors="replace")
  if len(data) > MAX_READ_BYTES:
    text += TRUNC.format(what=f"file larger than {MAX_READ_BYTES} bytes")
  return text


def write_file(root: str, path: str, content: str) -> str:
  """Creates or overwrites a file (parent directories created); returns a one-line confirmation.

  Raises: PathRefused (outside root, a directory, content over MAX_WRITE_BYTES).
  """
  full = resolve(root, path)
  data = content.encode("utf-8")
  if len(data) > MAX_WRITE_BYTES:
    raise PathRefused(f"content of {len(data)} bytes is over the {MAX_WRITE_BYTES}-byte limit")
  if os.path.isdir(full):
    raise PathRefused(f"{path!r} is a directory")
  os.makedirs(os.path.dirname(full), exist_ok=True)
  with open(full, "wb") as f:
    f.write(data)
  return f"wrote {len(data)} bytes to {_rel(root, full)}"


def list_files(root: str, path: str = ".") -> str:
  """Entries of a directory, sorted, one per line: `name/` for directories, `name  <size>` for files.

  Raises: PathRefused (outside root, missing, not a directory).
  """
  full = resolve(root, path)
  if not os.path.isdir(full):
    raise PathRefused(f"{path!r} is not a directory" if os.path.exists(full) else f"{path!r} does not exist")
  names = sorted(os.listdir(full))
  lines = []
  for n in names[:MAX_LIST]:
    p = os.path.join(full, n)
    lines.append(f"{n}/" if os.path.isdir(p) else f"{n}  {os.path.getsize(p) if os.path.isfile(p) else 0}")
  out = "\n".join(lines) if lines else "(empty)"
  if len(names) > MAX_LIST:
    out += TRUNC.format(what=f"{len(names) - MAX_LIST} more entries")
  return out


def search_files(root: str, pattern: str, path: str = ".") -> str:
  """Lines containing `pattern` (literal, case-sensitive) in the files under `path`, as
  `file:line: text`, files in sorted order; symlinks that leave root are skipped.

  Raises: PathRefused (path outside root or missing).
  """
  full = resolve(root, path)
  if not os.path.exists(full):
    raise PathRefused(f"{path!r} does not exist")
  if os.path.isfile(full):
    files = [full]
  else:
    files = []
    for d, dirs, fs in os.walk(full):
      dirs.sort()
      files += [os.path.join(d, f) for f in sorted(fs)]
  hits, more = [], 0
  for f in files:
    try:
      f = resolve(root, os.path.relpath(f, os.path.realpath(root)))
    except PathRefused:
      continue
    if not os.path.isfile(f) or os.path.getsize(f) > MAX_SEARCH_FILE_BYTES:
      continue
    with open(f, "rb") as fh:
      text = fh.read().decode("utf-8", errors="replace")
    for i, line in enumerate(text.splitlines(), 1):
      if pattern in line:
        if len(hits) < MAX_MATCHES:
          hits.append(f"{_rel(root, f)}:{i}: {line[:200]}")
        else:
          more += 1
  out = "\n".join(hits) if hits else f"no lines contain {pattern!r}"
  if more:
    out += TRUNC.format(what=f"{more} more matching lines")
  return out
