"""GUI-SDK: SDK actions in the grammar, path confinement of file ops, terminal time-outs, output caps,
rlimits and network isolation (real bash subprocesses)."""

import dataclasses
import os
import subprocess
from asyncio import run

import pytest
from hypothesis import given, settings, strategies as st

from _shared import poll
from envs_bridge.sdk import SdkSession, files, terminal
from tars_jax.agent import actions as A


# -- grammar ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("run_command(command='wc -l numbers.txt')", A.RunCommand("wc -l numbers.txt")),
    ("Thought: look\nAction: read_file(path='a/b.txt')", A.ReadFile("a/b.txt")),
    ("write_file(path='x.txt', content='it\\'s\\n2')", A.WriteFile("x.txt", "it's\n2")),
    ("list_files()", A.ListFiles(".")),
    ("search_files(pattern='ERROR', path='logs')", A.SearchFiles("ERROR", "logs")),
    ("mcp_list_tools(server='docs')", A.McpListTools("docs")),
    ("mcp_call(server='docs', tool='search_docs', arguments='{\"query\": \"ppo\", \"k\": 1}')",
     A.McpCall("docs", "search_docs", '{"k": 1, "query": "ppo"}')),
])
def test_sdk_actions_parse_and_round_trip(text, want):
  got = A.parse(text, sdk=True)
  assert got == want and A.is_sdk(got)
  assert A.parse(A.format_action(got), sdk=True) == got


@pytest.mark.parametrize("text,reason", [
    ("run_command()", "run_command needs command"),
    ("run_command(command='  ')", "non-empty command"),
    ("write_file(path='x')", "write_file needs content"),
    ("mcp_call(server='d', tool='t', arguments='[1]')", "must be a JSON object"),
    ("mcp_call(server='d', tool='t', arguments='{oops')", "not JSON"),
    ("mcp_call(server='d', tool='t', arguments='" + "[" * 5000 + "')", "not JSON"),
    ("read_file(path='a', mode='w')", "unexpected arguments"),
])
def test_bad_sdk_actions_are_typed_parse_errors(text, reason):
  with pytest.raises(A.ActionParseError, match=reason):
    A.parse(text, sdk=True)


def test_sdk_actions_are_refused_without_sdk():
  """Sandboxes without an SDK (the browser) keep answering them as invalid actions."""
  with pytest.raises(A.ActionParseError, match="SDK function 'run_command' is not available here"):
    A.parse("Thought: x\nAction: run_command(command='ls')")


def test_gui_actions_are_not_sdk():
  assert not A.is_sdk(A.parse("click(start_box='(1,2)')")) and not A.is_sdk(A.Wait())


# -- files ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["../x", "a/../../x", "/../../etc/passwd", "link/passwd", "..", "\x00"])
def test_paths_outside_the_session_are_refused_with_the_reason(tmp_path, path):
  root = tmp_path / "s"
  root.mkdir()
  os.symlink("/etc", root / "link")
  with pytest.raises(files.PathRefused) as e:
    files.read_file(str(root), path)
  assert "outside the session directory" in e.value.reason or "NUL" in e.value.reason


def test_leading_slash_means_session_root(tmp_path):
  (tmp_path / "a.txt").write_text("hello")
  assert files.read_file(str(tmp_path), "/a.txt") == "hello"


def test_write_list_search_read(tmp_path):
  root = str(tmp_path)
  assert files.write_file(root, "d/x.txt", "one\ntwo ERROR\nthree ERROR\n") == "wrote 26 bytes to d/x.txt"
  files.write_file(root, "b.txt", "ERROR here")
  assert files.list_files(root) == "b.txt  10\nd/"
  assert files.search_files(root, "ERROR") == "b.txt:1: ERROR here\nd/x.txt:2: two ERROR\nd/x.txt:3: three ERROR"
  assert files.read_file(root, "d/x.txt") == "one\ntwo ERROR\nthree ERROR\n"
  with pytest.raises(files.PathRefused, match="does not exist"):
    files.read_file(root, "nope.txt")


def test_big_file_read_is_truncated_and_marked(tmp_path):
  (tmp_path / "big.txt").write_text("x" * (files.MAX_READ_BYTES + 10))
  out = files.read_file(str(tmp_path), "big.txt")
  assert out.startswith("x" * files.MAX_READ_BYTES) and out.endswith(
      f"[truncated: file larger than {files.MAX_READ_BYTES} bytes]")


# -- terminal ------------------------------------------------------------------------------------------
def test_command_runs_in_the_session_directory(tmp_path):
  (tmp_path / "n.txt").write_text("1\n2\n3\n")
  r = run(terminal.run_command("pwd; awk '{s+=$1} END {print s}' n.txt", str(tmp_path)))
  assert r.output == f"{tmp_path}\n6\n" and r.exit_code == 0 and not (r.timed_out or r.truncated)


def test_timeout_is_marked_and_kills_the_group(tmp_path):
  # 3 s: room for prlimit, bubblewrap's namespaces and bash to start on a slow machine before the
  # echo; still a time-out, as the command would take 30 s.
  lim = terminal.Limits(timeout_s=3)
  # an odd duration: pgrep sees the whole machine, where other `sleep 30`s may run
  r = run(terminal.run_command("echo started; sleep 30.0123 & sleep 30.0123", str(tmp_path), lim))
  assert r.timed_out and r.exit_code is None and r.output == "started\n"
  assert r.text().endswith("[timed out; command killed]")
  # SIGKILLed processes leave /proc only once scheduled; a survivor of 30 s sleeps would still be
  # there after this bounded wait.
  def sleepers():
    return subprocess.run(["pgrep", "-f", r"^sleep 30\.0123$"], capture_output=True).stdout
  assert poll(lambda: sleepers() == b"", 5.0), sleepers()


def test_runaway_output_is_capped_killed_and_marked(tmp_path):
  lim = terminal.Limits(timeout_s=30, max_output=1000, kill_output=200_000)
  r = run(terminal.run_command("yes", str(tmp_path), lim))  # infinite output
  assert r.killed_for_output and r.truncated and not r.timed_out
  assert r.output == "y\n" * 500
  assert "[output truncated]" in r.text() and "[killed: too much output]" in r.text()


def test_cpu_and_memory_rlimits(tmp_path):
  r = run(terminal.run_command("while :; do :; done", str(tmp_path), terminal.Limits(timeout_s=20, cpu_s=1)))
  assert not r.timed_out and r.exit_code not in (0, None)  # SIGXCPU/SIGKILL from RLIMIT_CPU, not the time-out
  lim = terminal.Limits(memory_bytes=200 << 20)
  r = run(terminal.run_command("python3 -c 'bytearray(500 << 20)'", str(tmp_path), lim))
  assert "MemoryError" in r.output and r.exit_code == 1


def test_commands_see_only_the_session_directory(tmp_path):
  if not terminal.Limits.fs_confined():
    pytest.skip("bubblewrap missing or not permitted here: commands can read outside the session directory")
  root, outside = tmp_path / "session", tmp_path / "other_session"
  root.mkdir()
  outside.mkdir()
  (outside / "secret.txt").write_text("s3cret\n")
  (root / "mine.txt").write_text("mine\n")
  r = run(terminal.run_command(f"cat mine.txt; cat {outside}/secret.txt; ls {os.getcwd()}; touch /usr/x; "
                               "echo w > made.txt; echo t > /tmp/t && cat /tmp/t", str(root)))
  assert r.output.startswith("mine\n") and "s3cret" not in r.output
  assert f"{outside}/secret.txt: No such file or directory" in r.output  # the sibling is not there at all
  assert f"cannot access '{os.getcwd()}': No such file or directory" in r.output  # nor the project
  assert "touch: cannot touch '/usr/x': Read-only file system" in r.output and r.output.endswith("t\n")  # private /tmp works
  assert (root / "made.txt").read_text() == "w\n" and not (outside / "made.txt").exists()
  r = run(terminal.run_command(f"cat {outside}/secret.txt", str(root), terminal.Limits(confine_fs=False)))
  assert r.output == "s3cret\n"  # the same command unconfined reads it: the confinement did the refusing


def test_no_network(tmp_path):
  if not terminal.Limits.network_isolated():
    pytest.skip("unshare --net not permitted here (needs root / CAP_SYS_ADMIN): commands keep the network")
  import socket
  with socket.socket() as srv:  # a listener on the host's loopback: reachable from here, not from the command
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    probe = f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'"
    r = run(terminal.run_command(probe, str(tmp_path)))
    # The host's listener is not there: a loopback of its own (bubblewrap brings one up: refused) or
    # none at all (`unshare --net`: unreachable).
    assert ("Connection refused" in r.output or "Network is unreachable" in r.output) and r.exit_code == 1
    r = run(terminal.run_command("python3 -c 'import socket; socket.create_connection((\"192.0.2.1\", 80), timeout=2)'",
                                 str(tmp_path)))
    assert "Network is unreachable" in r.output and r.exit_code == 1  # no route out at all
    r = run(terminal.run_command(probe, str(tmp_path), terminal.Limits(no_network=False)))
    assert r.output == "" and r.exit_code == 0  # the same probe with network: connects


def test_session_survives_refusals_and_floods(tmp_path):
  lim = terminal.Limits(timeout_s=0.5, max_output=100)
  s = SdkSession(str(tmp_path), lim)

  async def go():
    outs = [await s.execute(A.ReadFile("../../etc/passwd")), await s.execute(A.RunCommand("sleep 5"))]
    # The flood ends by itself (head): a generous limit so that a slow sandbox start cannot cut it
    # short; the same session goes on.
    s.limits = dataclasses.replace(lim, timeout_s=60)
    outs += [await s.execute(A.RunCommand("yes | head -c 100000")), await s.execute(A.WriteFile("ok.txt", "fine")),
             await s.execute(A.McpCall("nope", "t", "{}"))]
    await s.aclose()
    return outs
  refused, slow, flood, ok, mcp = run(go())
  assert refused.error == "PathRefused: path '../../etc/passwd' is outside the session directory"
  assert "[timed out; command killed]" in slow.text and slow.error is None
  assert flood.text.startswith("y\n" * 50) and "[output truncated]" in flood.text
  assert flood.text.endswith("[exit code 0]")  # it ended by itself, not by the time-out
  assert ok.text == "wrote 4 bytes to ok.txt" and (tmp_path / "ok.txt").read_text() == "fine"
  assert mcp.error.startswith("UnknownMcpServer: no MCP server 'nope'")


_SDK_ALPHABET = st.sampled_from(list("run_commandreadwritelistsearchmcpcallfilepathtoolserverarguments(),='\"{}[]:\\ .0123456789"))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), st.text(alphabet=_SDK_ALPHABET, max_size=80),
                 st.builds(lambda n, body: f"{n}({body})", st.sampled_from(A.SDK_ACTION_NAMES),
                           st.text(alphabet=_SDK_ALPHABET, max_size=60))))
def test_any_string_parses_or_raises_a_parse_error_with_sdk(text):
  try:
    a = A.parse(text, sdk=True)
  except A.ActionParseError as e:
    assert e.reason
  else:
    if A.is_sdk(a):  # GUI points round-trip only up to the integer grid
      assert A.parse(A.format_action(a), sdk=True) == a
