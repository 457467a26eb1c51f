"""A loopback HTTP server for the pages and downloads of hybrid tasks (one per desktop sandbox).

Each session registers its files under a random token: `GET /<token>/<name>` serves them, with
`Content-Disposition: attachment` for downloads (so Chromium saves them into the session directory
instead of showing them). Standard library `ThreadingHTTPServer` in a daemon thread.
"""

from __future__ import annotations

import http.server
import threading
import urllib.parse


class WebFiles:
  """Serves {token: {name: (content type, body str, attachment file name | None)}} on 127.0.0.1."""

  def __init__(self):
    self.sites: dict[str, dict] = {}
    sites = self.sites

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):  # noqa: N802 (http.server API)
        parts = urllib.parse.urlparse(self.path).path.lstrip("/").split("/", 1)
        entry = sites.get(parts[0], {}).get(parts[1] if len(parts) > 1 else "")
        if entry is None:
          self.send_error(404)
          return
        ctype, body, attachment = entry
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", f"{ctype}; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if attachment:
          self.send_header("Content-Disposition", f'attachment; filename="{attachment}"')
        self.end_headers()
        self.wfile.write(data)

      def log_message(self, *args):  # quiet
        pass

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.port = self.httpd.server_address[1]
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="webfiles")
    self.thread.start()

  def add(self, token: str, files: dict) -> str:
    """Registers a session's files; returns its base URL (ends with '/')."""
    self.sites[token] = dict(files)
    return f"http://127.0.0.1:{self.port}/{token}/"

  def remove(self, token: str) -> None:
    self.sites.pop(token, None)

  def close(self) -> None:
    self.httpd.shutdown()
    self.httpd.server_close()
