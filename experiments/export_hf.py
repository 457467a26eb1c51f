r"""Exports the policy of a run started from a transformers checkpoint (`policy.init=hf:<dir>`) as a
transformers checkpoint directory (weights, config, and the source's tokenizer / processor / chat
template), which `AutoModelForImageTextToText.from_pretrained` loads.

  python -m experiments.export_hf --config experiments/configs/miniwob_ppo.py:ppo \
      --config.policy.init=hf:/models/UI-TARS-1.5-7B --config.grammar.constrained=False \
      --workdir runs/uitars_ppo --out runs/uitars_ppo/hf_export

Pass the same --config flags as the training run (they name the source checkpoint and the model's
image size). The latest complete Orbax checkpoint of --workdir is exported (--step for another).
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

from tars_jax.agent import hf_tokenizer
from tars_jax.models.interop import hf_io
from tars_jax.train import state as state_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file of the training run.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (its checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "Directory to write the transformers checkpoint to.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv):
  del argv
  config = _CONFIG.value
  source = hf_tokenizer.hf_dir(config.policy.init)
  if source is None:
    raise app.UsageError(f"policy.init={config.policy.init!r}: only runs started from hf:<dir> are exported")
  parts = state_lib.build(config)
  state = parts.init_state(config.seed)  # the structure to restore into (and the source's weights)
  path = _WORKDIR.value if _STEP.value is None else os.path.join(_WORKDIR.value, "checkpoints", str(_STEP.value))
  policy, _, src = state_lib.restore_policy(state, path)
  hf_io.export_policy(policy, parts.model_cfg, source, _OUT.value)
  print(f"[export_hf] {src} -> {_OUT.value} ({parts.model_cfg.family}, tokenizer of {source})")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir", "out"])
  app.run(main)
