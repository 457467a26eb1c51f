"""One session's SDK: dispatches SDK actions to files / terminal / MCP (report sections 2.1-2.2)."""

from __future__ import annotations

import dataclasses

from envs_bridge.mcp_tools.client import McpHub, McpServerError, McpServerSpec, UnknownMcpServer
from envs_bridge.sdk import files, terminal
from tars_jax.agent import actions as A


@dataclasses.dataclass
class SdkResult:
  """text: what the agent sees (tool output, possibly truncated and marked); error: None, or the
  reason the call was refused / failed (e.g. "PathRefused: path '../x' is outside the session
  directory", "McpServerError: MCP server 'docs': crashed: ..."); the session goes on either way."""

  text: str
  error: str | None = None


class SdkSession:
  """SDK functions bound to one session directory.

  Args:
    root: the session directory (shared with the GUI: the terminal's cwd, the browser's downloads).
    limits: terminal confinement (`terminal.Limits`).
    mcp_servers: {name: McpServerSpec or {'command', 'args', 'env'}} the session may call.
    mcp_timeout_s: seconds for an MCP server to start / answer.
  """

  def __init__(self, root: str, limits: terminal.Limits = terminal.Limits(), mcp_servers: dict | None = None,
               mcp_timeout_s: float = 30.0):
    self.root, self.limits = root, limits
    specs = {k: v if isinstance(v, McpServerSpec) else McpServerSpec.from_config(v)
             for k, v in (mcp_servers or {}).items()}
    self.mcp = McpHub(specs, root, mcp_timeout_s)

  async def execute(self, a) -> SdkResult:
    """Runs one SDK action. Never raises for what the agent asked; raises TypeError for a GUI action."""
    try:
      if isinstance(a, A.RunCommand):
        return SdkResult((await terminal.run_command(a.command, self.root, self.limits)).text())
      if isinstance(a, A.ReadFile):
        return SdkResult(files.read_file(self.root, a.path))
      if isinstance(a, A.WriteFile):
        return SdkResult(files.write_file(self.root, a.path, a.content))
      if isinstance(a, A.ListFiles):
        return SdkResult(files.list_files(self.root, a.path))
      if isinstance(a, A.SearchFiles):
        return SdkResult(files.search_files(self.root, a.pattern, a.path))
      if isinstance(a, A.McpListTools):
        return SdkResult(await self.mcp.list_tools(a.server))
      if isinstance(a, A.McpCall):
        text, is_error = await self.mcp.call(a.server, a.tool, a.args())
        return SdkResult(text, f"McpToolError: {text[:300]}" if is_error else None)
    except (files.PathRefused, McpServerError, UnknownMcpServer) as e:
      return SdkResult(f"refused: {e.reason}", f"{type(e).__name__}: {e.reason}")
    except OSError as e:  # e.g. permission denied, disk full: the agent's problem to see, not a crash
      return SdkResult(f"failed: {e}", f"{type(e).__name__}: {e}")
    raise TypeError(f"not an SDK action: {a!r}")

  async def aclose(self) -> None:
    """Stops the session's MCP servers."""
    await self.mcp.aclose()
