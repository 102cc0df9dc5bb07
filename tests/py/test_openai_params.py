"""The request parameters as the official openai client sends them, through the router and to a
colocated server: sampling knobs, seeds, unknown fields, the limits from the model, model
retrieval and bad input named by field."""
import openai
import pytest

from test_openai import chat, client, complete


@pytest.fixture(scope="module")
def model(deployment):
    return client(deployment.router).models.list().data[0].id


PROMPT = "Write a list of fruits: apple, banana,"


def text_of(r):
    return r.choices[0].text


def test_models_retrieve(deployment, model):
    for proc in (deployment.router, deployment.colocated):
        assert client(proc).models.retrieve(model).id == model
        with pytest.raises(openai.NotFoundError):
            client(proc).models.retrieve("no-such-model")


def test_penalties_change_a_greedy_output(deployment, model):
    plain = complete(deployment.colocated, model, prompt=PROMPT, max_tokens=24)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
               {"extra_body": {"repetition_penalty": 1.8}}):
        a = complete(deployment.colocated, model, prompt=PROMPT, max_tokens=24, **kw)
        b = complete(deployment.router, model, prompt=PROMPT, max_tokens=24, **kw)
        assert text_of(a) != text_of(plain), kw
        assert text_of(a) == text_of(b), kw  # disaggregated equals colocated


def test_unseeded_requests_differ_and_report_their_seed(deployment, model):
    kw = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0)
    a = client(deployment.router).completions.create(model=model, **kw)
    b = client(deployment.router).completions.create(model=model, **kw)
    sa, sb = a.model_extra["kvstage"]["seed"], b.model_extra["kvstage"]["seed"]
    assert sa != sb
    assert text_of(a) != text_of(b)
    # The reported seed replays the draws, through the router and on the colocated server.
    for proc in (deployment.router, deployment.colocated):
        again = client(proc).completions.create(model=model, seed=sa, **kw)
        assert text_of(again) == text_of(a)


def test_vllm_knobs_are_accepted(deployment, model):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True}
    a = complete(deployment.router, model, prompt=PROMPT, max_tokens=6, seed=7, extra_body=extra)
    b = complete(deployment.colocated, model, prompt=PROMPT, max_tokens=6, seed=7,
                 extra_body=extra)
    assert text_of(a) == text_of(b)
    assert a.usage.completion_tokens == 6


def test_logit_bias_forces_a_token(deployment, model):
    free = complete(deployment.colocated, model, prompt=PROMPT, max_tokens=3)
    forced = complete(deployment.router, model, prompt=PROMPT, max_tokens=3,
                      logit_bias={"28": 100})
    assert text_of(forced) != text_of(free)
    again = complete(deployment.colocated, model, prompt=PROMPT, max_tokens=3,
                     logit_bias={"28": 100})
    assert text_of(again) == text_of(forced)


def test_unknown_fields_are_ignored_and_named(deployment, model):
    for proc in (deployment.router, deployment.colocated):
        raw = client(proc).completions.with_raw_response.create(
            model=model, prompt="Hi", max_tokens=2, temperature=0,
            extra_body={"service_tier": "auto", "reasoning_effort": "low"})
        names = raw.headers.get("X-Kvstage-Ignored-Fields", "")
        assert "service_tier" in names and "reasoning_effort" in names
        assert raw.parse().usage.completion_tokens == 2


def test_bad_input_is_named(deployment, model):
    cases = [({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
             ({"presence_penalty": 5}, "presence_penalty"),
             ({"extra_body": {"top_k": -3}}, "top_k"),
             ({"extra_body": {"min_p": 2}}, "min_p")]
    for kw, name in cases:
        for proc in (deployment.router, deployment.colocated):
            with pytest.raises(openai.BadRequestError) as e:
                complete(proc, model, prompt="Hi", max_tokens=2, **kw)
            assert e.value.body.get("param") == name, (kw, e.value.body)


def test_context_from_the_model(deployment, model):
    # SmolLM2's GGUF says 8192: a large max_tokens is fine while it fits ...
    r = chat(deployment.router, model, messages=[{"role": "user", "content": "Hi"}],
             max_tokens=4096, stop=["\n", "."])
    assert r.choices[0].finish_reason in ("stop", "length")
    # ... and beyond it the error names the field and both numbers, as vLLM words it.
    for proc in (deployment.router, deployment.colocated):
        with pytest.raises(openai.BadRequestError) as e:
            chat(proc, model, messages=[{"role": "user", "content": "Hi"}], max_tokens=9000)
        assert e.value.body.get("param") == "max_tokens"
        msg = e.value.body.get("message", "")
        assert "8192" in msg and "9000" in msg, msg


def test_n_choices(deployment, model):
    # n = 3: three choices from one prompt (computed and handed over once), choice i sampled
    # with seed + i; disaggregated equals colocated, streamed or not.
    kw = dict(prompt="Once upon a time", max_tokens=10, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client(deployment.router).completions.create(model=model, seed=21, n=3, **kw)
    b = client(deployment.colocated).completions.create(model=model, seed=21, n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) == 3, texts
    alone = [client(deployment.colocated).completions.create(model=model, seed=21 + i, **kw)
             for i in range(3)]
    assert [x.choices[0].text for x in alone] == texts
    # The prompt counts once, the completion tokens of every choice.
    assert a.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert a.usage.completion_tokens == 30
    streamed = ["", "", ""]
    for chunk in client(deployment.router).completions.create(model=model, seed=21, n=3,
                                                              stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts

    # Chat: the choices, and streamed deltas that carry their choice's index.
    ckw = dict(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
               temperature=1.0, seed=5, n=3)
    c = client(deployment.router).chat.completions.create(model=model, **ckw)
    d = client(deployment.colocated).chat.completions.create(model=model, **ckw)
    assert [x.message.content for x in c.choices] == [x.message.content for x in d.choices]
    got = ["", "", ""]
    for chunk in client(deployment.router).chat.completions.create(model=model, stream=True,
                                                                    **ckw):
        for ch in chunk.choices:
            got[ch.index] += ch.delta.content or ""
    assert got == [x.message.content for x in c.choices]

    with pytest.raises(openai.BadRequestError) as e:
        complete(deployment.router, model, prompt="Hi", max_tokens=2, n=17)
    assert e.value.body.get("param") == "n"
