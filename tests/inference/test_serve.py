"""`slipstream serve`: one server process on a tiny saved LLaMA, driven by the `openai` client
(completions, chat, streaming, concurrency), raw HTTP for bad requests, disconnects and
backpressure, and SIGTERM last (in-flight requests finish, exit 0)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from slipstream.inference import generate
from tests._tiny_models import EOS, VOCAB, tiny_llama
from tests.distributed.harness import _free_port  # also: the fork server's preload

openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package is built on (httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CONTEXT = 512
PENDING = 8
NAME = "tiny-llama"
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def _save(path: Path):
    words = ["<pad>", "<s>", "user", "system", "assistant", "</s>"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    core = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")
    )
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="</s>", pad_token="<pad>", bos_token="<s>"
    )
    tok.chat_template = TEMPLATE
    model = tiny_llama(context=CONTEXT)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def _serve(argv: list[str], log: str) -> None:
    """`slipstream serve ARGV` in a process forked from the test session's fork server (torch
    and slipstream already imported there), its output to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    from slipstream.cli.main import main

    sys.exit(main(argv))


class Server:
    def __init__(self, proc, log: Path, url: str, model, tok) -> None:
        self.proc, self.log, self.url, self.model, self.tok = proc, log, url, model, tok
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def output(self) -> str:
        return self.log.read_text()[-3000:]

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while (h := self.health())["pending"] or h["free_blocks"] != h["total_blocks"]:
            assert time.monotonic() < deadline, f"requests still held: {h}"
            time.sleep(0.05)
        return h

    def reference(self, ids: list[int], new: int) -> list[int]:
        """The one-prompt greedy answer (EOS included when it comes)."""
        out = generate(self.model, input_ids=torch.tensor([ids]), max_new_tokens=new)
        out = out[0, len(ids) :].tolist()
        return out[: out.index(EOS) + 1] if EOS in out else out

    def text(self, ids: list[int]) -> str:
        return self.tok.decode([t for t in ids if t != EOS], skip_special_tokens=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("served") / NAME
    model, tok = _save(path)
    port = _free_port()
    argv = ["serve", str(path), "--port", str(port), "--max-num-seqs", "4", "--max-pending",
            str(PENDING), "--shutdown-timeout", "60"]  # fmt: skip
    log = path.parent / "server.log"
    proc = multiprocessing.get_context("forkserver").Process(target=_serve, args=(argv, str(log)))
    proc.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    yield Server(proc, log, url, model, tok)
    if proc.is_alive():
        proc.kill()
    proc.join(30)


def test_models_and_health(server):
    """/v1/models lists the served name; /health reports the engine and free blocks."""
    assert [m.id for m in server.client.models.list()] == [NAME]
    health = server.health()
    assert health["status"] == "ok" and health["backend"] in ("static", "continuous")
    assert health["free_blocks"] == health["total_blocks"] > 0


def test_completion_is_the_greedy_answer_with_usage(server):
    """temperature=0 gives generate's greedy tokens as text; usage counts prompt and answer."""
    ids = server.tok("w3 w9 w40").input_ids
    want = server.reference(ids, 12)
    out = server.client.completions.create(model=NAME, prompt="w3 w9 w40", max_tokens=12,
                                           temperature=0)  # fmt: skip
    assert out.choices[0].text == server.text(want)
    assert out.choices[0].finish_reason == ("stop" if want[-1] == EOS else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(want))
    # Token ids as the prompt, and a stop string cut out of the text.
    answer = server.text(want).split()
    assert len(answer) >= 3, answer
    full, stop = server.text(want), " " + answer[2]
    cut = server.client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                           stop=[stop])  # fmt: skip
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    server.wait_idle()  # the stop string ended the engine's request too


def test_chat_stream_equals_the_whole_answer(server):
    """Chat goes through the template; the streamed deltas join into the non-streamed
    message, with the same finish reason and usage (include_usage)."""
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w3 w9 w40"}]
    ids = server.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = server.tok(ids, add_special_tokens=False).input_ids
    want = server.reference(ids, 16)
    kw = {"model": NAME, "messages": messages, "max_tokens": 16, "temperature": 0}
    whole = server.client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == server.text(want)
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(want)
    chunks = list(server.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_concurrent_requests_each_get_their_own_answer(server):
    """Eight threads, ragged prompts and lengths, more than one batch: every answer is that
    prompt's one-prompt greedy answer."""
    g = torch.Generator().manual_seed(3)
    jobs = [(torch.randint(EOS + 1, VOCAB, (2 + 3 * i % 11,), generator=g).tolist(), 4 + 3 * i)
            for i in range(8)]  # fmt: skip

    def ask(job):
        prompt, new = job
        out = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=new,
                                               temperature=0)  # fmt: skip
        return out.choices[0].text, out.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    for (prompt, new), (text, count) in zip(jobs, answers, strict=True):
        want = server.reference(prompt, new)
        assert (text, count) == (server.text(want), len(want)), prompt
    server.wait_idle()


def _post(server, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=data,
                      headers={"Content-Type": "application/json"}, timeout=30, **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", [1, 2], 400, None, "JSON object"),
        ("/v1/completions", {"model": NAME}, 400, "prompt", "Missing required parameter"),
        ("/v1/completions", {"model": NAME, "prompt": "w3", "bogus": 1}, 400, "bogus",
         "Unrecognized request argument"),
        ("/v1/completions", {"model": NAME, "prompt": "w3", "max_tokens": "5"}, 400,
         "max_tokens", "valid integer"),
        ("/v1/completions", {"model": NAME, "prompt": "w3", "n": 2}, 400, "n", "not supported"),
        ("/v1/completions", {"model": NAME, "prompt": "w3", "max_tokens": CONTEXT}, 400,
         "prompt", "maximum context length is 512"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "w3"}, 404, "model", "does not exist"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, 400,
         "messages.0.content", "Missing required parameter"),
        ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", "at least 1"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(server, path, body, status, param, words):
    """Each bad request gets its status and OpenAI's error shape naming the field."""
    res = _post(server, path, body)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_client_sees_errors_and_the_server_keeps_serving(server):
    """The openai client raises BadRequestError for an unknown field; the next request works."""
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        server.client.completions.create(model=NAME, prompt="w3", extra_body={"frobnicate": 1})
    out = server.client.completions.create(model=NAME, prompt="w3", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    server.wait_idle()


def _long_stream(server, client: httpx.Client):
    body = {"model": NAME, "prompt": "w3 w9", "max_tokens": CONTEXT - 8, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    return client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60)


def test_disconnect_aborts_and_a_full_queue_answers_503(server):
    """Eight long streams fill the admission bound: the ninth request gets 503 with
    Retry-After. Closing the streams aborts their requests: every block is free again long
    before the 2 x 504 steps the two static batches would take."""
    before = server.health()["steps"]
    with httpx.Client() as client:
        streams = [_long_stream(server, client) for _ in range(PENDING)]
        responses = [s.__enter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)
        assert server.health()["pending"] == PENDING
        full = _post(server, "/v1/completions", {"model": NAME, "prompt": "w3"})
        assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
        assert full.json()["error"]["type"] == "server_overloaded"
        for s in streams:
            s.__exit__(None, None, None)
    health = server.wait_idle()
    assert health["steps"] - before < CONTEXT - 8, health


def test_sigterm_lets_running_requests_finish_and_exits_0(server):
    """SIGTERM during a streamed answer: the answer completes (finish_reason "length",
    [DONE]), new connections are refused, the process exits 0."""
    body = {
        "model": NAME,
        "prompt": "w3 w9",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as res:
        lines = res.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        os.kill(server.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # the listening socket closes at once; the stream goes on
            try:
                httpx.get(f"{server.url}/health", timeout=2)
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        rest = [line for line in lines if line.startswith("data:")]
    events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    server.proc.join(60)
    assert server.proc.exitcode == 0, server.output()
