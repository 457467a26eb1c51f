r"""Copy fidelity of typing tasks over a run's training iterations (tars_jax/analysis/typing_fidelity.py):

  python -m experiments.typing_fidelity runs/replication4/ppo_kl/seed_1 runs/replication4/ppo_kl_mc/seed_0

One table row per run and block of iterations: episodes that typed, exact copies of the quoted text
(and how many of them succeeded), another episode's text, episodes that never typed.
"""

from __future__ import annotations

import os

from absl import app, flags

from tars_jax.analysis import typing_fidelity as tf

_TASK = flags.DEFINE_string("task", "miniwob/enter-text", "The typing task.")
_BLOCK = flags.DEFINE_integer("block", 10, "Iterations per row.")


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("name one or more run directories (each with rollouts/)")
  print("| run | iterations | typed | exact copy | of which succeeded | another episode's text | never typed |")
  print("|---|---|---|---|---|---|---|")
  for run in argv[1:]:
    for f in tf.fidelity(tf.rollout_episodes(os.path.join(run, "rollouts"), _TASK.value), _BLOCK.value):
      share = f.exact / f.episodes if f.episodes else float("nan")
      print(f"| {run} | {f.first}-{f.last} | {f.episodes} | {f.exact} ({share:.2f}) | {f.exact_success} "
            f"| {f.other_target} | {f.no_type} |")


if __name__ == "__main__":
  app.run(main)
