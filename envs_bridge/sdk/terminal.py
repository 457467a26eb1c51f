"""Terminal commands of the GUI-SDK: `bash -c` in the session directory, confined (report 2.1-2.2).

Each command runs as
  prlimit --cpu=S --as=B --fsize=B --nproc=N -- bwrap <mounts> --unshare-net --unshare-pid -- bash -c CMD
(falling back to `unshare --net` where bubblewrap is missing or not permitted) in its own process
group with cwd = HOME = the session directory:
  - file system: the command sees only the session directory (read-write, at its own path), the
    OS read-only (/usr, /etc and the /bin, /lib links), a private /tmp, /proc and /dev — not the
    project, other sessions' directories or /root (bubblewrap mount namespace; `Limits.fs_confined()`
    says whether it is in force here);
  - wall-clock time-out: the whole group is killed, the output so far comes back marked;
  - output cap: stdout+stderr beyond `max_output` bytes are not kept; a command that floods output
    is killed when it passes `kill_output` bytes (so `yes` ends at once), marked;
  - CPU seconds, address space, file size and process count limits (resource rlimits via prlimit);
  - no network: a fresh network namespace (bubblewrap's or `unshare --net`, needs root /
    CAP_SYS_ADMIN); where it is not permitted the command runs with network and
    `Limits.network_isolated()` says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import shutil
import signal
import subprocess


@dataclasses.dataclass(frozen=True)
class Limits:
  """Confinement of one command. timeout_s: wall seconds; cpu_s: CPU seconds (RLIMIT_CPU);
  memory_bytes: address space (RLIMIT_AS); file_bytes: largest file written (RLIMIT_FSIZE);
  nproc: processes of the user (RLIMIT_NPROC, 0 = unlimited: root ignores it anyway);
  max_output: bytes of stdout+stderr shown; kill_output: bytes after which the command is killed;
  no_network: run in a new network namespace; confine_fs: only the session directory is visible
  (and writable) besides the read-only OS (bubblewrap)."""

  timeout_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 1 << 30
  file_bytes: int = 64 << 20
  nproc: int = 0
  max_output: int = 8192
  kill_output: int = 1 << 20
  no_network: bool = True
  confine_fs: bool = True

  @staticmethod
  @functools.lru_cache(maxsize=1)
  def network_isolated() -> bool:
    """True if `unshare --net` works here (root or CAP_SYS_ADMIN)."""
    if not shutil.which("unshare"):
      return False
    if Limits.fs_confined():
      return True  # bubblewrap's --unshare-net
    return subprocess.run(["unshare", "--net", "--", "true"], capture_output=True).returncode == 0

  @staticmethod
  @functools.lru_cache(maxsize=1)
  def fs_confined() -> bool:
    """True if bubblewrap (Debian `bubblewrap`, installed by scripts/setup.sh) runs here."""
    if not shutil.which("bwrap"):
      return False
    return subprocess.run(_bwrap("/") + ["true"], capture_output=True).returncode == 0


def _bwrap(root: str) -> list[str]:
  """bubblewrap argv prefix: read-only OS, private /tmp, `root` read-write at its own path, no network,
  own pid namespace; dies with its parent. Binds after `--tmpfs /tmp` so a root under /tmp shows."""
  argv = ["bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
  for d in ("bin", "lib", "lib64", "sbin"):  # merged-/usr links (or real dirs on older systems)
    p = "/" + d
    if os.path.islink(p):
      argv += ["--symlink", os.readlink(p), p]
    elif os.path.isdir(p):
      argv += ["--ro-bind", p, p]
  argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
  if root != "/":
    argv += ["--bind", root, root]
  return argv + ["--chdir", root, "--unshare-net", "--unshare-pid", "--die-with-parent", "--"]


@dataclasses.dataclass
class CommandResult:
  """exit_code: the shell's status (None if killed); timed_out / truncated: what was cut."""

  output: str
  exit_code: int | None
  timed_out: bool = False
  truncated: bool = False
  killed_for_output: bool = False

  def text(self) -> str:
    """The observation text: output (newline-terminated), then one line per marker, then the exit status."""
    marks = (["[output truncated]"] if self.truncated else []) + \
        (["[killed: too much output]"] if self.killed_for_output else []) + \
        (["[timed out; command killed]"] if self.timed_out else []) + \
        ([f"[exit code {self.exit_code}]"] if self.exit_code is not None else [])
    out = self.output
    if out and not out.endswith("\n"):
      out += "\n"
    return out + "\n".join(marks)


def command_line(command: str, limits: Limits, cwd: str = "/") -> list[str]:
  """argv that runs `command` under `limits` with `cwd` as the only visible directory (module docstring)."""
  pl = ["prlimit", f"--cpu={int(limits.cpu_s)}", f"--as={int(limits.memory_bytes)}",
        f"--fsize={int(limits.file_bytes)}"]
  if limits.nproc:
    pl.append(f"--nproc={int(limits.nproc)}")
  if limits.confine_fs and Limits.fs_confined():
    box = _bwrap(os.path.realpath(cwd))
    if not limits.no_network:
      box.remove("--unshare-net")
  else:
    box = ["unshare", "--net", "--"] if limits.no_network and Limits.network_isolated() else []
  return [*pl, "--", *box, "bash", "--noprofile", "--norc", "-c", command]


async def run_command(command: str, cwd: str, limits: Limits = Limits(), env: dict | None = None) -> CommandResult:
  """Runs `command` in `cwd` under `limits`; never raises for what the command does.

  Returns: CommandResult with at most `limits.max_output` bytes of stdout+stderr (UTF-8, replaced).
  Raises: FileNotFoundError if `cwd` does not exist.
  """
  if not os.path.isdir(cwd):
    raise FileNotFoundError(cwd)
  base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "TERM": "dumb",
              "PS1": "$ "}
  proc = await asyncio.create_subprocess_exec(
      *command_line(command, limits, cwd), cwd=cwd, env={**base_env, **(env or {})}, stdin=asyncio.subprocess.DEVNULL,
      stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
  buf = bytearray()
  total = 0
  killed_for_output = False

  async def pump():
    nonlocal total, killed_for_output
    while True:
      chunk = await proc.stdout.read(65536)
      if not chunk:
        return
      total += len(chunk)
      if len(buf) < limits.max_output:
        buf.extend(chunk[:limits.max_output - len(buf)])
      if total > limits.kill_output:
        killed_for_output = True
        _kill_group(proc.pid)
        return

  timed_out = False
  loop = asyncio.get_running_loop()
  deadline = loop.time() + limits.timeout_s
  code = None
  try:
    await asyncio.wait_for(pump(), limits.timeout_s)
    if not killed_for_output:  # output closed: wait for the shell itself (it may still be running)
      code = await asyncio.wait_for(proc.wait(), max(0.0, deadline - loop.time()))
  except asyncio.TimeoutError:
    timed_out = True
  _kill_group(proc.pid)  # the command's leftovers (background jobs), or all of it on time-out / flood
  if code is None:
    try:
      await asyncio.wait_for(proc.wait(), 5.0)
    except asyncio.TimeoutError:
      pass
  killed = timed_out or killed_for_output
  return CommandResult(buf.decode("utf-8", errors="replace"), None if killed else code, timed_out=timed_out,
                       truncated=total > limits.max_output, killed_for_output=killed_for_output)


def _kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
