"""Prompt lookup replayed without the model (issue 50): how many tokens a unit of step cost buys with each proposer.

    .venv/bin/python scripts/replay_lookup.py [--outputs FILE] [--row-cost 0.21] [--pass-cost 0.12] [--k 8]

The editing set's greedy outputs (scripts/data/edit_set.jsonl, the embedded model at its defaults, generated once
with speculation off and kept in --outputs, default /tmp/pagecli_edit_outputs.json) are replayed step by step
through the engine's draft budget (engine/draft_budget.py) with each proposer: at each step the budget picks a
draft count from the sequence's acceptance so far, the proposer's drafts are compared with the output's next
tokens, and a pass costs 1 + c + r d plain steps (r, c: --row-cost, --pass-cost, what the engine times on the
CPU at hand). Prints tokens per unit of cost, checking passes and acceptance per proposer: `latest` (the lookup
alone: the latest earlier occurrence of the newest 3, 2 or 1 tokens) and `cursor` (engine/ngram_proposer.py's
NgramIndex, which goes on from where its last proposal was copied while the output follows it). A model of the
decode rate, not a measurement of it: scripts/bench_speculation.py measures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_speculation import edit_prompts  # scripts/ is on the path when a script there runs
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.engine.draft_budget import DraftBudget
from pagecli.engine.ngram_proposer import NgramIndex
from pagecli.engine.speculation import lookup_drafts


class LatestOnly(NgramIndex):
    """The lookup without the copy cursor (the proposer before it)."""

    __slots__ = ()

    def _followed(self, token_ids) -> int:
        return -1


def greedy_outputs(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, outputs) of the editing set, generated once and kept in `path`."""
    if path.is_file():
        kept = json.loads(path.read_text())
        return kept["prompts"], kept["outputs"]
    torch.set_num_threads(2)
    engine = Engine(None, EngineConfig(disk_cache=False, speculate="off", threads=2).for_one_stream())
    prompts = edit_prompts(engine.tokenizer)
    print(f"generating the set's greedy outputs once (kept in {path}) ...", flush=True)
    outputs = [list(done.token_ids) for done in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=256))]
    path.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    return prompts, outputs


def replay(proposer_class, prompts, outputs, row_cost: float, pass_cost: float, k: int) -> tuple[float, int, float]:
    """(tokens per unit of step cost, checking passes, share of drafts accepted) over the set."""
    cost = tokens = passes = drafted = accepted_total = 0
    for prompt, output in zip(prompts, outputs):
        proposer, budget = proposer_class(3), DraftBudget()
        seq = list(prompt) + output[:1]
        t = 1
        while t < len(output):  # as Speculator.add_drafts and verify do, with the output as the model's choices
            drafts = lookup_drafts(budget, proposer, seq, min(k, len(output) - t - 1), row_cost, pass_cost)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[t + accepted]:
                accepted += 1
            if drafts:
                budget.after_pass(accepted, len(drafts))
                passes, drafted, accepted_total = passes + 1, drafted + len(drafts), accepted_total + accepted
                cost += 1 + pass_cost + row_cost * len(drafts)
            else:
                cost += 1
            seq.extend(output[t : t + accepted + 1])
            t += accepted + 1
            tokens += accepted + 1
    return tokens / cost, passes, accepted_total / max(drafted, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, default=Path("/tmp/pagecli_edit_outputs.json"))
    ap.add_argument("--row-cost", type=float, default=0.21, help="r: a row's cost as a share of a plain step")
    ap.add_argument("--pass-cost", type=float, default=0.12, help="c: a checking pass's cost beyond its rows")
    ap.add_argument("--k", type=int, default=8, help="the most drafts a pass checks")
    args = ap.parse_args()
    prompts, outputs = greedy_outputs(args.outputs)
    print(f"{len(outputs)} editing requests, {sum(map(len, outputs)) - len(outputs)} tokens after the first; "
          f"r = {args.row_cost}, c = {args.pass_cost}, K = {args.k}")
    for name, proposer in (("latest", LatestOnly), ("cursor", NgramIndex)):
        per_cost, passes, acceptance = replay(proposer, prompts, outputs, args.row_cost, args.pass_cost, args.k)
        print(f"{name:7} {per_cost:.3f} tokens per unit of step cost, {passes} checking passes, "
              f"{acceptance:.0%} of drafts accepted")


if __name__ == "__main__":
    main()
