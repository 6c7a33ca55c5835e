"""A draft model for speculative decoding (--speculate draft): a mirror of each drafting sequence in the draft's
own KV cache, kept in step with the main sequence, and the draft's greedy tokens proposed from it.

The draft model is loaded by an Engine of its own (resolving the path, its weight plan, dtype and kernels as for
any model; a one-block pool it never uses) that is never stepped: this module drives its model runner and greedy
choice directly, on a pool of its own with the main pool's block count (a mirror holds its sequence's tokens and a
few drafts, so the mirrors fit where their sequences do), its bytes taken out of the same KV budget
(Engine._num_blocks). Greedy drafts are one token for sure, so the checking rule (engine/speculation.py) stays
exact for greedy and sampled requests alike.

Invariants: a mirror's first `num_computed_tokens` tokens are in the draft's KV cache, and after `propose` syncs it
those equal its sequence's tokens (rejected drafts are rewound, the blocks past them given back); a mirror exists
only while its sequence runs (`forget_gone` after every step and abort), so a finished, aborted or preempted
sequence holds no draft block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagecli.config.settings import EngineConfig, SamplingParams
from pagecli.engine.block_pool import BlockPool
from pagecli.engine.draft_budget import DECAY
from pagecli.engine.hashing import root_hash
from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.model_runner import ModelRunner
from pagecli.engine.sampler import sample
from pagecli.engine.scheduler import ScheduledSeq
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.errors import PagecliError

# Texts both tokenizers must encode alike (besides the same vocabulary): prose, code, accents and CJK, markup.
TOKENIZER_PROBES = ("Hello, world! How are you today?", "def f(x):\n    return x + 1\n", " naïve café 日本語",
                    "<|im_start|>user\nhi<|im_end|>\n")
# Proposals whose catch-up chunk is at most this many tokens time the draft's step (a longer one, after plain
# steps or for the prompt, is a prefill chunk, not what a draft costs).
TIMED_CATCH_UP_TOKENS = 2


def draft_config(main: EngineConfig) -> EngineConfig:
    """The draft model's engine settings: the main engine's device, attention, block size and batch limits, its
    own dtype and --draft-quantize, no speculation, prefix caching or disk store, a one-block pool (unused)."""
    return EngineConfig(block_size=main.block_size, num_blocks=1, max_num_seqs=main.max_num_seqs,
                        max_num_batched_tokens=main.max_num_batched_tokens, device=main.device,
                        attention=main.attention, enable_prefix_caching=False, disk_cache=False,
                        quantize=main.draft_quantize, speculate="off")


@dataclass(eq=False)
class _Mirror:
    seq: Sequence  # in the draft's pool: its tokens, block table and computed count
    known: int  # its leading tokens given by the main sequence at the last sync (equal to the main's for good)


class DraftModel:
    def __init__(self, engine: Any, main_vocab_size: int) -> None:
        self.engine = engine  # the draft's own Engine: its loaded model, backend, kernels and KV format
        self.name = engine.model_name
        self.main_vocab_size = main_vocab_size  # a draft past it (a larger, padded vocabulary) ends a proposal
        self.kv_bytes_per_block = engine.kv_bytes_per_block
        self.context_len = engine._model_context_len()
        self.chunk_tokens = engine.config.max_num_batched_tokens
        self.greedy = SamplingParams(temperature=0)
        self.mirrors: dict[Sequence, _Mirror] = {}  # main sequence -> its mirror
        self.seconds_per_draft: float | None = None  # decayed time of a draft step (TIMED_CATCH_UP_TOKENS)
        self.pool: BlockPool | None = None
        self.kv: KVCacheManager | None = None
        self.runner: ModelRunner | None = None

    def check_tokenizer(self, tokenizer: Any, main_name: str) -> None:
        """PagecliError unless the draft's tokenizer is the main model's: the same vocabulary, the same ids for
        TOKENIZER_PROBES."""
        draft = self.engine.tokenizer
        same = tokenizer.get_vocab() == draft.get_vocab() and all(
            list(tokenizer(text)["input_ids"]) == list(draft(text)["input_ids"]) for text in TOKENIZER_PROBES)
        if not same:
            raise PagecliError(f"The draft model '{self.name}' does not have the tokenizer of the main model "
                               f"'{main_name}', so its tokens mean other text: give --draft-model a model of the "
                               "same family (the same tokenizer), or use --speculate ngram.")

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The draft's pool and its KV tensor, num_blocks blocks like the main pool."""
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        self.kv = KVCacheManager(self.pool, root_hash(self.engine.fingerprint))
        self.runner = ModelRunner(self.engine.loaded, self.engine.backend, num_blocks, block_size,
                                  self.engine.kv_format)

    def propose(self, seq: Sequence, count: int) -> list[int]:
        """Up to `count` greedy draft tokens to follow seq's tokens: the mirror synced, the tokens it lacks computed
        (in chunks), then one draft step per further draft. Fewer where the draft's context or pool runs out."""
        if seq.num_tokens + count > self.context_len:
            return []
        started = time.perf_counter()
        mirror = self._synced(seq)
        catch_up = mirror.num_uncomputed_tokens
        drafts: list[int] = []
        token = self._next_token(mirror)
        while token is not None and token < self.main_vocab_size:
            drafts.append(token)
            mirror.token_ids.append(token)
            if len(drafts) == count:
                break
            token = self._next_token(mirror)
        if token is None:  # the draft's pool is short: this mirror gives way
            self.forget(seq)
        elif drafts and catch_up <= TIMED_CATCH_UP_TOKENS:
            seconds = (time.perf_counter() - started) / len(drafts)
            old = self.seconds_per_draft
            self.seconds_per_draft = seconds if old is None else DECAY * old + (1 - DECAY) * seconds
        return drafts

    def _synced(self, seq: Sequence) -> Sequence:
        """seq's mirror with seq's tokens, its computed tokens cut back to those still equal to seq's (drafts the
        main model rejected are rewound) and the blocks past them given back."""
        mirror = self.mirrors.get(seq)
        if mirror is None:
            mirror = self.mirrors[seq] = _Mirror(Sequence(seq.request_id, list(seq.token_ids), self.greedy,
                                                          self.context_len), seq.num_tokens)
            return mirror.seq
        own = mirror.seq
        limit = min(own.num_computed_tokens, seq.num_tokens - 1)  # the last token is computed again for its logits
        # (also when seq gained no token since the last sync: its drafts were cut by the token budget, say)
        agree = min(mirror.known, limit)
        while agree < limit and own.token_ids[agree] == seq.token_ids[agree]:
            agree += 1
        own.num_computed_tokens = agree
        del own.token_ids[agree:]
        own.token_ids.extend(seq.token_ids[agree:])
        mirror.known = seq.num_tokens
        keep = self.kv.blocks_for_tokens(agree)
        while len(own.block_table) > keep:
            self.kv.release_last_block(own)
        return own

    def _next_token(self, mirror: Sequence) -> int | None:
        """Compute the mirror's uncomputed tokens (chunks of at most max_num_batched_tokens) and return the greedy
        token after them; None where the pool cannot hold them."""
        logits = choices = None
        while mirror.num_uncomputed_tokens:
            num_new = min(mirror.num_uncomputed_tokens, self.chunk_tokens)
            if not self.kv.allocate_slots(mirror, num_new):
                return None
            # [1 on the last chunk, vocab], and its greedy choice where the output layer takes it
            logits, choices = self.runner.execute([ScheduledSeq(mirror, num_new)], greedy=True)
            mirror.num_computed_tokens += num_new
        return sample(logits, [mirror], self.engine._sampling_ops, choices)[0]

    def forget(self, seq: Sequence) -> None:
        """Free seq's mirror, if it has one."""
        mirror = self.mirrors.pop(seq, None)
        if mirror is not None:
            self.kv.free(mirror.seq)

    def forget_gone(self) -> None:
        """Free the mirrors of sequences no longer running (finished, aborted or preempted)."""
        for seq in [s for s in self.mirrors if s.status is not SequenceStatus.RUNNING]:
            self.forget(seq)
