"""`pagecli serve` answers the OpenAI API as the official client reads it: chat and completions,
streamed and not, n candidates, usage with cached prompt tokens, /v1/models, /health and /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from serve_helpers import client, server  # noqa: F401 - the module's server on the tiny model, and its client

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]


def test_chat_completion_has_openais_shape_and_usage(server, client):
    reply = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=6, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert len(reply.choices) == 1 and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == len(server.engine.encode_chat(MESSAGES))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= 6
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_chat_equals_the_whole_reply_and_ends_with_usage(server, client):
    whole = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model=server.model_id, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_and_not_agree(server, client):
    whole = client.completions.create(model=server.model_id, prompt="The quick brown fox", max_tokens=7,
                                      temperature=0)
    assert whole.object == "text_completion" and whole.usage.prompt_tokens > 0
    parts = list(client.completions.create(model=server.model_id, prompt="The quick brown fox", max_tokens=7,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_candidates_with_a_seed_sample_as_lone_requests_with_seed_plus_i(server, client):
    prompt, common = "Paged attention keeps", dict(max_tokens=6, temperature=1.0, top_p=0.95)
    shares_before = server.engine.stats().fork_block_shares
    group = client.completions.create(model=server.model_id, prompt=prompt, n=3, seed=11, **common)
    assert server.engine.stats().fork_block_shares > shares_before  # one prompt, forked onto shared blocks
    assert [c.index for c in group.choices] == [0, 1, 2]
    lone = [client.completions.create(model=server.model_id, prompt=prompt, seed=11 + i, **common).choices[0].text
            for i in range(3)]
    assert [c.text for c in group.choices] == lone
    assert group.usage.prompt_tokens == len(server.engine.encode(prompt))  # counted once for the group
    streamed = list(client.chat.completions.create(model=server.model_id, messages=MESSAGES, n=2, max_tokens=4,
                                                   temperature=0, stream=True))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_a_repeated_system_prompt_is_reported_as_cached_tokens(server, client):
    system = {"role": "system", "content": "You answer questions about the quick brown fox. " * 4}
    first = client.chat.completions.create(model=server.model_id, max_tokens=2, temperature=0,
                                           messages=[system, {"role": "user", "content": "Who jumps?"}])
    second = client.chat.completions.create(model=server.model_id, max_tokens=2, temperature=0,
                                            messages=[system, {"role": "user", "content": "Over what?"}])
    block = server.engine.config.block_size
    assert first.usage.prompt_tokens_details.cached_tokens < block
    assert second.usage.prompt_tokens_details.cached_tokens >= 2 * block


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [server.model_id]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    client.completions.create(model=server.model_id, prompt="Hello", max_tokens=2)
    metrics = httpx.get(server.base_url + "/metrics").text
    for series in ('pagecli_requests_total{endpoint="/v1/completions",status="200"}',
                   "pagecli_time_to_first_token_seconds_bucket", "pagecli_inter_token_latency_seconds_bucket",
                   'pagecli_kv_blocks{state="cached"}', 'pagecli_prefix_hit_tokens_total{tier="disk"}',
                   "pagecli_preemptions_total", "pagecli_completion_tokens_total", "pagecli_spec_accepted_total"):
        assert series in metrics, series
    assert server.log_lines and "POST /v1/completions 200" in server.log_lines[-1]


def test_the_screen_shows_the_pool_panel_and_a_row_per_request(server):
    from rich.console import Console

    from pagecli.config import SamplingParams
    from pagecli.serve.jobs import Job
    from pagecli.ui.serve_screen import ServeScreen

    class Thread:  # what the screen reads of the engine thread
        snapshot = server.engine.stats(include_block_states=True)
        pending = 1

        def running_jobs(self):
            job = Job("chat", [], SamplingParams(n=2), sink=None, prompt_tokens=40, cached_tokens=32,  # type: ignore[arg-type]
                      completion_tokens=9, status="running")
            job.first_token_s = job.arrival_s + 0.025
            return [job]

    screen = ServeScreen(Console(record=True, width=140, color_system=None))
    screen.attach(Thread())
    screen.add_line("12:00:00 POST /v1/chat/completions 200 #1")
    screen.console.print(screen._render())
    text = screen.console.export_text()
    assert "KV block pool" in text and "requests in the engine: 1" in text
    assert "chat" in text and "40" in text and "32" in text and "25 ms" in text
    assert "POST /v1/chat/completions 200" in text


def test_content_parts_and_the_developer_role_read_as_generate_reads_them(server, client):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    reply = client.chat.completions.create(model=server.model_id, messages=parts, max_tokens=3, temperature=0)
    same = client.chat.completions.create(model=server.model_id, messages=plain, max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == same.usage.prompt_tokens == len(server.engine.encode_chat(plain))
    assert reply.choices[0].message.content == same.choices[0].message.content
