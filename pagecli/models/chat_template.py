"""Chat templates rendered as transformers renders them (a sandboxed jinja2 with its globals and filters),
under a budget: a time limit, a limit on the rendered text, and on what the template builds on the way.

A template is code from a model folder: a loop of 100,000 inside a loop of 100,000, or a string repeated
10**11 times, must fail its one request, not hang the run or end it with MemoryError. A thread cannot be
stopped from outside, so the render checks its own budget: every loop iteration, every call (macros,
methods, globals), every filter and every `+`, `*`, `%`, `**` and `~` of the template goes through a check
here. Operations that could build something huge in one step (`"x" * n`, `center(n)`, a `%` or `format`
width, `replace`, `join`, `**`) are checked before they run, from their arguments; everything else is
measured after it returns, so no value ever grows past twice the output limit. Library code a template
calls runs on inputs within the limits, so it cannot run long on its own.

Invariant: a render either returns text of at most `output_chars` characters or raises TemplateLimitExceeded
(a RequestError) naming the limit, within about `time_s` of its start.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pagecli.errors import RequestError


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a chat template may spend."""

    time_s: float = 2.0  # wall time; a real conversation of thousands of turns renders in milliseconds
    output_chars: int = 16 << 20  # the rendered prompt, and any one string or list built on the way
    built_chars: int = 256 << 20  # every string and list the template builds, added up (bounds time and memory)
    loop_iterations: int = 10_000_000  # every iteration of every loop, added up


DEFAULT_LIMITS = TemplateLimits()
_MAX_INT_BITS = 1 << 16  # integers a template computes (`**`, `*`): far past any count or id
_TIME_CHECK_EVERY = 64  # ticks between two reads of the clock
# str methods that make a string from a width or a count: checked from their arguments before they run
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_WIDTH_FILTERS = frozenset({"center", "batch", "slice"})


class TemplateLimitExceeded(RequestError):
    """A chat template ran past its time, size or loop limit on this conversation."""


class RenderBudget:
    """The spending of one render; raises TemplateLimitExceeded as soon as a limit is passed."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.built_chars = 0
        self.iterations = 0
        self._ticks = 0

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks % _TIME_CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitExceeded(f"the chat template ran past its time limit ({self.limits.time_s:g} s) "
                                        "on this conversation")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.loop_iterations:
            raise TemplateLimitExceeded(f"the chat template ran more than {self.limits.loop_iterations:,} loop "
                                        "iterations on this conversation")
        self.tick()

    def charge(self, value: Any) -> Any:
        """value, once its size is within the limits (and counted toward what the render has built)."""
        self.tick()
        size = _deep_size(value, self.limits.output_chars)
        if size:
            self.refuse_size(size)
            self.built_chars += size
            if self.built_chars > self.limits.built_chars:
                raise TemplateLimitExceeded(f"the chat template built more than {self.limits.built_chars:,} "
                                            "characters of text and lists on this conversation")
        elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise TemplateLimitExceeded(f"the chat template computed an integer of more than {_MAX_INT_BITS:,} bits")
        return value

    def refuse_size(self, size: int) -> None:
        if size > self.limits.output_chars:
            raise TemplateLimitExceeded(f"the chat template built a value of {size:,} characters or items, past its "
                                        f"limit of {self.limits.output_chars:,}")


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, limits: TemplateLimits = DEFAULT_LIMITS) -> str:
    """The conversation as text through the tokenizer's chat template, rendered here under `limits` whether
    the tokenizer is pagecli's PlainTokenizer or transformers' (with the template and special tokens that
    transformers' own apply_chat_template would use). Raises as transformers does (jinja2.TemplateError,
    ValueError), and TemplateLimitExceeded."""
    if getattr(tokenizer, "renders_under_limits", False):  # pagecli's PlainTokenizer (tokenizer.py, above us)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools, limits=limits)
    if not hasattr(tokenizer, "get_chat_template"):  # a stand-in with a render of its own (tests)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}))
    if not messages:
        raise ValueError("Cannot apply a chat template to an empty conversation.")
    source = tokenizer.get_chat_template(None, tools)  # ValueError without one; picks a named template
    return render_conversation(source, messages, dict(tokenizer.special_tokens_map), tools=tools,
                               add_generation_prompt=add_generation_prompt, limits=limits)


def render_conversation(source: str, messages: list[dict[str, Any]], special_tokens: Mapping[str, Any],
                        tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
                        limits: TemplateLimits = DEFAULT_LIMITS) -> str:
    """Messages and tools handed to the template as transformers hands them, special tokens beside them."""
    tools = [plain_data(tool) for tool in tools] if tools else None  # transformers passes None for []
    return render_chat_template(source, limits, messages=[_template_message(m) for m in messages], tools=tools,
                                documents=None, add_generation_prompt=add_generation_prompt,
                                **plain_data(dict(special_tokens)))


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to the template: keys holding None dropped, plain data only,
    and the reasoning (under any of its names) also under `thinking` and `reasoning_content`."""
    message = {key: plain_data(value) for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


_current_budget: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("template_budget", default=None)


def _budget() -> RenderBudget:
    """The running render's budget; outside a render (jinja folding constants while it compiles a template)
    a fresh one, so the size checks hold there too."""
    return _current_budget.get() or RenderBudget(DEFAULT_LIMITS)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _deep_size(value: Any, cap: int) -> int:
    """Characters and items in value, each string and container counted as often as it is referred to (as
    text would repeat it), counted only until the total passes `cap`: `[s] * 1000` of a long string is big."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return 0
    total, pending = 0, [value]
    while pending and total <= cap:
        item = pending.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 1 + len(item)
            pending.extend(item)
        elif isinstance(item, dict):
            total += 1 + len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
    return total


def render_chat_template(source: str, limits: TemplateLimits = DEFAULT_LIMITS, **context: Any) -> str:
    """The template rendered with `context` (plain data), within `limits`; TemplateLimitExceeded past them.
    jinja2's own errors (a template's raise_exception(), a syntax error) pass through as they are."""
    budget = RenderBudget(limits)
    token = _current_budget.set(budget)
    try:
        template = _compiled_template(source)
        pieces: list[str] = []
        length = 0
        for piece in template.generate(**context):
            length += len(piece)
            budget.refuse_size(length)
            budget.tick()
            pieces.append(piece)
        return "".join(pieces)
    except MemoryError:  # an allocation the checks did not foresee; the render's own values are freed now
        raise TemplateLimitExceeded("the chat template ran out of memory on this conversation") from None
    finally:
        _current_budget.reset(token)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    return _template_environment().from_string(source)


# --- the checks, as the environment calls them -----------------------------------------------------------


def _checked_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before it runs, an operator whose result would pass the limits."""
    budget = _budget()
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if _size(seq) and isinstance(count, int):
                budget.refuse_size(_deep_size(seq, budget.limits.output_chars) * max(count, 0))
        if isinstance(left, int) and isinstance(right, int):
            _refuse_int_bits(left.bit_length() + right.bit_length())
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _refuse_int_bits(max(left.bit_length() - 1, 1) * right)
    elif operator == "%" and isinstance(left, str):
        _refuse_printf_widths(left, right, budget)


def _refuse_int_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise TemplateLimitExceeded(f"the chat template computed an integer of more than {_MAX_INT_BITS:,} bits")


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\d+|\*)?(?:\.(\d+|\*))?")


def _refuse_printf_widths(form: str, args: Any, budget: RenderBudget) -> None:
    """A `%` format's widths and precisions (written in it, or taken from the arguments by `*`)."""
    for match in _PRINTF_FIELD.finditer(form):
        for number in match.groups():
            if number and number.isdigit():
                budget.refuse_size(int(number))
            elif number == "*":
                for arg in args if isinstance(args, tuple) else (args,):
                    if isinstance(arg, int):
                        budget.refuse_size(abs(arg))


def _refuse_format_widths(form: Any, args: Iterable[Any], budget: RenderBudget) -> None:
    """str.format's widths: the digits in each field's spec, and any int argument (a nested `{}` width)."""
    if isinstance(form, str):
        try:
            specs = [spec for _, _, spec, _ in string.Formatter().parse(form) if spec]
        except ValueError:
            return  # str.format raises the same error itself
        for spec in specs:
            for digits in re.findall(r"\d+", spec):
                budget.refuse_size(int(digits))
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool):
            budget.refuse_size(abs(arg))


def _predicted_call(name: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    is_filter: bool = False) -> None:
    """Refuse a str method or a filter that would build something past the limits, from its arguments."""
    budget = _budget()
    if is_filter and name == "format" and isinstance(target, str):
        _refuse_printf_widths(target, tuple(args) or tuple(kwargs.values()), budget)
        return
    if is_filter and name == "indent" and isinstance(target, str):
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        budget.refuse_size(len(target) + (target.count("\n") + 1) * max(width, 0))
        return
    if is_filter and name == "tojson":
        indent = args[1] if len(args) > 1 else kwargs.get("indent")
        if isinstance(indent, int) and indent > 0:
            budget.refuse_size(_deep_size(target, budget.limits.output_chars) * (1 + indent))
        return
    if name in (_WIDTH_FILTERS if is_filter else _WIDTH_METHODS):
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                budget.refuse_size(abs(arg) * (8 if name == "expandtabs" else 1))
        if name == "expandtabs" and isinstance(target, str) and args and isinstance(args[0], int):
            budget.refuse_size(target.count("\t") * max(args[0], 0))
    if name in ("format", "format_map") and not is_filter:
        _refuse_format_widths(target, (*args, *kwargs.values()), budget)
    if name == "replace" and isinstance(target, str) and len(args) >= 2 and isinstance(args[0], str):
        old, new = args[0], args[1]
        if isinstance(new, str):
            count = target.count(old) if old else len(target) + 1
            budget.refuse_size(len(target) + count * max(len(new) - len(old), 0))
    if name == "join":
        items, separator = (args[0] if args else (), target) if isinstance(target, str) else (target, args[0] if args else "")
        if isinstance(items, (list, tuple)):
            sep = len(separator) if isinstance(separator, str) else 0
            budget.refuse_size(sum(_deep_size(item, budget.limits.output_chars) for item in items) + sep * len(items))


def _budgeted_filter(name: str, function: Any) -> Any:
    passes_jinja_object = getattr(function, "jinja_pass_arg", None) is not None  # context or environment first

    @functools.wraps(function)  # keeps jinja's pass_context/pass_environment mark
    def checked(*args: Any, **kwargs: Any) -> Any:
        plain = args[1:] if passes_jinja_object else args
        target, rest = (plain[0], tuple(plain[1:])) if plain else (None, ())
        _predicted_call(name, target, rest, kwargs, is_filter=True)
        return _budget().charge(function(*args, **kwargs))

    return checked


def _loop_budget(iterable: Any) -> Iterator[Any]:
    """A for loop's items, each counted (the AST hook wraps every loop's iterable in this filter)."""
    budget = _budget()
    for item in iterable:
        budget.iterate()
        yield item


def _charge_concat(value: Any) -> Any:
    return _budget().charge(value)


# --- the environment ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _template_environment() -> Any:
    """The jinja2 environment transformers renders chat templates in (sandboxed, trim_blocks and lstrip_blocks,
    loop controls, the {% generation %} tag, its tojson, raise_exception, strftime_now, dict and namespace),
    with every operation a template can repeat or grow checked against the render's budget. jinja2 is
    imported here, on the first chat prompt."""
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class BudgetHooks(NodeTransformer):
        """Every loop's iterable and every `~` through a budget filter, before the code is generated."""

        def visit_For(self, node: Any) -> Any:
            self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, "pagecli_loop_budget", [], [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            return nodes.Filter(node, "pagecli_charge", [], [], None, None, lineno=node.lineno)

    class BudgetedCodeGenerator(CodeGenerator):
        def visit_Template(self, node: Any, frame: Any = None) -> None:
            super().visit_Template(BudgetHooks().visit(node), frame)

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator != "+":  # a sum is at most twice its larger operand, which was checked when it was made
                _checked_binop(operator, left, right)
            return _budget().charge(self.binop_table[operator](left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            target = getattr(method, "__self__", None)
            if isinstance(target, (str, list, tuple)):
                _predicted_call(getattr(method, "__name__", ""), target, args, kwargs)
            _budget().tick()
            return _budget().charge(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs))

    class GenerationTag(Extension):
        """{% generation %}...{% endgeneration %} marks the assistant's text for training masks;
        rendering shows its body, in a scope of its own as transformers' call block does."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        """namespace() without underscore attributes, which could reach Python internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
            self, *rest = args
            for name in dict(*rest, **kwargs):
                _refuse_private(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            _refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, _budget().charge(value))

    def _refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateDict:
        """dict() and dict.fromkeys() without the dict type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Not jinja's own filter, which escapes HTML characters.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(date_format: str) -> str:
        return datetime.now().strftime(date_format)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _budgeted_filter(name, function) for name, function in env.filters.items()}
    env.filters["pagecli_loop_budget"] = _loop_budget
    env.filters["pagecli_charge"] = _charge_concat
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


def plain_data(value: Any) -> Any:
    """JSON-like data rebuilt from plain types, so the template reaches no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) reduced to their value, their methods left behind
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    return f"<{type(value).__name__}>"
