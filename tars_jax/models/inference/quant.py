"""Quantised serving weights: W8A8 and W4A8 inference (report section 3, "Quantization for Latency
Reduction": UI-TARS-2 serves W4A8, 29.6 -> 47 tokens/s, OSWorld 47.5 -> 44.4), plus their
weight-only variants.

`Quantizer(graphdef, mode).quantize(params) -> (graphdef', params')` turns a float policy split
(`nnx.split(Policy)`) into a quantised one that every `(graphdef, params)` function of the sampler
(`sampler.generate`) and of the continuous-batching service (`slot_decode.prefill / step`) runs
unchanged; `BatchedPolicy(quantize=...)` and `InferenceService(quantize=...)` call it once per
weight version.

What is quantised (decoder only, where the matmul FLOPs and the bytes read per decode step are):
  - the attention projections q/k/v/o and dense SwiGLU MLPs (`nnx.Linear` kernels [K, N]),
  - the MoE experts (`w_gate_up` [E, D, 2, I], `w_down` [E, I, D]).
What stays float (the model's own dtype):
  - embeddings (a gather, no matmul: quantising saves bytes, not FLOPs),
  - RMSNorm scales and biases (a handful of values; their errors would hit every channel),
  - the MoE router (top-k is a discrete choice: a small logit error flips which expert runs),
  - the LM head (its logits are the sampling distribution and the behaviour log-probs PPO records),
  - the vision encoder (few parameters here; the report's W4A8 is about the LLM),
  - the KV cache and attention scores (activation x activation products).

Weights: symmetric, round-to-nearest-even, scale = max |w| / qmax over a group of the contraction
axis, qmax = 127 (int8) or 7 (int4); int8 has one group per output channel (per-channel scales),
int4 groups of `INT4_GROUP` consecutive input channels per output channel (per-group scales, as
GPTQ / AWQ / QServe W4A8). Every element then satisfies |w - q * scale| <= scale / 2. int4 values are
stored as `jnp.int4`.

Activations (the "A8" of W8A8 / W4A8): the input of each quantised matmul is quantised per token
(per row over the contraction axis: dynamic, symmetric, qmax 127), the products are int8 x int8
`lax.dot_general`s accumulating in int32 (`preferred_element_type`), and the int32 sums are scaled
back to float by s_x * s_w (per group, then summed over groups for int4). The MoE experts' hidden
activations (after SwiGLU) are quantised per (token, expert) row. With an activation-quantised mode
the experts run every token through every expert (the "dense" computation, `moe.MoE._dense`) in
int8, whatever the model's `MoeStrategy`.

Weight-only modes ("int8_weight_only", "int4_weight_only"): the same int weights, dequantised inside
the jitted program when the layer reads them (`QTensor.__getitem__`), and a float matmul: the model's
own code and MoE strategy run unchanged, exactly as a float model whose weights are the dequantised
ones (tested).

Library choice: google/qwix 0.1.8 (PTQ by intercepting dot_general / einsum in an NNX model) was
tried on this model and not used: `quantize_model` raises on the MoE's reference computation
("Unsupported einsum format: 'nei,eid,ne->nd'": its PTQ einsum takes two operands), so the experts,
most of the decoder's weights, could not be quantised without rewriting `moe.py`; and its
interception of `jnp.einsum` (a jitted function) flips the process-global `jax_disable_jit` while a
quantised model traces, which the inference service's decode thread would do beside a training thread.
With only the attention projections as targets it worked (also through `nnx.split` / `merge` under
jit). The int ops here are `jax.lax.dot_general` / `jnp.einsum` with int8 operands and int32
accumulation (`preferred_element_type`).

Speed on XLA:CPU (benchmarks/RESULTS.md, "Quantised inference"): an int8 x int8 -> int32 dot is about
2x faster than float32 with XLA's default CPU options, but about 2.4x slower under the options the
decode loops compile with (`cpu/compile_options.DECODE_CPU_OPTIONS`, YNNPACK fusions off), and int
dots over per-group slices (int4's groups) are off the fast path either way; so W8A8 / W4A8 decode
slower than float32 here, the weight-only modes about as fast. The memory saving is real (int8 half,
int4 a quarter of float32 bytes on the quantised weights).

Single device (like `InferenceService`): quantised leaves carry no sharding metadata.
Note for PPO: quantised rollouts record the quantised policy's log-probs as the behaviour log-probs
(`old_logp`), so the float policy the trainer differentiates is not the behaviour policy: with the
plain clipped objective the ratio starts away from 1 by the quantisation error (clipping may then
bite in the first epoch); the decoupled objective (`rl.decoupled`, `train/ppo.py`) keeps the trust
region around the float pre-update policy and uses the behaviour log-probs only as an importance
weight. Not measured in training yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models.moe import MoE, swiglu

INT4_GROUP = 32  # input channels per int4 scale (the common W4 group size: GPTQ, AWQ use 32-128)


@dataclasses.dataclass(frozen=True)
class QuantMode:
  """weight_bits: 8 or 4; group: input channels per weight scale (None = the whole contraction axis:
  per-channel); act_bits: 8 (WxA8: int8 activations and int dots) or None (weight-only)."""
  weight_bits: int
  group: int | None
  act_bits: int | None


MODES = {
    "int8": QuantMode(8, None, 8),  # W8A8
    "int4": QuantMode(4, INT4_GROUP, 8),  # W4A8
    "int8_weight_only": QuantMode(8, None, None),
    "int4_weight_only": QuantMode(4, INT4_GROUP, None),
}


class QuantizationError(ValueError):
  """An unknown quantisation mode, or a weight whose contraction axis the group size does not divide."""


def check_mode(mode: str | None) -> QuantMode | None:
  """The `QuantMode` of a mode name (None -> None). Raises QuantizationError for an unknown name."""
  if mode is None:
    return None
  if mode not in MODES:
    raise QuantizationError(f"unknown quantisation mode {mode!r}; known: {sorted(MODES)} or None")
  return MODES[mode]


def qmax(bits: int) -> int:
  """Largest magnitude of the symmetric signed grid: 127 for 8 bits, 7 for 4."""
  return (1 << (bits - 1)) - 1


@jax.tree_util.register_pytree_node_class
class QTensor:
  """A quantised weight: q (int8 or int4, the weight's shape) and float32 scale (the weight's shape with
  the contraction axis `axis` (negative: counted from the end, so a stacked layer axis in front does not
  move it) replaced by its number of groups). Reading it with `[...]` (what `nnx.Variable` does for
  `param[...]`) returns the dequantised float weight q * scale in `dtype`."""

  def __init__(self, q, scale, axis: int, dtype):
    self.q, self.scale, self.axis, self.dtype = q, scale, axis, jnp.dtype(dtype)

  def tree_flatten(self):
    return (self.q, self.scale), (self.axis, self.dtype.name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  @property
  def shape(self):
    return self.q.shape

  @property
  def ndim(self):
    return len(self.q.shape)

  @property
  def groups(self) -> int:
    return self.scale.shape[self.axis]

  def dequantize(self) -> jax.Array:
    """q * scale in `dtype` (float32 product, then cast), the weight's shape."""
    return dequantize(self.q, self.scale, self.axis).astype(self.dtype)

  def __getitem__(self, index):
    return self.dequantize()[index]


def _grouped(a, axis: int, groups: int):
  """a with its `axis` (negative) split into (groups, K // groups)."""
  ax = a.ndim + axis
  return a.reshape(a.shape[:ax] + (groups, a.shape[ax] // groups) + a.shape[ax + 1:])


def quantize_array(w: jax.Array, bits: int, axis: int, group: int | None) -> QTensor:
  """Symmetric round-to-nearest quantisation of w along its contraction axis `axis` (negative).

  w: float array; bits: 8 or 4; group: channels of `axis` per scale (None = all: per channel).
  Returns QTensor(q int8 / int4 [w.shape], scale float32 [w.shape with axis -> K // group]);
  scale = max |w| over the group / qmax(bits) (1 for an all-zero group, whose q is 0).
  Raises QuantizationError if group does not divide the axis.
  """
  k = w.shape[axis]
  g = k if group is None else group
  if k % g:
    raise QuantizationError(f"group {g} does not divide the contraction axis of size {k} (shape {w.shape})")
  return _quantize(w, bits=bits, axis=axis, groups=k // g)


@functools.partial(jax.jit, static_argnames=("bits", "axis", "groups"))
def _quantize(w, *, bits, axis, groups):
  m = qmax(bits)
  wg = _grouped(w.astype(jnp.float32), axis, groups)
  gax = w.ndim + axis + 1  # the within-group axis of wg
  amax = jnp.max(jnp.abs(wg), axis=gax, keepdims=True)
  scale = jnp.where(amax > 0, amax / m, 1.0)
  q = jnp.clip(jnp.round(wg / scale), -m, m).reshape(w.shape)
  return QTensor(q.astype(jnp.int8 if bits == 8 else jnp.int4), jnp.squeeze(scale, gax), axis, w.dtype)


def dequantize(q, scale, axis: int) -> jax.Array:
  """float32 q * scale: q [..., K, ...] (K at `axis`, negative), scale [..., K // G, ...]."""
  groups = scale.shape[axis]
  qg = _grouped(q.astype(jnp.float32), axis, groups)
  return (qg * jnp.expand_dims(scale, q.ndim + axis + 1)).reshape(q.shape)


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-row (last axis) dynamic symmetric int8: x [..., K] float -> (q [..., K] int8, scale [..., 1]
  float32) with scale = max |x| / 127 over the row (1 for a zero row), q = round(x / scale)."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  s = jnp.where(amax > 0, amax / 127.0, 1.0)
  return jnp.clip(jnp.round(x / s), -127, 127).astype(jnp.int8), s


def int_matmul(x: jax.Array, w: QTensor) -> jax.Array:
  """WxA8 x @ w: x [..., K] float, w a QTensor of a kernel [K, N] (axis -2) -> [..., N] float32.

  x quantised per row (`quantize_activations`); per weight group an int8 x int8 dot accumulating in
  int32, scaled by the group's weight scale, summed over groups, times the row's activation scale.
  """
  xq, sx = quantize_activations(x)
  k, n = w.q.shape
  g = w.groups
  wq = w.q.astype(jnp.int8)  # int4 -> int8 operand (the dot's int path takes int8)
  if g == 1:
    acc = jax.lax.dot_general(xq, wq, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * w.scale[0]
  else:
    acc = jnp.einsum("...gk,gkn->...gn", xq.reshape(xq.shape[:-1] + (g, k // g)), wq.reshape(g, k // g, n),
                     preferred_element_type=jnp.int32)
    # the group sum as multiply + reduce: as an einsum it is a dot of contraction length G, slow on CPU
    y = jnp.sum(acc.astype(jnp.float32) * w.scale, axis=-2)
  return y * sx


class QuantLinear(nnx.Linear):
  """`nnx.Linear` whose kernel is a `QTensor`: y = int_matmul(x, kernel) + bias (W8A8 / W4A8).
  Made by `Quantizer` by swapping the class of a float model's layer (parameters otherwise the same)."""

  def __call__(self, inputs, out_sharding=None):
    dt = self.dtype or inputs.dtype
    y = int_matmul(inputs, self.kernel.get_value()).astype(dt)
    if self.bias is not None:
      y = y + self.bias[...].astype(dt)
    return y


class QuantMoE(MoE):
  """`MoE` with `QTensor` experts run in int8 (W8A8 / W4A8): every token through every expert, as the
  "dense" reference (`MoE._dense`), with per-token int8 inputs to gate|up and per-(token, expert) int8
  SwiGLU outputs to down. The router stays float."""

  def experts_fn(self):
    return self._int_dense

  def _int_dense(self, flat, w, idx, decode_weights):
    gu, dn = self.w_gate_up.get_value(), self.w_down.get_value()
    e, d, _, i = gu.q.shape
    dense_w = jnp.sum(jax.nn.one_hot(idx, self.experts, dtype=jnp.float32) * w[..., None], axis=1)  # [N, E]
    xq, sx = quantize_activations(flat)  # [N, D], [N, 1]
    g1 = gu.groups
    if g1 == 1:  # per channel: one plain int dot (a size-1 group axis takes XLA:CPU off its fast path)
      acc = jnp.einsum("nd,edci->neci", xq, gu.q.astype(jnp.int8), preferred_element_type=jnp.int32)
      pre = acc.astype(jnp.float32) * gu.scale[:, 0]
    else:
      acc = jnp.einsum("ngk,egkci->negci", xq.reshape(-1, g1, d // g1),
                       gu.q.astype(jnp.int8).reshape(e, g1, d // g1, 2, i), preferred_element_type=jnp.int32)
      pre = jnp.sum(acc.astype(jnp.float32) * gu.scale, axis=2)  # scale, sum over groups
    h = swiglu((pre * sx[:, :, None, None]).astype(self.dtype), axis=2)  # [N, E, I]
    hq, sh = quantize_activations(h)  # per (token, expert)
    g2 = dn.groups
    if g2 == 1:
      acc = jnp.einsum("nei,eid->ned", hq, dn.q.astype(jnp.int8), preferred_element_type=jnp.int32)
      y = acc.astype(jnp.float32) * dn.scale[:, 0]
    else:
      acc = jnp.einsum("negk,egkd->negd", hq.reshape(hq.shape[:2] + (g2, i // g2)),
                       dn.q.astype(jnp.int8).reshape(e, g2, i // g2, d), preferred_element_type=jnp.int32)
      y = jnp.sum(acc.astype(jnp.float32) * dn.scale, axis=2)
    y = y * sh  # [N, E, D]
    return jnp.einsum("ned,ne->nd", y, dense_w).astype(self.dtype), None


def _decoder_layer_path(path) -> bool:
  return "decoder" in path and "layers" in path


class Quantizer:
  """Turns float policy parameters into quantised serving parameters, one weight version at a time.

  `Quantizer(graphdef, mode)`: graphdef of a `Policy` (or `ValueModel`) split; mode one of `MODES`
  or None (serve as is). `quantize(params) -> (graphdef', params')`: the quantised layers' weights
  become `QTensor`s (and, with activation quantisation, their modules `QuantLinear` / `QuantMoE`:
  graphdef' differs from graphdef, the same for every params of that graphdef, so jitted functions
  compile once). The input params are not modified. Raises QuantizationError (unknown mode; a group
  size that does not divide a quantised weight's input axis)."""

  def __init__(self, graphdef, mode: str | None):
    self.graphdef, self.mode_name, self.mode = graphdef, mode, check_mode(mode)

  def quantize(self, params):
    if self.mode is None:
      return self.graphdef, params
    m = self.mode
    # new Variables over the same arrays: merge would reuse the State's own Variable objects, and
    # set_value below would then change the caller's params
    model = nnx.merge(self.graphdef, jax.tree.map(lambda x: x, params))
    for path, mod in list(nnx.iter_graph(model)):  # collected first: the loop swaps classes
      if not _decoder_layer_path(path):
        continue
      if isinstance(mod, MoE):
        for name, axis in (("w_gate_up", -3), ("w_down", -2)):
          var = getattr(mod, name)
          var.set_value(quantize_array(var.get_value(), m.weight_bits, axis, m.group))
        if m.act_bits is not None:
          mod.__class__ = QuantMoE
      elif isinstance(mod, nnx.Linear) and "router" not in path:
        mod.kernel.set_value(quantize_array(mod.kernel.get_value(), m.weight_bits, -2, m.group))
        if m.act_bits is not None:
          mod.__class__ = QuantLinear
    return nnx.split(model)


def serving_bytes(params) -> int:
  """Bytes of a (possibly quantised) parameter pytree at its storage width (int4: half a byte)."""
  total = 0
  for leaf in jax.tree.leaves(params):
    bits = 4 if leaf.dtype == jnp.int4 else leaf.dtype.itemsize * 8
    total += leaf.size * bits // 8
  return total
