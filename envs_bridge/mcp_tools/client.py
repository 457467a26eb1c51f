"""MCP tool calls for a sandbox session through the official `mcp` package (stdio transport).

  hub = McpHub({"docs": McpServerSpec("python", ["-m", "envs_bridge.mcp_tools.docsearch_server"])}, cwd)
  text = await hub.list_tools("docs")            # 'search_docs(query, k): Search the ...' lines
  text = await hub.call("docs", "search_docs", {"query": "clip range"})
  await hub.aclose()

A server is started on first use and kept for the session. Each connection lives in its own asyncio
task, because the `mcp` client's anyio task groups must be entered and left by the same task; calls
reach it through a queue. Every failure of a server — cannot be spawned, dies before or during
`initialize`, crashes mid-call, does not answer in `timeout_s` — is an `McpServerError` naming the
server (with the tail of its stderr); the hub stays usable and a later call restarts a dead server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile

from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp_types import CONNECTION_CLOSED

from envs_bridge import protocol as P

MAX_RESULT_CHARS = 8192  # tool results longer than this are cut and marked


@dataclasses.dataclass(frozen=True)
class McpServerSpec:
  """How to start one stdio MCP server: `command args...` with extra `env`."""

  command: str
  args: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()

  @classmethod
  def from_config(cls, d) -> "McpServerSpec":
    """From {'command': str, 'args': [...], 'env': {...}} (task or config entries)."""
    return cls(d["command"], tuple(d.get("args", ())), tuple(sorted(dict(d.get("env", {})).items())))


class McpServerError(P.SandboxError):
  """An MCP server that failed to start, crashed, or did not answer; `.server` names it.

  Not in `protocol.ERRORS` (owned elsewhere): in sessions it becomes an observation
  (`info.tool_error`), over HTTP a 502 body {"error": "McpServerError", "server": name, "reason"}.
  """

  status = 502

  def __init__(self, server: str, reason: str):
    super().__init__(f"MCP server {server!r}: {reason}", server=server)
    self.server = server


class UnknownMcpServer(P.SandboxError):
  """A call names a server the session does not have."""

  status = 404


class _Connection:
  def __init__(self, name: str, spec: McpServerSpec, cwd: str, timeout_s: float):
    self.name, self.spec, self.cwd, self.timeout_s = name, spec, cwd, timeout_s
    self.queue: asyncio.Queue = asyncio.Queue()
    self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
    self.errlog = tempfile.TemporaryFile("w+", prefix=f"mcp-{name}-")
    self.crashed = False
    self.task = asyncio.create_task(self._main())

  def stderr_tail(self, n: int = 600) -> str:
    try:
      self.errlog.flush()
      self.errlog.seek(0)
      return self.errlog.read()[-n:].strip()
    except (OSError, ValueError):
      return ""

  def alive(self) -> bool:
    return not self.task.done() and not self.crashed

  async def _main(self):
    params = StdioServerParameters(command=self.spec.command, args=list(self.spec.args),
                                   env={**dict(self.spec.env), "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
                                   cwd=self.cwd)
    job = None
    try:
      async with stdio_client(params, errlog=self.errlog) as (read, write):
        async with ClientSession(read, write) as session:
          await session.initialize()
          self.ready.set_result(True)
          while True:
            job = await self.queue.get()
            if job is None:
              return
            fn, fut = job
            try:
              res = await fn(session)
            except Exception as e:  # the call failed; the connection may still be fine
              if not fut.done():
                fut.set_exception(e)
              if isinstance(e, MCPError) and e.error.code == CONNECTION_CLOSED:
                self.crashed = True  # the server is gone: end this connection, restart on next use
                return
            else:
              if not fut.done():
                fut.set_result(res)
            job = None
    except BaseException as e:  # spawn failure, crash, protocol error: fail whoever waits
      err = e
      if not self.ready.done():
        self.ready.set_exception(err if isinstance(err, Exception) else RuntimeError(repr(err)))
      if job is not None and not job[1].done():
        job[1].set_exception(RuntimeError(f"server died during the call: {err!r}"))
      while not self.queue.empty():
        j = self.queue.get_nowait()
        if j is not None and not j[1].done():
          j[1].set_exception(RuntimeError(f"server died: {err!r}"))
      if isinstance(e, asyncio.CancelledError):
        raise

  async def run(self, fn):
    fut = asyncio.get_running_loop().create_future()
    await self.queue.put((fn, fut))
    done, _ = await asyncio.wait({fut, self.task}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if fut in done:
      return fut.result()
    if self.task in done:  # died without resolving the call
      raise RuntimeError("server exited during the call")
    fut.cancel()
    raise TimeoutError(f"no answer within {self.timeout_s:g} s")

  async def close(self):
    if self.task.done():
      self.errlog.close()
      return
    await self.queue.put(None)
    try:
      await asyncio.wait_for(asyncio.shield(self.task), 10.0)
    except (asyncio.TimeoutError, Exception):
      self.task.cancel()
      try:
        await self.task
      except BaseException:
        pass
    self.errlog.close()


class McpHub:
  """The MCP servers of one session.

  Args:
    specs: {server name: McpServerSpec}; names are what `mcp_call(server=...)` uses.
    cwd: working directory of the servers (the session directory).
    timeout_s: seconds for a server to start and for each call.
  """

  def __init__(self, specs: dict[str, McpServerSpec], cwd: str, timeout_s: float = 30.0):
    self.specs, self.cwd, self.timeout_s = dict(specs), cwd, timeout_s
    self._conns: dict[str, _Connection] = {}
    self._lock = asyncio.Lock()

  async def _conn(self, server: str) -> _Connection:
    if server not in self.specs:
      raise UnknownMcpServer(f"no MCP server {server!r} in this session; servers: {sorted(self.specs)}",
                             servers=sorted(self.specs))
    async with self._lock:
      c = self._conns.get(server)
      if c is not None and c.alive():
        return c
      if c is not None:  # died earlier: restart on this call
        await c.close()
      c = _Connection(server, self.specs[server], self.cwd, self.timeout_s)
      self._conns[server] = c
    try:
      await asyncio.wait_for(asyncio.shield(c.ready), self.timeout_s)
    except asyncio.TimeoutError:
      tail = c.stderr_tail()
      await c.close()
      raise McpServerError(server, f"did not start within {self.timeout_s:g} s; stderr: {tail!r}")
    except Exception as e:
      await asyncio.wait({c.task}, timeout=5.0)  # let the process exit so its stderr is complete
      tail = c.stderr_tail()
      await c.close()
      raise McpServerError(server, f"failed to start: {_why(e)}; stderr: {tail!r}") from None
    return c

  async def _run(self, server: str, fn):
    c = await self._conn(server)
    try:
      return await c.run(fn)
    except (McpServerError, UnknownMcpServer):
      raise
    except Exception as e:
      if c.crashed or not c.alive() or isinstance(e, TimeoutError):
        raise McpServerError(server, f"{'timed out' if isinstance(e, TimeoutError) else 'crashed'}: {_why(e)}; "
                                     f"stderr: {c.stderr_tail()!r}") from None
      raise McpServerError(server, f"call failed: {_why(e)}") from None

  async def list_tools(self, server: str) -> str:
    """One line per tool: `name(arg, ...): description`.

    Raises: UnknownMcpServer, McpServerError.
    """
    res = await self._run(server, lambda s: s.list_tools())
    lines = []
    for t in res.tools:
      args = ", ".join((t.input_schema or {}).get("properties", {}))
      lines.append(f"{t.name}({args}): {(t.description or '').strip()}")
    return "\n".join(lines) or "(no tools)"

  async def call(self, server: str, tool: str, arguments: dict) -> tuple[str, bool]:
    """Calls `tool` -> (text of its content blocks, is_error). A tool that raises comes back as
    (its message, True), as MCP defines it, not as an exception.

    Raises: UnknownMcpServer, McpServerError (start failure, crash, time-out).
    """
    res = await self._run(server, lambda s: s.call_tool(tool, arguments))
    parts = []
    for block in res.content:
      text = getattr(block, "text", None)
      parts.append(text if text is not None else json.dumps(block.model_dump(mode="json"))[:500])
    out = "\n".join(parts)
    if len(out) > MAX_RESULT_CHARS:
      out = out[:MAX_RESULT_CHARS] + "\n[truncated: tool result]"
    return out, bool(res.is_error)

  async def aclose(self) -> None:
    """Stops every server of the session."""
    for c in list(self._conns.values()):
      await c.close()
    self._conns.clear()


def _why(e: BaseException) -> str:
  if isinstance(e, BaseExceptionGroup):
    return "; ".join(_why(x) for x in e.exceptions)
  return f"{type(e).__name__}: {e}"[:400]
