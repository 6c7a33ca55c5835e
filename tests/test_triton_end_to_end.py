"""`pagecli generate --attention triton` (interpreted on CPU in CI) gives the torch backend's greedy tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagecli.cli import main

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton needs a GPU or TRITON_INTERPRET=1 (conftest sets it on CPU)",
)


def test_generate_with_triton_equals_torch(tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Paged attention keeps the KV cache in fixed-size blocks."},  # several blocks: prefill kernel
        {"messages": [{"role": "user", "content": "Hello world!"}]},
        {"prompt": "fox"},
    ]) + "\n")
    outputs = {}
    for backend in ("torch", "triton"):
        dst = tmp_path / f"{backend}.jsonl"
        # A small token budget forces chunked prefill, so the prefill kernel also runs over a cached prefix.
        assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), "--attention", backend,
                     "--block-size", "4", "--max-num-batched-tokens", "8", "-t", "0", "-n", "5", "--ignore-eos",
                     "--no-progress"]) == 0
        outputs[backend] = [json.loads(x)["text"] for x in dst.read_text().splitlines()]
    assert outputs["triton"] == outputs["torch"]
    assert all(outputs["torch"])


def test_triton_without_a_gpu_or_interpreter_is_a_clear_error(monkeypatch):
    from pagecli.attention import select_backend
    from pagecli.errors import PagecliError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(PagecliError, match="needs an NVIDIA GPU"):
        select_backend("triton", torch.device("cpu"))
