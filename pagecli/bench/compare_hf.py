"""`bench run --compare hf`: the same requests through transformers `generate`, and whether outputs agree.

transformers runs in a child process (`python -m pagecli.bench.compare_hf JOB RESULT`), so its
peak RSS is its own and not the engine's. It gets the exact prompt token ids the engine saw,
greedy decoding and the same output lengths and stop tokens. Requests run in static batches
(left-padded, `--hf-batch-size` at a time); a conversation's turns run one after another, as
in the engine. TTFT is measured the same way: from when a request's wave was submitted to
its batch's first generated token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagecli.bench.rss import peak_rss_bytes
from pagecli.bench.summary import percentile
from pagecli.errors import PagecliError


@dataclass(frozen=True)
class HFRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    wave: int


@dataclass(frozen=True)
class HFJob:
    model_folder: str
    dtype: str
    device: str
    threads: int | None
    batch_size: int
    stop_token_ids: tuple[int, ...]
    requests: tuple[HFRequest, ...]


@dataclass(frozen=True)
class HFResult:
    outputs: dict[str, tuple[int, ...]]
    ttft_s: dict[str, float]
    elapsed_s: float
    peak_rss_bytes: int | None
    peak_gpu_bytes: int | None
    batch_size: int
    transformers_version: str

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs.values())


@dataclass(frozen=True)
class Agreement:
    num_requests: int
    num_identical: int
    # request id -> index of the first output token that differs (for requests that differ)
    first_difference: dict[str, int]


@dataclass(frozen=True)
class Comparison:
    """transformers' run of the same requests, next to the engine's."""

    hf: HFResult
    agreement: Agreement
    hf_output_tokens_per_s: float
    hf_ttft_p50_s: float | None
    hf_ttft_p95_s: float | None


def comparison(engine_outputs: dict[str, tuple[int, ...]], hf: HFResult) -> Comparison:
    ttfts = list(hf.ttft_s.values())
    return Comparison(
        hf=hf, agreement=compare_outputs(engine_outputs, hf.outputs),
        hf_output_tokens_per_s=hf.output_tokens / hf.elapsed_s if hf.elapsed_s > 0 else 0.0,
        hf_ttft_p50_s=percentile(ttfts, 50), hf_ttft_p95_s=percentile(ttfts, 95),
    )


def compare_outputs(engine_outputs: dict[str, tuple[int, ...]], hf_outputs: dict[str, tuple[int, ...]]) -> Agreement:
    differences = {}
    for request_id, ours in engine_outputs.items():
        theirs = hf_outputs.get(request_id, ())
        if ours != theirs:
            differences[request_id] = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
            )
    return Agreement(len(engine_outputs), len(engine_outputs) - len(differences), differences)


def run_in_subprocess(job: HFJob, timeout_s: float | None = None) -> HFResult:
    with tempfile.TemporaryDirectory(prefix="pagecli-compare-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(asdict(job)))
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pagecli.bench.compare_hf", str(job_path), str(result_path)],
                capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
            )
        except subprocess.TimeoutExpired:
            raise PagecliError("The transformers comparison ran out of time; use a smaller workload.") from None
        if done.returncode != 0 or not result_path.is_file():
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise PagecliError(f"The transformers comparison failed: {last}")
        data = json.loads(result_path.read_text())
    return HFResult(
        outputs={k: tuple(v) for k, v in data["outputs"].items()}, ttft_s=data["ttft_s"],
        elapsed_s=data["elapsed_s"], peak_rss_bytes=data["peak_rss_bytes"], peak_gpu_bytes=data["peak_gpu_bytes"],
        batch_size=data["batch_size"], transformers_version=data["transformers_version"],
    )


def run_hf(job: HFJob) -> HFResult:
    """Load the model with transformers and generate every request of the job, timed."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from pagecli.models.gguf_weights import full_folder

    if job.threads:
        torch.set_num_threads(job.threads)
    device = torch.device(job.device)
    # A converted GGUF folder leaves its quantized weights in the file: transformers reads them dequantized
    # (and would otherwise start those weights from random values).
    with full_folder(Path(job.model_folder)) as folder:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, job.dtype),
                                                     trust_remote_code=False).to(device).eval()
    pad_id = 0
    _generate_batch(model, [HFRequest("warmup", job.requests[0].prompt_token_ids[:8], 2, True, 0)], (), pad_id, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    outputs: dict[str, tuple[int, ...]] = {}
    ttft: dict[str, float] = {}
    start = time.perf_counter()
    for wave in sorted({r.wave for r in job.requests}):
        wave_start = time.perf_counter()
        members = [r for r in job.requests if r.wave == wave]
        for i in range(0, len(members), job.batch_size):
            batch = members[i : i + job.batch_size]
            batch_outputs, first_token_s = _generate_batch(model, batch, job.stop_token_ids, pad_id, device)
            outputs.update(batch_outputs)
            ttft.update({r.request_id: first_token_s - wave_start for r in batch})
    elapsed = time.perf_counter() - start
    return HFResult(
        outputs=outputs, ttft_s=ttft, elapsed_s=elapsed, peak_rss_bytes=peak_rss_bytes(),
        peak_gpu_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        batch_size=job.batch_size, transformers_version=transformers.__version__,
    )


def _generate_batch(model: Any, batch: Sequence[HFRequest], stop_ids: Sequence[int], pad_id: int,
                    device: Any) -> tuple[dict[str, tuple[int, ...]], float]:
    """Greedy outputs of one left-padded batch, cut like the engine cuts them, and when its first token came."""
    import torch
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    class FirstTokenClock(StoppingCriteria):
        first_token_s: float | None = None

        def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    width = max(len(r.prompt_token_ids) for r in batch)
    # [batch, width]: prompts right-aligned so every sequence's next token is at the same position
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + list(r.prompt_token_ids) for r in batch],
                             device=device)
    attention_mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                                   for r in batch], device=device)
    ignore_eos = any(r.ignore_eos for r in batch)
    config = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in batch), do_sample=False, pad_token_id=pad_id,
        eos_token_id=[] if ignore_eos else list(stop_ids),  # [] stops nothing; None would mean the model's default
    )
    clock = FirstTokenClock()
    with torch.inference_mode():
        generated = model.generate(input_ids, attention_mask=attention_mask, generation_config=config,
                                   stopping_criteria=StoppingCriteriaList([clock]))
    new_tokens = generated[:, width:].tolist()  # [batch, generated]
    outputs = {r.request_id: _cut(ids, r, stop_ids) for r, ids in zip(batch, new_tokens)}
    return outputs, clock.first_token_s or time.perf_counter()


def _cut(token_ids: list[int], request: HFRequest, stop_ids: Sequence[int]) -> tuple[int, ...]:
    """The engine's output for the same tokens: at most max_tokens, ending at the first stop token."""
    token_ids = token_ids[: request.max_tokens]
    if not request.ignore_eos:
        for i, token_id in enumerate(token_ids):
            if token_id in stop_ids:
                return tuple(token_ids[: i + 1])
    return tuple(token_ids)


def _job_from_dict(data: dict[str, Any]) -> HFJob:
    requests = tuple(HFRequest(**{**r, "prompt_token_ids": tuple(r["prompt_token_ids"])}) for r in data["requests"])
    return HFJob(**{**data, "stop_token_ids": tuple(data["stop_token_ids"]), "requests": requests})


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    result = run_hf(_job_from_dict(json.loads(Path(job_path).read_text())))
    Path(result_path).write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
