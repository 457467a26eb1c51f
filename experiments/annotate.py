r"""Interactive annotation (report section 2.4.2): a web page where people supervise the run's policy
on-policy in live sandboxes — accept one of its proposed replies or override it — writing trajectory
records the SFT stage trains on (docs/annotation.md).

  python -m experiments.annotate --run runs/main --tasks miniwob/click-test-2,miniwob/enter-text
  # open http://127.0.0.1:8900 ; then train on what was written:
  python -m experiments.sft --config experiments/configs/miniwob_pipeline.py:sft --workdir runs/main/sft2 \
      "--config.sft.data=('runs/main/annotations',)" --config.policy.init=runs/main/sft

For a team: start sandbox servers with a token (`TARS_SANDBOX_TOKEN`), then this server with the same
token and `--host 0.0.0.0 --servers http://...`; every annotator opens the page, enters the token and a
name, and gets their own sandbox session. Complete episodes go to `--out` (default
<run>/annotations), those closed half-way to `<out>/incomplete` (no stage reads it unless given it).
"""

from __future__ import annotations

import json
import logging
import os

from absl import app, flags
import ml_collections as mlc

_RUN = flags.DEFINE_string("run", None, "Run dir (or pipeline dir) whose newest policy proposes the candidates.")
_TASKS = flags.DEFINE_list("tasks", None, "Tasks to annotate (default: the run's config.tasks).")
_OUT = flags.DEFINE_string("out", None, "Annotation directory (default: <run>/annotations).")
_SERVERS = flags.DEFINE_list("servers", [], "Sandbox server URLs (default: launch one browser sandbox).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (not loopback: needs TARS_SANDBOX_TOKEN).")
_PORT = flags.DEFINE_integer("port", 8900, "Port of the page.")
_K = flags.DEFINE_integer("candidates", 3, "Candidate replies the policy proposes per turn.")
_IDLE = flags.DEFINE_float("idle_s", 600.0, "A session whose page has been silent this long is closed (incomplete).")
_SLOTS = flags.DEFINE_integer("slots", 12, "KV-cache slots of the policy's inference service.")


def main(argv):
  del argv
  import uvicorn

  from envs_bridge import protocol
  from envs_bridge.app import check_bind
  from envs_bridge.client import SandboxClient
  from envs_bridge.launch import launch_server
  from tars_jax.data.sources.annotation import AnnotationServer
  from tars_jax.data.sources.annotation_app import make_app
  from tars_jax.rollout.evaluation import resolve_run
  from tars_jax.train import state as state_lib

  logging.getLogger().setLevel(logging.WARNING)
  token = protocol.resolve_token(None)  # the sandbox fleet's
  try:
    check_bind(_HOST.value, token)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  run = resolve_run(_RUN.value)
  with open(os.path.join(run, "config.json")) as f:
    config = mlc.ConfigDict(json.load(f))
  parts = state_lib.build(config)
  params, step, src = state_lib.restore_policy(parts.init_state(config.seed), run)
  service = parts.inference_service(params, slots=_SLOTS.value, seed=config.seed, version=step)
  out = _OUT.value or os.path.join(run, "annotations")
  tasks = _TASKS.value or list(config.tasks)
  sandbox = None if _SERVERS.value else launch_server(step_ms=config.env.step_ms, lease_s=config.env.lease_s)
  urls = _SERVERS.value or [sandbox.url]
  server = AnnotationServer(parts, service, [], tasks, run, out, k=_K.value, idle_s=_IDLE.value)
  print(f"[annotate] policy {src} (version {step}); tasks by held-out success: {server.queue.order}; "
        f"writing to {out}; page http://{_HOST.value}:{_PORT.value}", flush=True)
  try:
    uvicorn.run(make_app(server, token, connect=lambda: [SandboxClient(u, token=token) for u in urls]),
                host=_HOST.value, port=_PORT.value, log_level="warning")
  finally:
    service.close()
    if sandbox is not None:
      sandbox.stop()


if __name__ == "__main__":
  flags.mark_flags_as_required(["run"])
  app.run(main)
