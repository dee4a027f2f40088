"""Real clients talk to the twin: the official OpenAI Python client, streaming and not."""

from __future__ import annotations

import openai
import pytest

from loadlab.testing.servers import start_twin


@pytest.fixture(scope="module")
def twin():
    server = start_twin("--enable-cache-report")
    yield server
    server.stop()


def _client(twin):
    return openai.OpenAI(base_url=twin.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_client_lists_the_model(twin):
    models = _client(twin).models.list()
    assert len(models.data) == 1 and models.data[0].id


def test_openai_client_streams_chat_with_usage(twin):
    client = _client(twin)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "one two three four five"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert content and finish == ["length"]
    assert usage.completion_tokens == 9 and usage.prompt_tokens > 5
    assert chunks[0].choices[0].delta.role == "assistant"


def test_openai_client_completions_non_streaming(twin):
    client = _client(twin)
    model = client.models.list().data[0].id
    reply = client.completions.create(
        model=model, prompt="alpha beta gamma", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5 and reply.usage.prompt_tokens == 3
    assert reply.choices[0].text


def test_openai_client_sees_errors_as_exceptions(twin):
    client = _client(twin)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=10**9)
