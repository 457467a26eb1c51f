r"""The data flywheel (UI-TARS-2 report section 2.3, the flywheel figure; issue #28): iterations of
generate -> validate -> route -> CT (every `ct_every`-th iteration) -> SFT -> RL -> held-out evaluation,
starting from a trained run of the main job's model (experiments/configs/miniwob_pipeline.py), every
stage a resumable run under one parent dir (experiments/flywheel.py):

  python -m experiments.flywheel --config experiments/configs/flywheel.py --workdir runs/flywheel \
      --config.flywheel.init=runs/main/ppo --config.flywheel.sft_base="('runs/main/demos',)"
  python -m experiments.flywheel --config experiments/configs/flywheel.py:smoke --workdir /tmp/fw   # tiny, CI
  python -m experiments.flywheel --config experiments/configs/flywheel.py --workdir runs/fw2 \
      --config.flywheel.orm_run=runs/orm       # V from the ORM instead of the verifiers

The `flywheel` section's fields and defaults are in experiments/configs/miniwob_ppo.py (`flywheel_section`).
Everything outside it is the main job's config (model, grammar, prompt, tasks, RL
hyperparameters): the initial run must have been trained with it. The stages read it too (the driver
passes its own `--config.*` overrides on to every stage), with the stage's fields set from `flywheel`
(steps, learning rates, data dirs, initial policy).

Args: "" (main job's model and tasks) | "smoke" (tiny model, a few samples, one update per stage: CI).
"""

import ml_collections as mlc

from experiments.configs import miniwob_pipeline

ARGS = ("", "smoke")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  """Config of the flywheel; raises ValueError for an unknown arg."""
  arg = arg or ""
  if arg not in ARGS:
    raise ValueError(f"unknown config arg {arg!r}; expected one of {ARGS}")
  smoke = arg == "smoke"
  c = miniwob_pipeline.get_config("+smoke" if smoke else "")  # its `flywheel` section: miniwob_ppo.py
  # The supervised and RL stages are measured by the flywheel's own held-out evaluation, not during
  # training (their in-training evaluations would each launch a sandbox and play episodes).
  c.sft.eval_every = 0
  c.sft.eval_episodes = 0
  c.sft.heldout = ()
  c.eval_every = 0
  if smoke:
    c.vpt.max_iterations = 1
    c.log_trajectories = 0
    c.image_dependence_every = 0
  return c
