r"""Where the time of `benchmarks/decode.py` goes: ablations of our greedy decode on the same model.

  .venv/bin/python -m benchmarks.decode_profile [--batch_sizes 1,16] [--new_tokens 64] [--repeats 3]

For each batch size, times (compiled first, best of `repeats`) `sampler.generate` with 1 new token
(= the prefill, vision encoder included, plus one step) and with `new_tokens` tokens; the difference
over `new_tokens - 1` is the cost of one decode step (the whole loop runs inside one jitted
`lax.while_loop`: no host round trips per token). Then the same with the MoE layers' expert compute
swapped, for measurement only (monkeypatched here, `tars_jax/models/moe.py` is untouched):
  dense        the model as it is: every token through all E experts, weighted by the top-k gates;
  top-k gather the same function computing only each token's k experts (gathering their weights);
  no experts   the expert MLP replaced by zeros (router kept): a lower bound of everything else.
Greedy tokens of the top-k variant are checked equal to the dense ones (it is the same function).
"""

from __future__ import annotations

import contextlib
import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_model import best_time, hf_model
from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
from tars_jax.models import moe as moe_lib
from tars_jax.models.inference import sampler
from tars_jax.models.interop import hf_io

_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "16"], "Batch sizes to time.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Greedy tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per setting (the best is reported).")


def _topk_call(self, x):
  b, t, d = x.shape
  flat = x.reshape(b * t, d)
  probs, w, idx = moe_lib.route(self.router(flat), self.top_k, self.norm_topk_prob)
  wgu, wd = (a[idx] for a in self._weights())  # [N, k, D, 2, I], [N, k, I, D]
  h = moe_lib.swiglu(jnp.einsum("nd,nkdgi->nkgi", flat, wgu), axis=2)
  y = jnp.einsum("nki,nkid,nk->nd", h, wd, w.astype(self.dtype))
  return y.reshape(b, t, d), (probs, idx)


def _zero_call(self, x):
  b, t, d = x.shape
  probs, _, idx = moe_lib.route(self.router(x.reshape(b * t, d)), self.top_k, self.norm_topk_prob)
  return jnp.zeros_like(x), (probs, idx)


@contextlib.contextmanager
def _moe_variant(call):
  saved = moe_lib.MoE.__call__
  if call is not None:
    moe_lib.MoE.__call__ = call
  try:
    yield
  finally:
    moe_lib.MoE.__call__ = saved


def main(argv):
  del argv
  hf = hf_model()
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    ours = hf_io.load_pretrained(d, image_h=112, image_w=112)
  rng = np.random.default_rng(0)
  n = _NEW.value
  print(f"\ndecode profile, prompt 36 tokens incl. one 112x112 image, {n} new tokens, "
        f"{jax.devices()[0].platform}")
  print(f"{'batch':>5} {'experts':>13} {'prefill ms':>11} {'step ms':>8} {'step tok/s':>11} {'total tok/s':>12} "
        f"{'same as dense':>14}", flush=True)
  for b in (int(x) for x in _BATCHES.value):
    prompt = [BOS] + list(rng.integers(0, 256, 16)) + [VISION_START] + [IMAGE] * 16 + [VISION_END, 65]
    toks = jnp.asarray(np.tile(np.asarray(prompt, np.int32), (b, 1)))
    mask = jnp.ones(toks.shape, bool)
    imgs = jnp.asarray(rng.random((b, 1, 112, 112, 3)), jnp.float32)
    ref = None
    for name, call in (("dense", None), ("top-k gather", _topk_call), ("no experts", _zero_call)):
      with _moe_variant(call):
        jax.clear_caches()  # the jitted sampler traces MoE.__call__: recompile per variant
        run = lambda m: jax.block_until_ready(sampler.generate(
            ours.policy, toks, mask, imgs, None, jax.random.PRNGKey(0), max_new_tokens=m, temperature=0.0,
            eos_id=-1, pad_id=PAD).tokens)
        _, t1 = best_time(lambda: run(1), _REPEATS.value, warmup=1)
        out, tn = best_time(lambda: run(n), _REPEATS.value, warmup=1)
      if ref is None:
        ref = out
      same = "" if call is not _topk_call else str(bool(np.array_equal(np.asarray(out), np.asarray(ref))))
      step = (tn - t1) / (n - 1)
      print(f"{b:>5} {name:>13} {t1 * 1e3:>11.1f} {step * 1e3:>8.2f} {b / step:>11.1f} {b * n / tn:>12.1f} "
            f"{same:>14}", flush=True)


if __name__ == "__main__":
  app.run(main)
