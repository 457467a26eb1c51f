"""A local MCP server (stdio) that searches a local document set: the test server of the MCP SDK.

  python -m envs_bridge.mcp_tools.docsearch_server [--docs DIR]

Tools (official `mcp` package, `MCPServer`):
  search_docs(query, k=3)  documents ranked by how many query words they contain (case-insensitive,
                       ties by name), as `name: first matching line` lines, or "no match".
  read_doc(name)       the full text of one document (`name` as `search_docs` prints it).
  crash()              exits the process at once (tests of a server that dies mid-session).
Documents are the `*.md` / `*.txt` files of DIR (default: the `docs/` folder beside this file).
"""

from __future__ import annotations

import argparse
import os
import re

from mcp.server.mcpserver import MCPServer

DEFAULT_DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs")


def load_docs(folder: str) -> dict[str, str]:
  """{file name: text} of the .md / .txt files of `folder`, sorted by name."""
  return {n: open(os.path.join(folder, n), encoding="utf-8").read()
          for n in sorted(os.listdir(folder)) if n.endswith((".md", ".txt"))}


def search(docs: dict[str, str], query: str, k: int = 3) -> str:
  """Documents containing the most distinct query words (>= 1), best first, ties by name; each as
  `name: <first line containing a query word>`. Words are [A-Za-z0-9_.]+, case-insensitive."""
  words = {w.lower() for w in re.findall(r"[A-Za-z0-9_.]+", query)}
  scored = []
  for name, text in docs.items():
    low = text.lower()
    score = sum(1 for w in words if w in low)
    if score:
      line = next((ln for ln in text.splitlines() if any(w in ln.lower() for w in words)), "")
      scored.append((-score, name, line.strip()))
  scored.sort()
  return "\n".join(f"{n}: {ln}" for _, n, ln in scored[:max(1, int(k))]) or "no match"


def build(folder: str = DEFAULT_DOCS) -> MCPServer:
  docs = load_docs(folder)
  server = MCPServer("docsearch")

  @server.tool(description="Search the local documents; returns 'name: matching line' lines.")
  def search_docs(query: str, k: int = 3) -> str:
    return search(docs, query, k)

  @server.tool(description="The full text of one document by name.")
  def read_doc(name: str) -> str:
    return docs.get(name, f"no document {name!r}; documents: {', '.join(docs)}")

  @server.tool(description="Test hook: the server process exits immediately.")
  def crash() -> str:
    os._exit(3)

  return server


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--docs", default=DEFAULT_DOCS)
  build(ap.parse_args(argv).docs).run("stdio")


if __name__ == "__main__":
  main()
