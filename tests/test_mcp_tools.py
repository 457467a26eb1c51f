"""MCP tool calls through the official `mcp` package against the shipped local docsearch server
(real stdio subprocesses): listing, calls, results, and typed errors naming a failed server."""

import sys
from asyncio import run

from envs_bridge.mcp_tools import docsearch_server as ds
from envs_bridge.mcp_tools.client import McpHub, McpServerError, McpServerSpec, UnknownMcpServer
from envs_bridge.sdk import SdkSession
from tars_jax.agent import actions as A

DOCS = McpServerSpec(sys.executable, ("-m", "envs_bridge.mcp_tools.docsearch_server"))


def test_search_ranks_by_query_words():
  docs = {"a.md": "alpha beta\ngamma", "b.md": "beta only", "c.md": "nothing"}
  assert ds.search(docs, "alpha beta") == "a.md: alpha beta\nb.md: beta only"
  assert ds.search(docs, "zeta") == "no match"


def test_list_and_call_tools_over_stdio(tmp_path):
  hub = McpHub({"docs": DOCS}, str(tmp_path))

  async def go():
    try:
      return (await hub.list_tools("docs"), await hub.call("docs", "search_docs", {"query": "magic number", "k": 1}),
              await hub.call("docs", "read_doc", {"name": "ppo.md"}))
    finally:
      await hub.aclose()
  tools, (hit, err1), (doc, err2) = run(go())
  assert tools.splitlines()[:2] == [
      "search_docs(query, k): Search the local documents; returns 'name: matching line' lines.",
      "read_doc(name): The full text of one document by name."]
  assert hit == "mcp.md: The magic number of the test suite is 4817." and not err1
  with open(f"{ds.DEFAULT_DOCS}/ppo.md", encoding="utf-8") as f:
    assert doc == f.read() and not err2


def test_failed_start_crash_and_unknown_server_are_typed_errors_naming_it(tmp_path):
  hub = McpHub({"docs": DOCS, "missing": McpServerSpec("/nonexistent/mcp-server"),
                "quits": McpServerSpec(sys.executable, ("-c", "import sys; sys.stderr.write('bye'); sys.exit(3)"))},
               str(tmp_path), timeout_s=30)

  async def go():
    errs = []
    for server, tool in (("missing", None), ("quits", None), ("docs", "crash"), ("other", None)):
      try:
        await (hub.call(server, tool, {}) if tool else hub.list_tools(server))
      except (McpServerError, UnknownMcpServer) as e:
        errs.append(e)
    again = await hub.call("docs", "search_docs", {"query": "Xvfb depth"})  # restarted after the crash
    await hub.aclose()
    return errs, again
  (missing, quits, crashed, other), again = run(go())
  assert isinstance(missing, McpServerError) and missing.server == "missing"
  assert "failed to start" in missing.reason and "No such file" in missing.reason
  assert quits.server == "quits" and "failed to start" in quits.reason and "bye" in quits.reason
  assert crashed.server == "docs" and "crashed" in crashed.reason
  assert crashed.body()["error"] == "McpServerError" and crashed.body()["server"] == "docs"
  assert isinstance(other, UnknownMcpServer) and "servers: ['docs', 'missing', 'quits']" in other.reason
  assert again[0].startswith("xvfb.md: ")


def test_mcp_from_the_action_grammar(tmp_path):
  s = SdkSession(str(tmp_path), mcp_servers={"docs": {"command": sys.executable,
                                                       "args": ["-m", "envs_bridge.mcp_tools.docsearch_server"]}})

  async def go():
    try:
      return await s.execute(A.parse(
          "Action: mcp_call(server='docs', tool='search_docs', arguments='{\"query\": \"clip-higher\"}')", sdk=True))
    finally:
      await s.aclose()
  res = run(go())
  assert res.error is None
  # ppo.md is the only document with 'clip' or 'higher'; its first line with either word:
  assert res.text == "ppo.md: PPO (Schulman et al., 2017) maximises a clipped surrogate objective. The clip range epsilon is"
