"""The official openai client against kvstage: a router over a prefill and a decode server, and
a colocated server, all of the default model. Greedy answers through the router equal the
colocated ones, streamed or not; a stop string inside the first token ends with "stop" on both;
requests the decode side refuses free the prefill side at once; many clients at once; logprobs
through the router equal the colocated ones, a text scored with echo + logprobs has the
perplexity the model's logits give directly, /tokenize and /detokenize round trip."""
import concurrent.futures
import json
import math
import os
import subprocess
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


def post(proc, path, body):
    req = urllib.request.Request(proc.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def same_entries(a, b):
    """Chat logprobs entries (openai objects) equal within 1e-4, alternatives id for id."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.token == y.token and x.bytes == y.bytes
        assert abs(x.logprob - y.logprob) <= 1e-4
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        for s, t in zip(x.top_logprobs, y.top_logprobs):
            assert abs(s.logprob - t.logprob) <= 1e-4


def test_chat_logprobs_router_equals_colocated(deployment, model):
    msgs = [{"role": "user", "content": "Name three fruits."}]
    kw = dict(messages=msgs, max_tokens=6, logprobs=True, top_logprobs=5)
    a = chat(deployment.router, model, **kw).choices[0]
    b = chat(deployment.colocated, model, **kw).choices[0]
    assert a.message.content == b.message.content
    same_entries(a.logprobs.content, b.logprobs.content)
    assert len(a.logprobs.content) == 6
    for e in a.logprobs.content:
        assert len(e.top_logprobs) == 5
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest
        assert e.logprob <= 0
    # Streamed through the router: the chunks carry the same entries.
    streamed = []
    for chunk in client(deployment.router).chat.completions.create(model=model, temperature=0,
                                                                   stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    same_entries(streamed, b.logprobs.content)


def test_completion_logprobs_router_equals_colocated(deployment, model):
    kw = dict(prompt="The capital of France is", max_tokens=5, logprobs=3)
    a = complete(deployment.router, model, **kw).choices[0].logprobs
    b = complete(deployment.colocated, model, **kw).choices[0].logprobs
    assert a.tokens == b.tokens and a.text_offset == b.text_offset
    assert all(abs(x - y) <= 1e-4 for x, y in zip(a.token_logprobs, b.token_logprobs))
    for d, e in zip(a.top_logprobs, b.top_logprobs):
        assert set(d) == set(e) and 3 <= len(d) <= 4


def test_scoring(deployment, model):
    """echo + logprobs + max_tokens 1 scores a text: its perplexity is the one the model's logits
    give directly (kvs_score_ref), through the router (the prefill side computes the prompt's
    logprobs) and colocated."""
    ref_tool = os.environ.get("KVS_SCORE_REF")
    if not ref_tool:
        pytest.skip("KVS_SCORE_REF (the reference scorer) is not set")
    text = "The quick brown fox jumps over the lazy dog."
    ids = post(deployment.colocated, "/tokenize", {"prompt": text})["tokens"]
    out = subprocess.run([ref_tool] + [str(i) for i in ids], capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    ref = [float(x) for x in out]
    assert len(ref) == len(ids) - 1
    ref_ppl = math.exp(-sum(ref) / len(ref))
    for proc in (deployment.router, deployment.colocated):
        r = complete(proc, model, prompt=text, echo=True, logprobs=1, max_tokens=1)
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(text)
        n = r.usage.prompt_tokens
        assert n == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1:n]
        assert all(abs(x - y) <= 1e-4 for x, y in zip(got, ref)), (got, ref)
        assert "".join(lp.tokens[:n]) == text
        ppl = math.exp(-sum(got) / len(got))
        assert abs(ppl - ref_ppl) <= 1e-4 * ref_ppl


def test_tokenize_round_trip(deployment, model):
    text = "Tokenize me, then back: café!"
    for proc in (deployment.router, deployment.colocated):
        t = post(proc, "/tokenize", {"model": model, "prompt": text})
        assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] >= 2048
        assert post(proc, "/detokenize", {"tokens": t["tokens"]})["prompt"] == text
        m = post(proc, "/tokenize", {"messages": [{"role": "user", "content": text}]})
        assert m["count"] > t["count"]  # the chat template around it
