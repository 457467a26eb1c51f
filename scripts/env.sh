# Sourced by the other scripts (and by you, for your own commands: `source scripts/env.sh`):
# PYTHONPATH = the checkout, and tcmalloc as the allocator of the processes started from here.
# Why PYTHONPATH when setup.sh installs the project editable: that install points at the checkout that
# ran setup.sh; a second checkout or git worktree sharing the same .venv must import its own code, and
# PYTHONPATH comes before site-packages.
# Why tcmalloc: XLA:CPU allocates each step's buffers with malloc and glibc hands large blocks back to
# the kernel on free, so every train step faults its ~400 MB of temporaries in again (~100k page
# faults per step of benchmarks/train_step.py at batch 16); tcmalloc keeps them (benchmarks/RESULTS.md,
# "allocator"). TARS_MALLOC=system keeps glibc's malloc.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Where a JAX compilation cache is set (JAX_COMPILATION_CACHE_DIR: CI, the replication suite, the
# pipelines), keep every program in it, not only those that took >= 1 s (JAX's default): a smoke
# trainer process compiles ~160 small programs (~8 s together), again in each process otherwise
# (benchmarks/RESULTS.md, "`.ci/run` at `242b41d`").
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
if [[ ${TARS_MALLOC:-tcmalloc} != system && ${LD_PRELOAD:-} != *tcmalloc* ]]; then
  # No early-exiting reader in a pipe (awk 'exit', grep -q): under `set -o pipefail` the writer's SIGPIPE
  # (exit 141) would end the sourcing script.
  _tcmalloc=$(/sbin/ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{lib=$NF} END{print lib}' || true)
  if [[ -n $_tcmalloc ]]; then
    export LD_PRELOAD="$_tcmalloc${LD_PRELOAD:+:$LD_PRELOAD}"
    export TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=${TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD:-1099511627776}  # no "large alloc" noise
  else
    echo "[env] libtcmalloc_minimal.so.4 not found (scripts/setup.sh installs it): glibc malloc" >&2
  fi
  unset _tcmalloc
fi
