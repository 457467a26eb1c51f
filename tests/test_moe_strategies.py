"""Every MoE expert strategy (`moe.MoeStrategy`) against the "dense" reference on the same weights:
outputs and gradients (parameters and input), at token counts that take each shape regime of the
sorted strategies (blocks / the grouped loop, the bounded [E, C, D] buffer, per-token gathers); and
the decode layouts ("split", "ffi") the sampler passes to its loop, outputs only (decode is not
differentiated). "capacity" runs with a factor no expert can exceed (C >= N), so it drops nothing;
"all_to_all" without a mesh is "ragged" (its 8-device run is in test_sharding.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.models import ModelConfig, Policy, moe
from tars_jax.models.fast.cpu import expert_kernel
from tars_jax.models.moe import MoeStrategy

CFG = ModelConfig(hidden=64, experts=8, top_k=3, moe_intermediate=48)
# (B, T): N * k = 540 (blocks of 64 rows / the grouped loop), 48 (bounded buffer), 6 (< E: gathers)
TOKENS = [(3, 60), (2, 8), (2, 1)]
STRATEGIES = [  # (strategy, config overrides)
    (MoeStrategy("ragged", False, "none"), dict(moe_impl="ragged")),
    (MoeStrategy("capacity", False, "none"), dict(moe_impl="ragged", moe_capacity_factor=8.0)),
    (MoeStrategy("all_to_all", False, "none"), dict(moe_impl="ragged", moe_dispatch="all_to_all")),
    (MoeStrategy("blocked", False, "none"), dict(moe_impl="blocked")),
    (MoeStrategy("blocked", True, "none"), dict(moe_impl="blocked")),
    (MoeStrategy("grouped_xla", True, "none"), dict(moe_impl="grouped")),
    (MoeStrategy("grouped_blas", True, "none"), dict(moe_impl="grouped")),
]


def _layer(strategy: MoeStrategy, **overrides) -> moe.MoE:
  """The MoE layer of seed 0 (the same weights whatever the strategy) computing with `strategy`."""
  return moe.MoE(dataclasses.replace(CFG, **overrides), nnx.Rngs(0), strategy)


def _loss_and_grads(mod: moe.MoE, x):
  gd, st = nnx.split(mod)
  probe = jax.random.normal(jax.random.PRNGKey(7), x.shape)

  def f(st, x):
    y, _ = nnx.merge(gd, st)(x)
    return jnp.sum(jnp.sin(y) * probe), y

  (loss, y), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(st, x)
  return loss, y, g


def _close(got, want, what):
  scale = float(np.max(np.abs(np.asarray(want)))) + 1e-30
  err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
  assert err <= 1e-5 * max(scale, 1.0), (what, err, scale)


@pytest.mark.parametrize("tokens", TOKENS, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("strategy,overrides", STRATEGIES, ids=lambda s: s.summary() if isinstance(s, MoeStrategy) else "")
def test_strategy_equals_the_dense_reference(strategy, overrides, tokens):
  if strategy.experts == "grouped_blas":  # scripts/setup.sh builds the kernels: a missing build fails here, as in test_expert_kernel
    assert expert_kernel.available(), f"kernels not built: {expert_kernel.build_error()}"
  x = jax.random.normal(jax.random.PRNGKey(1), tokens + (CFG.hidden,))
  loss_d, y_d, g_d = _loss_and_grads(_layer(MoeStrategy("dense", False, "none"), moe_impl="dense"), x)
  loss_s, y_s, g_s = _loss_and_grads(_layer(strategy, **overrides), x)
  _close(y_s, y_d, "outputs")
  _close(loss_s, loss_d, "loss")
  flat_d, flat_s = jax.tree.leaves(g_d), jax.tree.leaves(g_s)
  assert len(flat_d) == len(flat_s)
  for a, b in zip(flat_s, flat_d):  # router, gate|up, down and the input
    _close(a, b, "gradient")
  assert float(jnp.max(jnp.abs(g_d[0]["router"]["kernel"][...]))) > 1e-4  # the router's gradient flows


@pytest.mark.parametrize("tokens", TOKENS, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("decode", ["split", "ffi"])
def test_decode_layout_equals_the_dense_reference(decode, tokens):
  if decode == "ffi":  # scripts/setup.sh builds the kernels: a missing build fails here, as in test_expert_kernel
    assert expert_kernel.available(), f"kernels not built: {expert_kernel.build_error()}"
  x = jax.random.normal(jax.random.PRNGKey(1), tokens + (CFG.hidden,))
  want = _layer(MoeStrategy("dense", False, "none"), moe_impl="dense")(x)[0]
  gd, st = nnx.split(_layer(MoeStrategy("grouped_xla", True, decode), moe_impl="grouped"))

  @jax.jit
  def forward(st, x):  # as in the sampler: the layout made from the parameters inside the jit
    mod = nnx.merge(gd, st)
    return mod(x, moe.decode_layout(mod))[0]

  _close(forward(st, x), want, decode)


def test_strategy_is_chosen_from_backend_mesh_dtype_and_config():
  """`select_strategy` is the one place the backend, the mesh and the dtype pick a path."""
  f32, bf16 = jnp.float32, jnp.bfloat16
  grouped = dataclasses.replace(CFG, moe_impl="grouped")
  blas = "grouped_blas" if expert_kernel.available() else "grouped_xla"
  ffi = "ffi" if expert_kernel.available() else "split"
  assert moe.select_strategy("cpu", None, f32, grouped) == MoeStrategy(blas, True, ffi)
  assert moe.select_strategy("gpu", None, f32, grouped) == MoeStrategy("grouped_xla", False, "none")
  assert moe.select_strategy("cpu", "a mesh", f32, grouped) == MoeStrategy("grouped_xla", False, "none")
  assert moe.select_strategy("cpu", None, bf16, dataclasses.replace(grouped, dtype="bfloat16")) == \
      MoeStrategy("grouped_xla", True, "split")  # neither kernel takes bfloat16
  assert moe.select_strategy("cpu", None, f32, dataclasses.replace(grouped, moe_decode_kernel=False)).decode == "split"
  assert moe.select_strategy("cpu", None, f32, dataclasses.replace(grouped, scan_layers=True)).decode == "none"
  assert moe.select_strategy("cpu", None, f32, dataclasses.replace(CFG, moe_impl="dense")).experts == "dense"
  assert moe.select_strategy("cpu", None, f32, dataclasses.replace(
      CFG, moe_impl="ragged", moe_capacity_factor=1.0)).experts == "capacity"
  with pytest.raises(ValueError, match="experts="):
    MoeStrategy("sparse", False, "none")


def test_policy_reports_its_strategy():
  pol = nnx.eval_shape(lambda: Policy(dataclasses.replace(CFG, moe_impl="blocked", layers=2), nnx.Rngs(0)))
  want = moe.select_strategy(jax.default_backend(), None, jnp.float32, pol.cfg)
  assert pol.moe_strategy_summary() == want.summary()
  assert want.summary().startswith("experts=blocked bounded=per_expert decode=")
  assert all(layer.mlp.strategy == want for layer in pol.trunk.decoder.layers if isinstance(layer.mlp, moe.MoE))
  dense = nnx.eval_shape(lambda: Policy(ModelConfig(family="qwen2_5_vl", experts=0, deepstack_visual_indexes=(),
                                                    heads=4, head_dim=32), nnx.Rngs(0)))
  assert dense.moe_strategy_summary() == "no MoE layers"
