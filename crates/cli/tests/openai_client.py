"""Drives a running `pipeshard up` (SmolLM2-135M) with the official `openai` package.

Usage: python3 openai_client.py BASE_URL   (BASE_URL ends in /v1)
Exits non-zero, with the failed assertion, when the server does not behave like OpenAI's.
"""
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="not-needed", max_retries=0)

models = client.models.list()
assert len(models.data) == 1, models
model = models.data[0].id

question = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]

# Chat, whole.
r = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0)
text = r.choices[0].message.content
assert r.object == "chat.completion", r
assert r.choices[0].message.role == "assistant", r
assert "Paris" in text, text
assert r.choices[0].finish_reason in ("stop", "length"), r
u = r.usage
assert u.prompt_tokens > 5 and 0 < u.completion_tokens <= 32, u
assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u

# Chat, streamed: the same greedy text, in pieces, with usage at the end.
pieces, finish, usage = [], None, None
for chunk in client.chat.completions.create(
    model=model, messages=question, max_tokens=32, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    assert chunk.object == "chat.completion.chunk", chunk
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == text, (pieces, text)
assert len(pieces) > 1, pieces
assert finish == r.choices[0].finish_reason, finish
assert usage is not None and usage.completion_tokens == u.completion_tokens, usage

# Completions, whole and streamed.
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
assert c.choices[0].text.startswith(" Paris"), c.choices[0].text
assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens <= 8, c.usage
streamed = "".join(
    ch.choices[0].text
    for ch in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    if ch.choices
)
assert streamed == c.choices[0].text, (streamed, c.choices[0].text)

# Seeded sampling is reproducible.
kw = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=42)
assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text

# Errors come back as OpenAI errors.
try:
    client.chat.completions.create(model="no-such-model", messages=question)
    raise AssertionError("an unknown model was accepted")
except openai.BadRequestError as e:
    assert "does not exist" in str(e), e
try:
    client.chat.completions.create(model=model, messages=question, max_tokens=10**7)
    raise AssertionError("max_tokens past the context was accepted")
except openai.BadRequestError as e:
    assert "context length" in str(e), e

# A client that goes away mid-stream cancels its request: its KV caches are freed on every
# stage (the head's /health reports each stage's live sequences, refreshed every second).
import json
import time
import urllib.request

health_url = sys.argv[1].rsplit("/v1", 1)[0] + "/health"


def sequences():
    with urllib.request.urlopen(health_url) as r:
        return [s["sequences"] for s in json.load(r)["stages"]]


def wait_for(pred, what, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = sequences()
        if pred(seen):
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: stages hold {seen}")


stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
    max_tokens=4000, temperature=0, stream=True,
)
it = iter(stream)
for _ in range(3):
    next(it)
wait_for(lambda s: all(n == 1 for n in s), "a live stream has a cache on every stage")
stream.close()
wait_for(lambda s: all(n == 0 for n in s), "a closed stream's caches are released")

print("openai client: all checks passed")
