"""GUI-SDK: terminal commands, file operations and MCP tool calls on a session's shared directory.

`SdkSession(root).execute(action)` runs one SDK action of the grammar (`tars_jax.agent.actions`:
RunCommand, ReadFile, WriteFile, ListFiles, SearchFiles, McpListTools, McpCall) and returns an
`SdkResult` (observation text + the reason when refused). See `files.py` and `terminal.py` for
the confinement, `envs_bridge/mcp_tools/client.py` for MCP.
"""

from envs_bridge.sdk.session import SdkResult, SdkSession  # noqa: F401
