"""Constrained decoding: a request's StructuredSpec compiled to a grammar, one matcher per sequence, and the
token masks the sampler applies.

The grammar engine is xgrammar, the faster of the two measured here (both from PyPI, CPU; SmolLM2's
49,152-token vocabulary, small JSON schemas, one thread): xgrammar fills a sequence's token mask in about
2 µs and compiles a new schema in 1-30 ms; llguidance took 15-20 µs per mask, and 1.5-15 s for the first
mask of a process. llguidance names the schema keywords it cannot enforce; xgrammar accepts them and does
not enforce them, so pagecli refuses those by name itself (engine/schema_keywords.py). xgrammar is imported
only when a request has a grammar: requests without one never load it and pay nothing.

Invariant: a sequence's matcher has accepted exactly its output tokens. Tokens are fed to it only when
sampled (Engine._on_token), never when a preempted sequence's tokens are computed again, so preemption
and resume keep its state; a forked candidate starts from a fresh matcher fed the parent's output.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from pagecli.config.structured import StructuredSpec
from pagecli.engine.grammar_limits import compile_bounded, refuse_oversized, regex_problem
from pagecli.engine.schema_keywords import refuse_unenforced_keywords, schema_regexes
from pagecli.errors import RequestError

_COMPILED_CACHE_SIZE = 64  # distinct specs kept compiled per engine (a server sees a few schemas, repeatedly)
# Whitespace characters allowed between two JSON tokens (a newline and indentation up to depth ~9): a small
# model that loops on spaces or newlines inside a JSON value then has to go on with the value instead.
_MAX_JSON_WHITESPACE = 20
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # logits' bits as integers, by itemsize
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit i of each int32 word of xgrammar's bitmask: token 32w + i


class GrammarState:
    """One sequence's position in its grammar (an xgrammar GrammarMatcher)."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self.compiled = compiled
        self.vocab_size = vocab_size
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self._next_mask: torch.Tensor | None = None  # [1, ceil(vocab / 32)] int32, for forced_token

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar forbids it (the mask makes that a bug)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return bool(self.matcher.is_terminated())

    def fork(self, output_token_ids: list[int]) -> GrammarState:
        """A matcher at the same position, for a forked candidate (it owns its own state from here)."""
        state = GrammarState(self.compiled, self.vocab_size)
        for token_id in output_token_ids:
            state.accept(token_id)
        return state

    def forced_token(self) -> int | None:
        """The next token when the grammar allows that one alone (a key's quotes, a `": "` after it, the only
        stop token at the end), else None. Such a token is appended without a model step: sampling could
        pick nothing else, so the output is the same."""
        if self.matcher.is_terminated():
            return None
        if self._next_mask is None:
            import xgrammar

            self._next_mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(self._next_mask)
        words = self._next_mask[0].nonzero()
        if len(words) != 1:
            return None
        word = int(words[0])
        bits = int(self._next_mask[0, word]) & 0xFFFFFFFF
        if bits & (bits - 1):
            return None  # two or more bits in the one word
        return word * 32 + bits.bit_length() - 1


class GrammarCompiler:
    """Compiles StructuredSpecs for one tokenizer, once each (a small LRU cache keyed by spec)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import xgrammar

        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's length
        info = xgrammar.TokenizerInfo.from_huggingface(
            _huggingface_tokenizer(tokenizer), vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()

    def new_state(self, spec: StructuredSpec) -> GrammarState:
        """A fresh matcher for spec; an invalid or unenforceable spec raises RequestError."""
        return GrammarState(self.compile(spec), self.vocab_size)

    def compile(self, spec: StructuredSpec) -> Any:
        compiled = self._cache.get(spec)
        if compiled is None:
            compiled = self._compile_uncached(spec)
            self._refuse_empty(spec, compiled)
            self._cache[spec] = compiled
            if len(self._cache) > _COMPILED_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return compiled

    def _refuse_empty(self, spec: StructuredSpec, compiled: Any) -> None:
        """A grammar that allows no first token (a schema that is only a $ref to itself, or a $defs loop with no
        end) would leave its request nothing to sample: refused before the request runs."""
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        if not bool(mask.any()):
            raise RequestError(f"the {spec.kind} constraint admits no output at all (a $ref that only refers to itself, "
                               "or a loop of $defs with no end?)")

    def _compile_uncached(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of spec, within the limits of engine/grammar_limits.py."""
        try:
            if spec.kind == "json_schema":
                return self._compile_schema(spec.value)  # type: ignore[arg-type]
            if spec.kind == "json_object":
                return compile_bounded(spec.kind, lambda: self._compiler.compile_json_schema(
                    _ANY_OBJECT_SCHEMA, strict_mode=False, max_whitespace_cnt=_MAX_JSON_WHITESPACE))
            if spec.kind == "regex":
                _refuse_regex_problem(spec.value)  # type: ignore[arg-type]
                refuse_oversized(spec.kind, spec.value, [spec.value])  # type: ignore[list-item]
                return compile_bounded(spec.kind, lambda: self._compiler.compile_regex(spec.value))
            if spec.kind == "choice":
                ebnf = _choice_ebnf(spec.value)  # type: ignore[arg-type]
                refuse_oversized(spec.kind, ebnf, [])
                return compile_bounded(spec.kind, lambda: self._compiler.compile_grammar(ebnf))
            refuse_oversized(spec.kind, spec.value, [spec.value])  # type: ignore[list-item]
            if spec.kind == "ebnf":
                return compile_bounded(spec.kind, lambda: self._compiler.compile_grammar(spec.value))
            return compile_bounded(spec.kind, lambda: self._compiler.compile_structural_tag(spec.value))
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for bad input
            raise RequestError(f"the {spec.kind} constraint cannot be compiled: {_first_line(exc)}") from None

    def _compile_schema(self, schema_text: str) -> Any:
        """Strict first (no properties or items the schema does not name: what a small model should not
        invent), then as JSON Schema says where strict cannot hold (minItems with no `items`)."""
        schema = json.loads(schema_text)
        refuse_unenforced_keywords(schema)
        refuse_oversized("json_schema", schema_text, schema_regexes(schema))

        def strict_then_lenient() -> Any:
            try:
                return self._compiler.compile_json_schema(schema_text, strict_mode=True,
                                                          max_whitespace_cnt=_MAX_JSON_WHITESPACE)
            except Exception:  # noqa: BLE001 - retried; a schema wrong both ways reports the lenient error
                return self._compiler.compile_json_schema(schema_text, strict_mode=False,
                                                          max_whitespace_cnt=_MAX_JSON_WHITESPACE)

        return compile_bounded("json_schema", strict_then_lenient)


def _refuse_regex_problem(regex: str) -> None:
    problem = regex_problem(regex)
    if problem is not None:
        raise RequestError(f"the regex constraint uses {problem}, which constrained decoding cannot enforce; "
                           "remove it or check it after generation")


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState],
                        greedy_choices: list[int | None] | None = None) -> list[int]:
    """Set, in place, the logits each row's grammar forbids to -inf, and return the rows it masked.
    logits: [num_seqs, vocab], on the CPU.

    greedy_choices[i], where given, is the unmasked argmax of rows[i] for a row that decodes greedily: when its
    grammar allows that token, the row is left as it is (the masked argmax would be the same token, the first
    of the row's equal maxima), so a greedy batch pays the mask only on the steps where the model strays from
    the grammar. Checking one bit per row is ~1 µs; masking 64 rows of 49,152 logits is ~4 ms.

    The mask works on the logits' bits: for 64 rows of 49,152 bfloat16 logits, masked_fill with a boolean mask
    took about 12 ms of CPU time, these integer operations about 4 ms (a 64-sequence decode step: ~85 ms).
    """
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(states), vocab)  # [rows, ceil(vocab / 32)] int32, bit set: allowed
    for i, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, i)
    need = list(range(len(rows)))
    if greedy_choices is not None:
        words = bitmask.numpy()
        need = [i for i in need if greedy_choices[i] is None or not _allowed(words[i], greedy_choices[i])]
        if len(need) < len(rows):
            bitmask = bitmask[need]
    masked = [rows[i] for i in need]
    if masked:
        _mask_rows(logits, masked, bitmask)
    return masked


def _allowed(words: Any, token: int) -> bool:
    """Bit `token` of one row of xgrammar's bitmask (a numpy int32 array)."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits[rows[i]] where bit i of bitmask's row i is clear becomes -inf (bitmask: [len(rows), words])."""
    vocab = logits.shape[-1]
    as_int = _SAME_WIDTH_INT[logits.element_size()]
    # -1 (every bit set) where allowed, 0 where not: [rows, vocab]
    keep = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).flatten(1)[:, :vocab].to(as_int).neg_()
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(as_int)
    with torch.inference_mode():  # the model's logits are an inference tensor: written in place only here
        if len(rows) == logits.shape[0]:
            bits = logits.view(as_int)
            bits &= keep
            bits |= minus_inf & ~keep
            return
        index = torch.tensor(rows, dtype=torch.long)
        bits = logits[index].view(as_int)
        logits[index] = ((bits & keep) | (minus_inf & ~keep)).view(logits.dtype)


def _choice_ebnf(options: tuple[str, ...]) -> str:
    """root ::= "a" | "b" ... with each option as a JSON string literal (the EBNF accepts its escapes)."""
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)


def _huggingface_tokenizer(tokenizer: Any) -> Any:
    """xgrammar reads a transformers tokenizer; pagecli's PlainTokenizer wraps the same tokenizers object."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer.special_tokens)


def _first_line(exc: BaseException) -> str:
    """xgrammar's messages start with '[time] /path/file.cc:line: ': keep what follows."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
