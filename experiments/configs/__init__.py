"""Experiment configs: each file's `get_config(arg)` returns an ml_collections.ConfigDict."""

import importlib.util


def load_module(path: str):
  """A config file as a module (its get_config, and constants such as ARGS or VARIANTS)."""
  spec = importlib.util.spec_from_file_location("_loaded_cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def load_config(path: str, arg: str):
  """`get_config(arg)` of a config file, as ml_collections' config_flags loads `--config path:arg`."""
  return load_module(path).get_config(arg)
