"""Triton kernels for attention over the paged KV cache: KV store, paged decode, prefill over a paged prefix.

Installed as `pagecli.kernels` (pyproject's package-dir). Where the repository root is on sys.path (pytest,
`python -m` or `python -c` run there), this folder is also importable as a top-level `kernels`, the import name
of Hugging Face's kernels package, which transformers probes for and from 5.25 depends on: transformers then
imported this folder for it and failed (`from kernels import CUDAProperties`). Imported under that name, this
module hands the import to the installed package where there is one (it puts that package in sys.modules, which
is what the import statement then returns), and is an empty module where there is none (transformers then finds
no version and takes it as absent)."""

import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
else:
    from pagecli.kernels.decode import paged_decode_attention
    from pagecli.kernels.prefill import paged_prefill_attention
    from pagecli.kernels.store_kv import store_kv

    __all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
