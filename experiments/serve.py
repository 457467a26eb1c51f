r"""The policy's inference service as its own process (report section 2.5.3): continuous batching over
KV-cache slots behind HTTP (`tars_jax/rollout/inference_remote.py` lists the routes).

  python -m experiments.serve --run runs/main/sft --port 8800          # a run's latest policy
  python -m experiments.serve --config experiments/configs/miniwob_ppo.py:smoke --port 8800 [--init DIR]

Clients: a trainer with `--config.rollout.inference=http://HOST:8800` (it pushes its weights after
each update, versioned), `python -m experiments.eval --inference http://HOST:8800`, or
`RemoteInference(url)` in code. Each checks at connection that the server builds the same model
(`Parts.served_model_id`: architecture, tokenizer, grammar, screenshot size, system prompt) and
refuses another. docs/running.md, "Inference service on its own host", says what fails how.
"""

from __future__ import annotations

import json
import os

from absl import app, flags
from ml_collections import config_flags
import ml_collections as mlc

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)): the policy's model.")
_RUN = flags.DEFINE_string("run", "", "Run dir (or pipeline dir) whose config and latest policy to serve.")
_INIT = flags.DEFINE_string("init", "", "With --config: run dir or step dir whose policy to serve (default: "
                            "the config's policy.init, else its random init).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0: every interface; needs a token).")
_TOKEN = flags.DEFINE_string("token", None, "Bearer token every route but /health requires (default: env "
                             "TARS_INFERENCE_TOKEN; none: loopback only).")
_PORT = flags.DEFINE_integer("port", 8800, "Port.")
_SLOTS = flags.DEFINE_integer("slots", 0, "KV-cache slots, i.e. requests decoded together (0 = env.num_sessions).")
_VERSION = flags.DEFINE_integer("version", 0, "Version of the initial weights.")


def main(argv):
  del argv
  import jax
  import uvicorn

  from envs_bridge import protocol
  from envs_bridge.app import check_bind
  from tars_jax.rollout.evaluation import resolve_run
  from tars_jax.rollout.inference_remote import TOKEN_ENV, make_app
  from tars_jax.train import state as state_lib

  if bool(_RUN.value) == bool(_CONFIG.value):
    raise app.UsageError("give exactly one of --run (a run dir) and --config")
  token = protocol.resolve_token(_TOKEN.value, TOKEN_ENV)
  try:
    check_bind(_HOST.value, token, TOKEN_ENV)  # anyone reaching the port could push weights
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if _RUN.value:
    run = resolve_run(_RUN.value)
    with open(os.path.join(run, "config.json")) as f:
      config = mlc.ConfigDict(json.load(f))
    init = run
  else:
    config = _CONFIG.value
    init = _INIT.value or config.policy.get("init", "")
  jax.config.update("jax_default_matmul_precision", config.matmul_precision)
  parts = state_lib.build(config)
  template = parts.init_state(config.seed)
  params = template["policy"]
  if init:
    params = state_lib.load_policy(template, init, parts.popt)[0]["policy"]
    print(f"[serve] policy from {init}")

  def restore(path):  # POST /weights/checkpoint
    return state_lib.restore_policy(template, path)[0]

  service = parts.inference_service(params, slots=_SLOTS.value or config.env.num_sessions, seed=config.seed,
                                    version=_VERSION.value)
  model_id = parts.served_model_id()
  print(f"[serve] http://{_HOST.value}:{_PORT.value}: model {model_id}, {service.n_slots} slots "
        f"of {service.context_len} cache positions, weights version {service.version}", flush=True)
  try:
    uvicorn.run(make_app(service, restore, model_id, token=token), host=_HOST.value,
                port=_PORT.value, log_level="warning")
  finally:
    service.close()


if __name__ == "__main__":
  app.run(main)
