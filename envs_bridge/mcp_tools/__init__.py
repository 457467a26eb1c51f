"""MCP tool calls for sandbox sessions (`client.py`) and a local MCP server for tests
(`docsearch_server.py`, search over `docs/`)."""
