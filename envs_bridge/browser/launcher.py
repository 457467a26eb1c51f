"""A Chromium that never outlives the process that started it.

Playwright's driver (node) starts every browser as the leader of a process group of its own
(`detached: true`, so it can kill the browser's tree with `kill(-pid)`), and kills its browsers only
when the driver itself exits or is asked to. A driver killed with SIGKILL (the launcher's last resort
in `ServerHandle.stop`, `kill -9` of the server's group, the OOM killer) or one killed while a crashed
browser was being relaunched left its Chromium running under init, out of reach of any signal to the
server's process group.

`pdeathsig_wrapper(executable)` is a script for Playwright's `executable_path` that execs Chromium with
Linux's parent-death signal set to SIGKILL (`setpriv --pdeathsig KILL`, util-linux; the setting
survives exec): whenever the driver dies, by whatever means, the kernel kills the browser process, and
Chromium's own children (zygotes, renderers, GPU/utility processes) exit with it. If the driver died
before the signal was set, the script does not start Chromium at all (the parent pid it was started by
is checked after `setpriv`). Costs two `sh` starts and one `setpriv` per launch (a few milliseconds).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shlex
import shutil

log = logging.getLogger("envs_bridge.browser")
PARENT_ENV = "TARS_CHROMIUM_PARENT"  # the driver's pid, from the wrapper's first pass to its second

_SCRIPT = """#!/bin/sh
# Runs {exe} so that it dies with its parent (envs_bridge/browser/launcher.py).
if [ -z "${{{env}:-}}" ]; then
  {env}=$PPID exec {setpriv} --pdeathsig KILL -- "$0" "$@"
fi
# parent-death signal set: if the parent that started us has died meanwhile, do not start at all
[ "$PPID" = "${env}" ] || exit 1
unset {env}
exec {exe} "$@"
"""


def wrapper_dir() -> pathlib.Path:
  """Where wrapper scripts are kept: `$TARS_JAX_CHROMIUM_DIR`, default `~/.cache/tars_jax/chromium`."""
  return pathlib.Path(os.environ.get("TARS_JAX_CHROMIUM_DIR",
                                     pathlib.Path.home() / ".cache" / "tars_jax" / "chromium"))


def pdeathsig_wrapper(executable: str) -> str:
  """Path of an executable script that runs `executable` (with the same arguments) under
  PR_SET_PDEATHSIG = SIGKILL; written once per content into `wrapper_dir()` (atomically, so servers
  starting together share it). Returns `executable` itself, with a warning, where `setpriv` is missing
  (not Linux / no util-linux) or the script cannot be written: then only Playwright's own clean-up
  stops the browser."""
  setpriv = shutil.which("setpriv")
  if setpriv is None:
    log.warning("setpriv (util-linux) not found: Chromium may outlive a server killed with SIGKILL")
    return executable
  text = _SCRIPT.format(exe=shlex.quote(executable), setpriv=shlex.quote(setpriv), env=PARENT_ENV)
  d = wrapper_dir()
  path = d / f"chromium-{hashlib.sha256(text.encode()).hexdigest()[:16]}.sh"
  if not path.exists():
    try:
      d.mkdir(parents=True, exist_ok=True)
      tmp = d / f".{path.name}.{os.getpid()}"
      tmp.write_text(text)
      tmp.chmod(0o755)
      os.replace(tmp, path)
    except OSError as e:  # e.g. a read-only home: set TARS_JAX_CHROMIUM_DIR
      log.warning("cannot write %s (%s): Chromium may outlive a server killed with SIGKILL", path, e)
      return executable
  return str(path)
