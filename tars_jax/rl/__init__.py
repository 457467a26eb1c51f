"""RL math as pure JAX functions: advantages (GAE, GRPO, RLOO), PPO losses, critic diagnostics."""

from tars_jax.rl import advantages, losses, metrics
