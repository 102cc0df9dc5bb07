"""The official openai client against kvstage: a router over a prefill and a decode server, and
a colocated server, all of the default model. Greedy answers through the router equal the
colocated ones, streamed or not; a stop string inside the first token ends with "stop" on both;
requests the decode side refuses free the prefill side at once; many clients at once."""
import concurrent.futures
import time
import urllib.request

import openai
import pytest


def client(proc):
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(proc, name):
    text = urllib.request.urlopen(proc.url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {proc.url}/metrics")


@pytest.fixture(scope="module")
def model(deployment):
    models = client(deployment.router).models.list().data
    assert len(models) == 1
    return models[0].id


def complete(proc, model, **kw):
    kw.setdefault("temperature", 0)
    return client(proc).completions.create(model=model, **kw)


def chat(proc, model, **kw):
    kw.setdefault("temperature", 0)
    return client(proc).chat.completions.create(model=model, **kw)


def streamed_chat(proc, model, **kw):
    text, finish = "", None
    for chunk in client(proc).chat.completions.create(model=model, temperature=0, stream=True,
                                                      **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def streamed_complete(proc, model, **kw):
    text, finish = "", None
    for chunk in client(proc).completions.create(model=model, temperature=0, stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def test_models(deployment, model):
    for proc in (deployment.router, deployment.colocated):
        assert [m.id for m in client(proc).models.list().data] == [model]


def test_router_equals_colocated(deployment, model):
    prompt = "The capital of France is"
    a = complete(deployment.router, model, prompt=prompt, max_tokens=8)
    b = complete(deployment.colocated, model, prompt=prompt, max_tokens=8)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8
    assert streamed_complete(deployment.router, model, prompt=prompt, max_tokens=8) == (
        b.choices[0].text, "length")
    msgs = [{"role": "user", "content": "Name a color."}]
    a = chat(deployment.router, model, messages=msgs, max_tokens=6)
    b = chat(deployment.colocated, model, messages=msgs, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert streamed_chat(deployment.router, model, messages=msgs, max_tokens=6)[0] == \
        b.choices[0].message.content


def test_router_reports_the_transfer(deployment, model):
    a = complete(deployment.router, model, prompt="Count: one, two, three,", max_tokens=2)
    k = a.model_extra["kvstage"]
    assert k["transfer_ns"] > 0
    assert k["kv_bytes"] > 0
    assert k["prefill"]["transfer_ns"] == k["transfer_ns"]
    assert k["decode"]["kv_bytes"] == k["kv_bytes"]


def test_stop_in_first_token(deployment, model):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    free = chat(deployment.colocated, model, messages=msgs, max_tokens=4).choices[0].message
    assert free.content.startswith("The"), free.content  # the case: the first token holds it
    for proc in (deployment.router, deployment.colocated):
        r = chat(proc, model, messages=msgs, max_tokens=16, stop=["The"])
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == ""
        assert streamed_chat(proc, model, messages=msgs, max_tokens=16, stop=["The"]) == ("",
                                                                                        "stop")


def test_refused_requests_do_not_hold_the_prefill_side(deployment, model):
    for _ in range(8):
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            complete(deployment.router, model, prompt="Hello", max_tokens=10**7)
        assert "max_tokens" in str(e.value)
        assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    r = complete(deployment.router, model, prompt="Hello, my name is", max_tokens=4)
    assert r.usage.completion_tokens == 4
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 10
    while metric(deployment.prefill, "kvstage_requests_live") != 0:
        assert time.monotonic() < deadline, "the prefill server still holds requests"
        time.sleep(0.1)


def test_sixteen_clients(deployment, model):
    prompts = [f"Item {i}: the number after {i} is" for i in range(16)]
    want = {p: complete(deployment.colocated, model, prompt=p, max_tokens=3).choices[0].text
            for p in prompts[:4]}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(
            lambda p: complete(deployment.router, model, prompt=p, max_tokens=3), prompts))
    for p, r in zip(prompts, got):
        assert r.usage.completion_tokens == 3
        if p in want:
            assert r.choices[0].text == want[p]
    assert metric(deployment.prefill, "kvstage_requests_live") == 0
    assert metric(deployment.decode, "kvstage_requests_live") == 0
