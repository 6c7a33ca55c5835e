"""The repository's kernels/ folder (installed as pagecli.kernels) next to Hugging Face's `kernels` package.

Run in the repository root (pytest, `python -m`, `python -c`), the folder is importable as a top-level `kernels`,
the import name of Hugging Face's package, which transformers probes for and from 5.25 depends on: there
transformers imported the folder for it and failed (`from kernels import CUDAProperties`), and every test that
loads a transformers model with it."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import importlib.util, kernels, transformers
from transformers.utils import is_kernels_available
if is_kernels_available():
    import transformers.integrations.hub_kernels  # its `from kernels import CUDAProperties, ...`
print(kernels.__file__)
from pagecli.kernels import paged_decode_attention, store_kv
"""


def _installed_kernels() -> str | None:
    """Where Hugging Face's kernels package is installed (None: not installed), found from outside the root."""
    search = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec("kernels", search)
    return None if spec is None else spec.origin


def test_in_the_repository_root_a_top_level_kernels_import_is_hugging_faces_package_or_nothing():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = done.stdout.strip().splitlines()[-1]
    installed = _installed_kernels()
    if installed is not None:  # the installed package, not the folder
        assert Path(imported).resolve() == Path(installed).resolve()
    else:  # the folder, empty under that name: transformers takes it as absent
        assert Path(imported).resolve() == ROOT / "kernels" / "__init__.py"


def test_pagecli_kernels_is_the_folder():
    import pagecli.kernels

    assert Path(pagecli.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert callable(pagecli.kernels.paged_prefill_attention)
