"""Chat templates render under a time limit and size limits: a template that loops for hours or builds a string
of gigabytes fails its one conversation with a sentence, never hangs the run or ends it with MemoryError."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from chat_helpers import cli_args, run_cli
from tiny_models import CHATML

from pagecli.cli import main
from pagecli.errors import RequestError
from pagecli.models.chat_template import (
    TemplateLimitExceeded,
    TemplateLimits,
    apply_chat_template,
    render_chat_template,
)
from pagecli.models.loader import load_tokenizer

QUICK = TemplateLimits(time_s=0.3, output_chars=1 << 20, built_chars=8 << 20, loop_iterations=10_000_000)
HELLO = [{"role": "user", "content": "hello"}]


def render(source: str, limits: TemplateLimits = QUICK) -> str:
    return render_chat_template(source, limits, messages=HELLO)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}text{% endfor %}{% endfor %}{% endset %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
])
def test_a_template_that_runs_forever_stops_at_its_time_limit(source):
    start = time.monotonic()
    with pytest.raises(TemplateLimitExceeded, match=r"time limit \(0.3 s\)"):
        render(source)
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("source", [
    '{{ "x" * 100000000000 }}', '{{ "x" * 10 ** 10 }}', '{{ ["x" * 1000] * 10 ** 9 }}',
    '{% set ns = namespace(s="x") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}',
    '{% set ns = namespace(s="x") %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}',
    '{{ "x"|center(10 ** 10) }}', '{{ "x".center(10 ** 10) }}', '{{ "x".ljust(10 ** 10) }}',
    '{{ "%*s" % (10 ** 10, "") }}', '{{ "%10000000000s" % "" }}', '{{ "%10000000000s"|format("") }}',
    '{{ "{:>10000000000}".format("x") }}', '{{ "{:>{}}".format("x", 10 ** 10) }}',
    '{{ ("x" * 1000).replace("", "y" * 100000) }}', '{{ (["x" * 100000] * 100)|join }}',
    '{{ "ab"|indent(10 ** 9) }}', '{{ [1, 2]|tojson(indent=10 ** 9) }}', '{{ 99 ** 99999 }}',
    '{{ (["x" * 100000] * 10) * 10 }}', '{{ range(100000)|map("center", 100000)|list }}',
])
def test_a_template_that_builds_something_huge_is_refused_before_it_allocates_it(source):
    with pytest.raises(TemplateLimitExceeded, match="chat template (built|computed)"):
        render(source)


def test_a_template_within_its_limits_renders_as_before():
    source = ('{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}<{{ m.role }}>'
              '{{ m.content|trim|center(9) }}{% endfor %}{{ ns.n }} {{ "%3d|%s" % (7, "a") }} {{ "{:>3}".format(1) }}'
              '{{ messages|tojson(indent=2)|length }} {{ ["a", "b"]|join(",") }} {{ "a-b".replace("-", "+") }}'
              '{{ (range(3)|list) * 2 }} {{ 2 ** 10 }}')
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    assert render(source) == plain.from_string(source).render(messages=HELLO)
    assert render(source).startswith("<user>  hello  1   7|a   1")


def test_the_loop_limit_counts_every_iteration_of_every_loop():
    few = TemplateLimits(time_s=5, loop_iterations=1010)  # 10 + 10 x 100
    assert render("{% for i in range(10) %}{% for j in range(100) %}{% endfor %}{% endfor %}ok", few) == "ok"
    with pytest.raises(TemplateLimitExceeded, match="more than 1,010 loop iterations"):
        render("{% for i in range(11) %}{% for j in range(100) %}{% endfor %}{% endfor %}", few)


def test_a_transformers_tokenizer_renders_through_the_same_limits_and_as_transformers_does(tiny_llama):
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(tiny_llama)
    conversation = [{"role": "system", "content": "Be brief."}, *HELLO, {"role": "assistant", "content": "Hi!"},
                    {"role": "user", "content": "Tell me more"}]
    assert apply_chat_template(theirs, conversation) == theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    theirs.chat_template = '{{ "x" * 10 ** 12 }}'
    with pytest.raises(TemplateLimitExceeded):
        apply_chat_template(theirs, HELLO)


def model_with_template(tiny_llama, tmp_path, template: str):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    assert load_tokenizer(folder).chat_template == template
    return folder


# Renders like ChatML, except for a conversation whose last message is "spin" (a loop of 10**10 iterations)
# or "grow" (a string of 10**12 characters).
HOSTILE_TEMPLATE = ('{% if messages[-1].content == "spin" %}{% for i in range(100000) %}{% for j in range(100000) %}'
                    '{% endfor %}{% endfor %}{% elif messages[-1].content == "grow" %}{{ "x" * 10 ** 12 }}{% endif %}'
                    + CHATML)


def test_generate_writes_an_error_record_for_the_line_whose_template_runs_away(tiny_llama, tmp_path):
    folder = model_with_template(tiny_llama, tmp_path, HOSTILE_TEMPLATE)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"messages": [{"role": "user", "content": text}]} for text in ("grow", "hello", "spin")]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    start = time.monotonic()
    assert main(["generate", str(src), "-o", str(out), "-m", str(folder), "-t", "0", "-n", "4"]) == 0
    assert time.monotonic() - start < 30
    grow, hello, spin = (json.loads(line) for line in out.read_text().splitlines())
    assert "built a value of 1,000,000,000,000 characters" in grow["error"]
    assert "text" in hello and "error" not in hello
    # whichever limit comes first: the time limit, or on a fast CPU (a Zen 5 ran 10,000,000 iterations in
    # under its 2 s) the loop-iteration cap
    assert "ran past its time limit" in spin["error"] or "loop iterations" in spin["error"], spin["error"]


def test_chat_says_the_template_failed_and_goes_on(tiny_llama, tmp_path, capsys, monkeypatch):
    folder = model_with_template(tiny_llama, tmp_path, HOSTILE_TEMPLATE)
    code, out, err = run_cli(cli_args(folder, "--jsonl"), "grow\nhello\n", capsys, monkeypatch)
    assert code == 1, err  # plain mode: 1 when a turn failed
    problem, turn = (json.loads(line) for line in out.splitlines())
    assert "built a value of 1,000,000,000,000 characters" in problem["error"]
    assert turn["user"] == "hello" and turn["completion_tokens"] == 6


def test_request_failure_words_a_template_limit_as_the_requests_own(tiny_llama):
    from pagecli.errors import request_failure

    exc = TemplateLimitExceeded("the chat template ran past its time limit (2 s) on this conversation")
    assert isinstance(exc, RequestError) and request_failure(exc) == str(exc)
