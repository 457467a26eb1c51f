"""Every script module the tests import loads beside the others in one process.

The scripts under `benchmarks/` and `experiments/` define absl flags at import time, and absl raises
`DuplicateFlagError` when two modules define one name. Each script runs alone, so sharing a name like
`--batch` is fine there; but pytest loads every test file into one process, so a test that imports a
script's helper drags its flags in (CI of 2026-11-25 failed this way: `--variants` of two scripts). Helpers meant for tests live in flag-free
modules (`benchmarks/bench_model.py`)."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("benchmarks", "experiments")


def imported_script_modules() -> list[str]:
  """Dotted names of `benchmarks.*` / `experiments.*` modules that any test file imports (parsed, not run)."""
  found = set()
  for path in sorted((ROOT / "tests").glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
        for alias in node.names:  # `from experiments import plot` imports a module; `from x.y import f` does not
          sub = ROOT / node.module.replace(".", "/") / f"{alias.name}.py"
          found.add(f"{node.module}.{alias.name}" if sub.exists() else node.module)
      elif isinstance(node, ast.Import):
        found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
  return sorted(found)


def test_scan_finds_the_flag_defining_imports():
  mods = imported_script_modules()
  assert "experiments.plot" in mods and "benchmarks.bench_model" in mods, mods  # plot defines flags at import


def test_imported_script_modules_load_together():
  mods = imported_script_modules()
  code = "\n".join(f"import {m}" for m in mods)
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, f"importing {mods} in one process failed:\n{r.stderr[-3000:]}"


def test_a_flag_clash_is_caught(tmp_path):
  """The check above can fail: two modules defining one flag name do not load together."""
  for name in ("clash_a", "clash_b"):
    (tmp_path / f"{name}.py").write_text("from absl import flags\nflags.DEFINE_integer('batch', 1, '')\n")
  r = subprocess.run([sys.executable, "-c", "import clash_a, clash_b"], cwd=tmp_path, capture_output=True, text=True)
  assert r.returncode != 0 and "DuplicateFlagError" in r.stderr
