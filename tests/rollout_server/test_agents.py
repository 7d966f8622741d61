"""Agent programs against the rollout server's OpenAI-compatible endpoint (issue 26 item 6), with
the real ``openai`` package as the client and the real HF engine serving: the episode is the ids
the engine sampled and was fed, whatever the agent's client sends; bad requests are refused,
counted, and end only their own episode."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from test_episodes import Recorded, assignment, runner, spans_of  # noqa: E402

from rollout_server.config import EnvironmentSettings  # noqa: E402
from rollout_server.engine_hf import HFEngine  # noqa: E402
from rollout_server.metrics import RolloutMetrics  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, seed=4)

CALLS: list = []          # what the agents saw, per test


async def three_turns(base_url, prompt, metadata):
    """A tool-using agent as written for any OpenAI server: the model's answer, a 'tool' result,
    again, then the reward."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slipstream", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    replies = []
    for turn in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        reply = r.choices[0].message.content
        replies.append((reply, r.choices[0].finish_reason))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f" t{turn}:"}]
    CALLS.append(replies)
    await client.close()
    return {"answered": 1.0, "calls": 0.5}


def three_turns_sync(base_url, prompt, metadata):
    """The same with the synchronous client (the endpoint runs it on a worker thread)."""
    client = openai.OpenAI(base_url=base_url, api_key="slipstream", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "?"}]
    assert [m.id for m in client.models.list().data]
    client.close()
    return 0.25


async def rewrites_history(base_url, prompt, metadata):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slipstream", max_retries=0)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    edited = r.choices[0].message.content + "!"                     # not what the model said
    await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": prompt}, {"role": "assistant", "content": edited},
        {"role": "user", "content": "go"}])
    return 1.0


async def never_stops(base_url, prompt, metadata):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slipstream", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    finishes = []
    for _ in range(5):
        r = await client.chat.completions.create(model="policy", messages=messages)
        finishes.append(r.choices[0].finish_reason)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "more"}]
    CALLS.append(finishes)
    return 0.0


def run_agent(engine, name, *, group=2, max_turns=4, episode=40, metrics=None, recorded=None, **settings):
    spec = f"agent:{__name__}:{name}"
    run = runner(engine, EnvironmentSettings(class_name=spec, **settings), recorded, metrics)

    async def main():
        try:
            return await run.run_group(assignment(engine, "q:", group=group, max_turns=max_turns,
                                                  episode=episode), spec)
        finally:
            await run.close()
    return asyncio.run(main())


def test_an_openai_client_agent_trains_token_exactly(engine):
    CALLS.clear()
    recorded = Recorded(engine)
    samples = run_agent(engine, "three_turns", recorded=recorded)
    served = recorded.by_prompt()
    assert len(CALLS) == 2
    for s, replies in zip(samples, CALLS):
        assert s.failed is None, s.failed
        spans = spans_of(s)
        assert len(spans) == 3 and s.reward == 1.5 and s.reward_parts == {"answered": 1.0, "calls": 0.5}
        ids = s.completion_token_ids.tolist()
        prompt = s.prompt_token_ids.tolist()
        for k, (start, end) in enumerate(spans):
            # what the engine was fed and sampled, and what the agent was told it said
            assert ids[start:end] in [c.token_ids.tolist() for c in served[tuple(prompt + ids[:start])]]
            assert engine.decode(np.asarray(ids[start:end])) in [r for r, _ in replies]
            if k + 1 < len(spans):          # the 'tool' message, tokenized alone, masked
                assert engine.tokenizer.decode(ids[end:spans[k + 1][0]]) == f" t{k}:"
        assert s.loss_mask().sum() == sum(e - b for b, e in spans)


def test_a_synchronous_client_works_too(engine):
    samples = run_agent(engine, "three_turns_sync")
    assert all(s.failed is None and s.turns == 2 and s.reward == 0.25 for s in samples), samples


def test_an_agent_that_rewrites_the_history_fails_its_episode(engine):
    metrics = RolloutMetrics()
    samples = run_agent(engine, "rewrites_history", metrics=metrics)
    for s in samples:
        assert s.failed.startswith("environment history: a request's messages must continue"), s.failed
    value = metrics.registry.get_sample_value
    assert value("slipstream_episodes_failed_total", {"reason": "history"}) == 2
    assert value("slipstream_rollout_errors_total", {"kind": "agent_request"}) == 2


def test_requests_past_the_turn_limit_get_an_empty_length_reply(engine):
    CALLS.clear()
    samples = run_agent(engine, "never_stops", group=1, max_turns=2)
    (s,) = samples
    assert s.failed is None and s.turns == 2 and s.metadata["truncated"] and s.finish_reason == "length"
    assert CALLS[0][2:] == ["length"] * 3


def _raw(port: int, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                data.split(b"Content-Length: ")[1].split(b"\r\n")[0]):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def held(base_url, prompt, metadata):
    """Waits for the test to poke the endpoint with bad requests, then finishes normally."""
    CALLS.append(base_url)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slipstream", max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    while not HELD.is_set():
        await asyncio.sleep(0.01)
    return 1.0


HELD = __import__("threading").Event()


def test_malformed_requests_are_refused_in_openais_shape_and_counted(engine):
    """Through a real socket while an episode is open: not HTTP, bad JSON, an unknown episode or
    route, a wrong method, a body too large, a chunked body, messages that are not strings, tools
    that are not a list: each an error reply (the episode goes on and ends well)."""
    CALLS.clear()
    HELD.clear()
    metrics = RolloutMetrics()
    spec = f"agent:{__name__}:held"
    run = runner(engine, EnvironmentSettings(class_name=spec), metrics=metrics)
    results = {}

    async def main():
        task = asyncio.create_task(run.run_group(assignment(engine, "q:", group=1), spec))
        while not CALLS:
            await asyncio.sleep(0.01)
        port = run.endpoint.port
        path = CALLS[0].split(f":{port}")[1]

        def post(route, body: bytes, extra=b""):
            return (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode()
                    + extra + b"\r\n" + body)

        cases = {
            "not http": b"HELLO\r\n\r\n",
            "bad json": post(f"{path}/chat/completions", b"{nope"),
            "no episode": post("/episodes/e999/v1/chat/completions", b"{}"),
            "no route": post(f"{path}/embeddings", b"{}"),
            "method": f"GET {path}/chat/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode(),
            "too large": f"POST {path}/chat/completions HTTP/1.1\r\nContent-Length: {1 << 30}\r\n\r\n".encode(),
            "chunked": f"POST {path}/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode(),
            "not strings": post(f"{path}/chat/completions", json.dumps({"messages": [{"role": "user", "content": 3}]}).encode()),
            "tools": post(f"{path}/chat/completions", json.dumps({"messages": [{"role": "user", "content": "q:"}], "tools": "calc"}).encode()),
        }
        for name, request in cases.items():
            results[name] = await asyncio.to_thread(_raw, port, request)
        HELD.set()
        try:
            return await task
        finally:
            await run.close()

    (s,) = asyncio.run(main())
    assert s.failed is None and s.reward == 1.0 and s.turns == 1
    expected = {"not http": 400, "bad json": 400, "no episode": 404, "no route": 404, "method": 405,
                "too large": 413, "chunked": 411, "not strings": 400, "tools": 400}
    assert {k: v[0] for k, v in results.items()} == expected
    assert all("message" in v[1]["error"] for v in results.values())
    assert metrics.registry.get_sample_value("slipstream_rollout_errors_total", {"kind": "agent_request"}) == 9


async def streams(base_url, prompt, metadata):
    """A streaming client (``stream=True``), two turns: the chunks put together are the turn."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slipstream", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    got = []
    for _ in range(2):
        stream = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        got.append((text, finish, chunks[-1].usage.completion_tokens))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "?"}]
    CALLS.append(got)
    await client.close()
    return 1.0


def test_a_streaming_client_gets_the_turn_as_chunks(engine):
    CALLS.clear()
    samples = run_agent(engine, "streams", group=1)
    (s,), (got,) = samples, CALLS
    assert s.failed is None and s.turns == 2, s.failed
    ids = s.completion_token_ids.tolist()
    for (start, end), (text, finish, tokens) in zip(spans_of(s), got):
        assert text == engine.decode(np.asarray(ids[start:end])) and tokens == end - start
        assert len(finish) == 1 and finish[0] in ("stop", "length")


def test_tool_calls_come_back_in_openais_format_and_their_results_are_the_observation():
    """Hermes-format calls in the model's text come back as ``tool_calls``; the agent sends the
    message back as the client gave it, with a ``tool`` result: that result is the observation,
    and the call is matched, not re-rendered (one with edited arguments rewrites the history)."""
    from rollout_server.agents import AgentSession, OpenAIEndpoint

    turns = ['Adding. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', "It is 5."]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

    async def main():
        seen = []

        async def take_turn(observation, stop, limit):   # the engine's turns, scripted
            seen.append(observation)
            return turns[len(seen) - 1], "stop", 9

        endpoint = OpenAIEndpoint()
        await endpoint.start()
        client = openai.AsyncOpenAI(base_url=endpoint.open(AgentSession(
            [{"role": "user", "content": "2+3?"}], take_turn, model="m")), api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "2+3?"}]
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        msg = r.choices[0].message
        call = msg.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Adding."
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        messages += [msg, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        stream = await client.chat.completions.create(model="m", messages=messages, tools=tools, stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is 5."
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert seen == [None, [{"role": "tool", "content": "5", "tool_call_id": call.id}]]

        # The same episode start in another session; the call sent back edited is refused.
        seen.clear()
        client2 = openai.AsyncOpenAI(base_url=endpoint.open(AgentSession(
            [{"role": "user", "content": "2+3?"}], take_turn, model="m")), api_key="x", max_retries=0)
        r = await client2.chat.completions.create(model="m", messages=messages[:1], tools=tools)
        edited = r.choices[0].message.model_dump()
        edited["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 4}'
        with pytest.raises(openai.BadRequestError, match="continue the previous request"):
            await client2.chat.completions.create(model="m", tools=tools, messages=[
                messages[0], edited, {"role": "tool", "tool_call_id": call.id, "content": "6"}])
        await client.close()
        await client2.close()
        await endpoint.close()

    asyncio.run(main())


def test_parse_tool_calls_keeps_what_is_not_a_call():
    from rollout_server.agents import parse_tool_calls

    assert parse_tool_calls("no call here", "c") == ("no call here", [])
    text = 'a <tool_call>{not json}</tool_call> b'
    assert parse_tool_calls(text, "c") == (text, [])
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>'
                                      '<tool_call>{"name": "g"}</tool_call> done', "c")
    assert content == "done"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("c0", "f", "x=1"), ("c1", "g", "{}")]
