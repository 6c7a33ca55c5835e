"""KL divergence of a run's next-token distributions from a base run's, over the same text and windows
as `bench perplexity` (`--kl-base PATH`), as llama-perplexity's --kl-divergence weighs a quantization.

Perplexity over a short text moves by a percent or two with any rounding change (on the shipped
765-token text, int8 weights scored 2% *below* bf16); the divergence from a reference model's
distributions at the same positions is the steadier measure. The first run with a given PATH writes
the base: per scored position the base's TOP_K most likely tokens and their log-probabilities,
plus the text's tokens (hashed) and ctx. A later run with the same PATH (another --quantize, --dtype
or --kv-dtype) compares, per position, KL(base || run) over those TOP_K tokens with the rest of the
vocabulary as one bucket: a lower bound of the full divergence that misses only how the base's
tail beyond TOP_K tokens is spread (on SmolLM2-135M over the shipped text, 93-94% of the full
figure: 0.00185 against 0.00197 for bf16, 0.01552 against 0.01665 for int8 on VNNI; with the top 64,
85%), and whether the most likely token is the same. The base file holds 2 KB per position.

The base also keeps each position's loss (the negative log-likelihood of the text's next token), so
the perplexity change is given with the standard error of the mean per-position difference: two runs
over the same tokens differ far less than either figure's own standard error says (a base written
before this has no losses, and the change is then given without it).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pagecli.errors import PagecliError

TOP_K = 256
FORMAT = "pagecli-kl-base-1"


def tokens_digest(windows: list[list[int]]) -> str:
    return hashlib.sha256(torch.tensor([t for w in windows for t in w], dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class BaseDistributions:
    """What a base run keeps of each scored position: [n, TOP_K] token ids and log-probabilities."""
    ctx: int
    digest: str
    description: str
    ppl: float
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    nll: torch.Tensor | None = None  # [n] float64: each position's loss; None in older files

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temp file of our own (O_EXCL, a name no user file has), renamed over the path only when whole:
        # a crash leaves no half-written base behind, and a user's PATH.partial is never written.
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".pagecli-tmp")
        os.close(fd)
        temp = Path(temp_name)
        try:
            torch.save({"format": FORMAT, "ctx": self.ctx, "digest": self.digest, "description": self.description,
                        "ppl": self.ppl, "top_ids": self.top_ids, "top_logp": self.top_logp, "nll": self.nll}, temp)
            temp.replace(path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> BaseDistributions:
        try:
            data = torch.load(path, weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is the same user mistake
            raise PagecliError(f"Cannot read '{path}' as a --kl-base file ({error}).") from error
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PagecliError(f"'{path}' is not a --kl-base file written by this version of pagecli.")
        return cls(data["ctx"], data["digest"], data["description"], data["ppl"], data["top_ids"], data["top_logp"],
                   data.get("nll"))


def position_losses(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n] float64: -log p(next token) at each scored position (log-probabilities [n, vocab])."""
    return -logp.gather(1, targets[:, None].long()).squeeze(1).double()


class Recorder:
    """Collects the base's top tokens window by window (perplexity's on_logprobs)."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []
        self.logp: list[torch.Tensor] = []
        self.nll: list[torch.Tensor] = []

    def __call__(self, logp: torch.Tensor, targets: torch.Tensor) -> None:
        top = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1)
        self.ids.append(top.indices.to(torch.int32))
        self.logp.append(top.values)
        self.nll.append(position_losses(logp, targets))

    def base(self, ctx: int, digest: str, description: str, ppl: float) -> BaseDistributions:
        return BaseDistributions(ctx, digest, description, ppl, torch.cat(self.ids), torch.cat(self.logp),
                                 torch.cat(self.nll))


@dataclass(frozen=True)
class Divergence:
    mean: float
    p99: float  # the 99th percentile over positions
    same_top: float  # share of positions whose most likely token is the base's
    positions: int
    # exp(mean per-position loss difference) - 1: the run's perplexity against the base's, and the standard
    # error of that figure (None where the base file has no losses)
    ppl_change: float | None = None
    ppl_change_stderr: float | None = None


class Comparer:
    """Compares a run's windows with the base's, position by position (perplexity's on_logprobs)."""

    def __init__(self, base: BaseDistributions) -> None:
        self.base = base
        self.done = 0
        self.kl: list[torch.Tensor] = []
        self.same: list[torch.Tensor] = []
        self.loss_delta: list[torch.Tensor] = []

    def __call__(self, logp: torch.Tensor, targets: torch.Tensor) -> None:
        n = logp.shape[0]
        ids = self.base.top_ids[self.done:self.done + n].long()  # [n, K]
        base_logp = self.base.top_logp[self.done:self.done + n].double()  # [n, K]
        if ids.shape[0] != n:
            raise PagecliError("This run scores more positions than the --kl-base file holds.")
        if int(ids.max()) >= logp.shape[1]:
            raise PagecliError(f"The --kl-base file names tokens past this model's vocabulary ({logp.shape[1]}); "
                               "compare runs of the same model.")
        run_logp = logp.double().gather(1, ids)  # [n, K]
        base_p = base_logp.exp()
        kl = (base_p * (base_logp - run_logp)).sum(dim=1)
        base_tail = (1 - base_p.sum(dim=1)).clamp_min(0)
        run_tail = (1 - run_logp.exp().sum(dim=1)).clamp_min(1e-300)
        kl = kl + torch.where(base_tail > 0, base_tail * (base_tail.clamp_min(1e-300).log() - run_tail.log()),
                              torch.zeros_like(kl))
        self.kl.append(kl.clamp_min(0))  # rounding can make a near-zero figure slightly negative
        self.same.append(logp.argmax(dim=1) == ids[:, 0])
        if self.base.nll is not None:
            self.loss_delta.append(position_losses(logp, targets) - self.base.nll[self.done:self.done + n])
        self.done += n

    def result(self) -> Divergence:
        if self.done != self.base.top_ids.shape[0]:
            raise PagecliError(f"This run scored {self.done} positions, the --kl-base file {self.base.top_ids.shape[0]}.")
        kl = torch.cat(self.kl)
        change = stderr = None
        if self.loss_delta and self.done > 1:
            delta = torch.cat(self.loss_delta)
            change = math.exp(float(delta.mean()))
            stderr = change * float(delta.std()) / math.sqrt(self.done)
            change -= 1
        return Divergence(float(kl.mean()), float(kl.quantile(0.99)), float(torch.cat(self.same).double().mean()),
                          self.done, change, stderr)


def check_compatible(base: BaseDistributions, path: Path, ctx: int, digest: str) -> None:
    """A base scored at another --ctx, or over another text or tokenizer, cannot be compared with."""
    if base.ctx != ctx:
        raise PagecliError(f"'{path}' was written with --ctx {base.ctx}; run with --ctx {base.ctx} to compare.")
    if base.digest != digest:
        raise PagecliError(f"'{path}' was written for another text or another tokenizer's tokens; "
                           "compare runs of the same file and model family.")


def describe(result: Divergence, base: BaseDistributions, ppl: float) -> str:
    change = f"{100 * (ppl / base.ppl - 1):+.2f}%"
    if result.ppl_change_stderr is not None:
        change += f" +/- {100 * result.ppl_change_stderr:.2f}%"
    return (f"KL divergence from the base ({base.description}): mean {result.mean:.4g}, 99th percentile "
            f"{result.p99:.4g}; same top token at {100 * result.same_top:.1f}% of {result.positions} positions; "
            f"perplexity {ppl:.4f} against the base's {base.ppl:.4f} ({change})")

