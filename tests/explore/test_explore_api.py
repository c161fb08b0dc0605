"""The explorer's JSON API, served for real on 127.0.0.1 (port 0) from a thread.

Checks what the page relies on: weights sum to 1 over allowed keys, masked positions are
exactly 0, shapes follow the model's layers and heads, the KV-cache step agrees with the
full pass, padding never leaks, and every bad input gets a clear JSON message.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch

from handformer.cli.explore import register, run_explore
from handformer.config import ModelConfig
from handformer.explore.explorer import Explorer
from handformer.explore.run import load_explore_run
from handformer.explore.server import MAX_BODY, ExploreServer, RemoteBindError, is_loopback
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import RunFolderError, load_run, save_run
from handformer.runs.metrics import read_loss_curve
from handformer.tokenizers import CharTokenizer

TEXT = "the quick brown fox jumps over the lazy dog.\n"
N_LAYERS, N_HEADS, MAX_LEN = 2, 4, 16


# -- run folders --------------------------------------------------------------------------
def make_lm_run(run_dir: Path, *, attention: str = "sdpa", train_steps: int = 0,
                n_layers: int = N_LAYERS, max_len: int = MAX_LEN) -> Path:
    """A tiny character LM run folder (optionally trained a few steps, with a real
    metrics.jsonl) written by the project's own ``save_run``."""
    torch.manual_seed(0)
    tok = CharTokenizer.from_text(TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=N_HEADS,
                      n_layers=n_layers, max_len=max_len, attention=attention)
    model = DecoderLM(cfg)
    lines = []
    if train_steps:
        data = torch.tensor(tok.encode(TEXT * 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(1, train_steps + 1):
            starts = torch.randint(0, len(data) - max_len - 1, (16,))
            x = torch.stack([data[s:s + max_len] for s in starts])  # (B, T)
            y = torch.stack([data[s + 1:s + max_len + 1] for s in starts])  # (B, T)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            lines.append({"kind": "train", "step": step, "loss": loss.item(), "lr": 1e-2})
            if step % 10 == 0:
                lines.append({"kind": "eval", "step": step, "val_loss": loss.item() + 0.1})
    model.eval()
    save_run(run_dir, model, tok, extra={"summary": {"final_val_loss": float("nan")}})
    with (run_dir / "metrics.jsonl").open("w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in lines)
    return run_dir


def make_classifier_run(run_dir: Path) -> Path:
    """An (untrained) encoder-classifier run folder, written by the project's own
    ``save_run``."""
    from handformer.config import ClassifierConfig
    from handformer.data.classification import LabelVocab
    from handformer.models.encoder import EncoderClassifier

    torch.manual_seed(0)
    tok = CharTokenizer.from_text(TEXT)
    cfg = ClassifierConfig(
        encoder=ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=N_HEADS,
                            n_layers=N_LAYERS, max_len=MAX_LEN, attention="sdpa"),
        num_classes=3, pooling="cls")
    model = EncoderClassifier(cfg).eval()
    return save_run(run_dir, model, tok, labels=LabelVocab(["neg", "neutral", "pos"]))


# -- a server in a thread -----------------------------------------------------------------
@dataclass
class Client:
    server: ExploreServer

    def _open(self, req: urllib.request.Request) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        return self._open(urllib.request.Request(self.server.url.rstrip("/") + path))

    def post(self, path: str, body: Any, content_type: str = "application/json"
             ) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self._open(urllib.request.Request(
            self.server.url.rstrip("/") + path, data=data,
            headers={"Content-Type": content_type}))

    def ok(self, path: str, body: Any) -> dict[str, Any]:
        status, payload = self.post(path, body)
        assert status == 200, payload
        return payload


def serve(run_dir: Path) -> Iterator[Client]:
    server = ExploreServer(Explorer(load_explore_run(run_dir)), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Client(server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lm_run(tmp_path_factory.mktemp("explore") / "lm", train_steps=20)


@pytest.fixture(scope="module")
def client(lm_dir: Path) -> Iterator[Client]:
    yield from serve(lm_dir)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    yield from serve(make_classifier_run(tmp_path_factory.mktemp("explore") / "clf"))


def assert_softmax_rows(weights: list, allowed: list) -> None:
    """Each row sums to 1 over its allowed keys (0 if it has none); masked cells are 0."""
    for w_row, a_row in zip(weights, allowed, strict=True):
        assert all(w == 0.0 for w, a in zip(w_row, a_row, strict=True) if not a)
        expected = 1.0 if any(a_row) else 0.0
        assert math.isclose(sum(w_row), expected, abs_tol=1e-4)


# -- info -----------------------------------------------------------------------------------
def test_info_describes_model_loss_curve_and_config(client: Client) -> None:
    status, info = client.get("/api/info")
    assert status == 200
    assert info["kind"] == "lm"
    assert (info["model"]["n_layers"], info["model"]["n_heads"]) == (N_LAYERS, N_HEADS)
    assert info["model"]["attention"] == "sdpa" and "manual" in info["kernel_note"]
    assert len(info["loss_curve"]["train"]) == 20 and len(info["loss_curve"]["val"]) == 2
    assert info["summary"]["final_val_loss"] is None  # NaN → null: strict JSON
    assert info["config"]["model"]["max_len"] == MAX_LEN


def test_loss_curve_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 3.0}\n[1]\n'
                    '{"kind": "eval", "step": 1, "val_loss": null}\n'
                    '{"kind": "eval", "step": 2, "val_loss": 2.5}\n{"kind": "tr', encoding="utf-8")
    curve = read_loss_curve(path)
    assert curve.train == [(1, 3.0)] and curve.val == [(2, 2.5)]
    assert curve.skipped_lines == 2
    assert read_loss_curve(tmp_path / "missing.jsonl").train == []


def test_bad_run_folders_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="not found"):
        load_explore_run(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(RunFolderError, match="missing"):
        load_explore_run(tmp_path / "half")


# -- attention --------------------------------------------------------------------------------
def test_attention_every_layer_and_head(client: Client) -> None:
    prompt = "the lazy fox"
    t = len(prompt)
    for layer in range(N_LAYERS):
        all_heads = client.ok("/api/attention", {"prompt": prompt, "layer": layer, "head": "all"})
        assert all_heads["heads"] == list(range(N_HEADS))
        assert len(all_heads["weights"]) == N_HEADS
        assert all_heads["allowed"] == [[int(j <= i) for j in range(t)] for i in range(t)]
        for head in range(N_HEADS):
            one = client.ok("/api/attention", {"prompt": prompt, "layer": layer, "head": head})
            assert one["tokens"] == list(prompt)
            assert len(one["weights"]) == 1 and len(one["weights"][0]) == t
            assert all(len(row) == t for row in one["weights"][0])
            assert one["weights"][0] == all_heads["weights"][head]
            assert_softmax_rows(one["weights"][0], one["allowed"])


def test_attention_matches_a_hand_computation_of_layer_0(client: Client, lm_dir: Path) -> None:
    """The served weights are softmax(q·kᵀ/√D) of the first layer, computed here by hand."""
    loaded = load_run(lm_dir, kind="lm")
    model, tok = loaded.model, loaded.tokenizer
    prompt = "over the dog"
    ids = torch.tensor([tok.encode(prompt)])  # (1, T)
    t = ids.shape[1]
    with torch.no_grad():
        x = model.embed.token(ids) + model.embed.positions(torch.arange(t))  # (1, T, C)
        block = model.blocks[0]
        q, k, _ = block.self_attn.in_proj(block.norm1(x)).split(32, dim=-1)  # 3 × (1, T, C)
        q = q.view(1, t, N_HEADS, 8).transpose(1, 2)  # (1, H, T, D)
        k = k.view(1, t, N_HEADS, 8).transpose(1, 2)  # (1, H, T, D)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)  # (1, H, T, T)
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        expected = torch.softmax(scores, dim=-1)[0]  # (H, T, T)
    served = client.ok("/api/attention", {"prompt": prompt, "layer": 0, "head": "all"})
    torch.testing.assert_close(torch.tensor(served["weights"], dtype=torch.float32), expected,
                               atol=2e-5, rtol=0)


def test_unknown_characters_become_unk_with_a_notice(client: Client) -> None:
    answer = client.ok("/api/attention", {"prompt": "the Ω fox", "layer": 0, "head": 0})
    assert answer["tokens"][4] == "<unk>"
    assert any("'Ω'" in n and "<unk>" in n for n in answer["notices"])


def test_a_prompt_longer_than_the_window_keeps_its_last_tokens(client: Client) -> None:
    """A language model continues from the end of its context, so the crop keeps the LAST
    ``max_len`` tokens (as ``generate`` does) — and the weights are those of that text."""
    prompt = "abcdefghijklmnopqrstuvwxyz"  # every letter is in the vocabulary: no <unk>
    answer = client.ok("/api/attention", {"prompt": prompt, "layer": 1, "head": 2})
    kept = prompt[-MAX_LEN:]
    assert answer["tokens"] == list(kept)
    assert answer["ids"][-1] != answer["ids"][0]
    assert any("26 tokens" in n and f"last {MAX_LEN}" in n
               and f"first {26 - MAX_LEN} were dropped" in n for n in answer["notices"])
    assert_softmax_rows(answer["weights"][0], answer["allowed"])
    alone = client.ok("/api/attention", {"prompt": kept, "layer": 1, "head": 2})
    assert alone["notices"] == [] and alone["weights"] == answer["weights"]


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "", "layer": 0, "head": 0}, "empty"),
    ({"layer": 0, "head": 0}, "missing field 'prompt'"),
    ({"prompt": 5, "layer": 0, "head": 0}, "must be text"),
    ({"prompt": "the", "layer": N_LAYERS, "head": 0}, f"[0, {N_LAYERS - 1}]"),
    ({"prompt": "the", "layer": 0, "head": N_HEADS}, "head must be 'all'"),
    ({"prompt": "the", "layer": 0, "head": "some"}, "head index or 'all'"),
    ({"prompt": "the", "layer": True, "head": 0}, "integer"),
])
def test_bad_attention_requests_get_a_400_message(client: Client, body: dict,
                                                  message: str) -> None:
    status, answer = client.post("/api/attention", body)
    assert status == 400
    assert message in answer["error"]
    assert "Traceback" not in answer["error"]


def test_malformed_requests(client: Client) -> None:
    status, answer = client.post("/api/attention", b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]
    status, answer = client.post("/api/attention", [1, 2])
    assert status == 400 and "JSON object" in answer["error"]
    status, answer = client.post("/api/attention", b"prompt=x", "application/x-www-form-urlencoded")
    assert status == 415
    status, answer = client.post("/api/nothing", {})
    assert status == 404 and "no API endpoint" in answer["error"]
    status, answer = client.get("/etc/passwd")
    assert status == 404


def test_bodies_over_the_limit_get_413_and_the_server_keeps_serving(client: Client) -> None:
    host, port = client.server.server_address[:2]
    for size in (MAX_BODY + 1, 4 * MAX_BODY):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        body = json.dumps({"prompt": "x" * size}).encode()
        conn.request("POST", "/api/attention", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        conn.close()
        assert resp.status == 413
        assert f"limit of {MAX_BODY} bytes" in answer["error"]
    assert client.ok("/api/attention", {"prompt": "ok", "layer": 0, "head": 0})["tokens"]


def test_a_foreign_host_header_is_refused(client: Client) -> None:
    host, port = client.server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/api/info", headers={"Host": "attacker.example:80"})
    resp = conn.getresponse()
    assert resp.status == 403 and "Host" in json.loads(resp.read())["error"]
    conn.close()


def test_the_page_is_served_and_loads_nothing_from_elsewhere(client: Client) -> None:
    with urllib.request.urlopen(client.server.url, timeout=30) as resp:
        html = resp.read().decode()
        csp = resp.headers["Content-Security-Policy"]
    assert '<script src="/static/app.js">' in html and "default-src 'self'" in csp
    static = resources.files("handformer.explore").joinpath("static")
    for name in ("index.html", "app.js", "style.css"):
        text = static.joinpath(name).read_text(encoding="utf-8")
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} refers to {urls}: the page must work offline"
        with urllib.request.urlopen(client.server.url + ("" if name == "index.html" else
                                                         f"static/{name}"), timeout=30) as r:
            assert r.status == 200


# -- generation with the KV cache --------------------------------------------------------------
def test_generation_steps_over_the_cache_like_the_full_pass(client: Client) -> None:
    prompt = "the qui"
    start = client.ok("/api/generate/start", {"prompt": prompt, "layer": 1, "head": 3})
    assert start["cache"] == {"filled": len(prompt), "capacity": MAX_LEN}
    assert len(start["weights"]) == 1 and len(start["weights"][0]) == len(prompt)
    assert len(start["next"]) == 10
    probs = [e["prob"] for e in start["next"]]
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6

    step = client.ok("/api/generate/step", {"session": start["session"], "layer": 1,
                                            "head": 3, "temperature": 0})
    assert step["chosen"]["id"] == start["next"][0]["id"]  # greedy = the top bar
    assert step["drawn_from"] == start["next"]
    assert step["cache"]["filled"] == len(prompt) + 1
    row = step["weights"][0]  # (S,) the new token's query over every cached key
    assert len(row) == len(prompt) + 1 and math.isclose(sum(row), 1.0, abs_tol=1e-4)

    # The cached step equals the last row of the full (uncached) pass over the same text.
    text = prompt + step["chosen"]["token"]
    full = client.ok("/api/attention", {"prompt": text, "layer": 1, "head": 3})
    torch.testing.assert_close(torch.tensor(row), torch.tensor(full["weights"][0][-1]),
                               atol=2e-5, rtol=0)

    other = client.ok("/api/generate/view", {"session": start["session"], "layer": 0,
                                             "head": "all"})
    assert len(other["weights"]) == N_HEADS and other["cache"] == step["cache"]


def test_generation_stops_at_a_full_window(client: Client) -> None:
    prompt = "abcdefghijklmnopqrstuvwxyz"
    start = client.ok("/api/generate/start", {"prompt": prompt, "layer": 0, "head": 0})
    assert start["cache"]["filled"] == MAX_LEN - 1  # cropped, leaving room for one step
    assert start["tokens"] == list(prompt[-(MAX_LEN - 1):])  # the end continues, not the start
    assert any(f"first {26 - MAX_LEN + 1} were dropped" in n for n in start["notices"])
    body = {"session": start["session"], "layer": 0, "head": 0, "temperature": 1.0, "top_k": 5}
    assert client.ok("/api/generate/step", body)["window_full"] is True
    status, answer = client.post("/api/generate/step", body)
    assert status == 400 and "window is full" in answer["error"]


def test_generation_bad_input(client: Client) -> None:
    status, answer = client.post("/api/generate/step", {"session": "nope", "layer": 0,
                                                        "head": 0})
    assert status == 400 and "press Start" in answer["error"]
    start = client.ok("/api/generate/start", {"prompt": "a", "layer": 0, "head": 0})
    status, answer = client.post("/api/generate/step", {"session": start["session"],
                                                        "temperature": -1})
    assert status == 400 and "temperature" in answer["error"]
    status, answer = client.post("/api/generate/start", {"prompt": "", "layer": 0, "head": 0})
    assert status == 400 and "empty" in answer["error"]


def test_concurrent_requests_are_served_consistently(client: Client) -> None:
    expected = client.ok("/api/attention", {"prompt": "brown", "layer": 1, "head": "all"})
    start = client.ok("/api/generate/start", {"prompt": "dog", "layer": 0, "head": 0})
    first_step = client.ok("/api/generate/step", {"session": start["session"],
                                                  "temperature": 0})
    failures: list[str] = []
    rounds_done = [0] * 4

    def worker(i: int) -> None:
        # An exception in a thread is not the test's: catch it, or a crash would pass.
        try:
            for _ in range(4):
                start = client.ok("/api/generate/start", {"prompt": "dog", "layer": 0,
                                                          "head": 0})
                step = client.ok("/api/generate/step", {"session": start["session"],
                                                        "temperature": 0})
                if (step["chosen"], step["weights"]) != (first_step["chosen"],
                                                          first_step["weights"]):
                    failures.append(f"thread {i}: generation step differs")
                got = client.ok("/api/attention", {"prompt": "brown", "layer": 1,
                                                   "head": "all"})
                if got["weights"] != expected["weights"]:
                    failures.append(f"thread {i}: weights differ")
                rounds_done[i] += 1
        except BaseException as err:
            failures.append(f"thread {i}: {err!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a request hung"
    assert not failures
    assert rounds_done == [4] * 4


def test_a_burst_of_200_connections_is_queued_and_every_one_answered(lm_dir: Path) -> None:
    """200 page loads at once: every connection completes its handshake while the server is
    still busy (the listen backlog holds them; the standard library's 5 dropped the rest,
    which then waited up to a minute for a retry), and every one gets its answer."""
    server = ExploreServer(Explorer(load_explore_run(lm_dir)), "127.0.0.1", 0)
    host, port = server.server_address[:2]
    socks: list[socket.socket] = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    try:
        for _ in range(200):  # before the server accepts anything: only the backlog holds them
            sock = socket.create_connection((host, port), timeout=3)
            socks.append(sock)
        thread.start()
        for sock in socks:
            sock.sendall(b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close"
                         b"\r\n\r\n")
        deadline = time.monotonic() + 60
        answers = []
        for sock in socks:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            answers.append(data.split(b"\r\n", 1)[0])
        assert [a.split(b" ", 1)[1] for a in answers] == [b"200 OK"] * 200
    finally:
        for sock in socks:
            sock.close()
        if thread.is_alive():
            server.shutdown()
        server.server_close()
        thread.join(timeout=10)  # the thread's hold on the server ends here, not at exit


def test_stopping_waits_for_work_not_for_idle_connections(lm_dir: Path) -> None:
    """Handler threads are joined when the server closes (a daemon thread cut off inside
    torch at exit aborts the process); a client that only holds its connection open does
    not keep the server from stopping."""
    server = ExploreServer(Explorer(load_explore_run(lm_dir)), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    idle = socket.create_connection(server.server_address[:2], timeout=5)
    try:
        time.sleep(0.2)  # accepted, its handler waiting for a request line
        started = time.monotonic()
        server.shutdown()
        server.server_close()
        assert time.monotonic() - started < server.idle_timeout  # woken, not timed out
        assert idle.recv(1) == b""  # its handler ended and closed the connection
    finally:
        idle.close()
        thread.join(timeout=10)


# -- padded batches ----------------------------------------------------------------------------
@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_padded_keys_get_exactly_zero_weight(client: Client, pad_side: str) -> None:
    sentences = ["the", "quick brown", "a lazy dog jumps"]
    answer = client.ok("/api/batch", {"sentences": sentences, "layer": 1, "head": "all",
                                      "pad_side": pad_side})
    assert answer["max_weight_on_padded_keys"] == 0.0
    assert any("not a classifier run" in n for n in answer["notices"])
    t = max(len(s) for s in sentences)
    assert len(answer["weights"]) == 3 and len(answer["weights"][0]) == N_HEADS
    for text, row, weights, allowed in zip(sentences, answer["rows"], answer["weights"],
                                           answer["allowed"], strict=True):
        n, pad = len(text), t - len(text)
        real = [1] * n + [0] * pad if pad_side == "right" else [0] * pad + [1] * n
        assert row["real"] == real
        assert [tok for tok, r in zip(row["tokens"], real, strict=True) if r] == list(text)
        # An LM applies its causal mask on top of the padding mask.
        assert allowed == [[int(real[j] and j <= i) for j in range(t)] for i in range(t)]
        for head_weights in weights:
            assert_softmax_rows(head_weights, allowed)
            for query in head_weights:
                assert all(w == 0.0 for w, r in zip(query, row["real"], strict=True) if not r)


def test_a_padded_sentence_attends_as_it_does_alone(client: Client) -> None:
    batch = client.ok("/api/batch", {"sentences": ["fox", "the quick"], "layer": 1,
                                     "head": 2, "pad_side": "right"})
    alone = client.ok("/api/attention", {"prompt": "fox", "layer": 1, "head": 2})
    padded = torch.tensor(batch["weights"][0][0])[:3, :3]  # real queries × real keys
    torch.testing.assert_close(padded, torch.tensor(alone["weights"][0]), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("body", "message"), [
    ({"sentences": [], "layer": 0, "head": 0}, "is empty"),
    ({"sentences": ["a", ""], "layer": 0, "head": 0}, "sentence 2 is empty"),
    ({"sentences": ["a"] * 9, "layer": 0, "head": 0}, "at most 8"),
    ({"sentences": "a", "layer": 0, "head": 0}, "list of texts"),
    ({"sentences": ["a"], "layer": 0, "head": 0, "pad_side": "up"}, "pad_side"),
])
def test_bad_batches(client: Client, body: dict, message: str) -> None:
    status, answer = client.post("/api/batch", body)
    assert status == 400 and message in answer["error"]


def test_classifier_run_shows_padding_without_causal_mask(classifier: Client) -> None:
    _, info = classifier.get("/api/info")
    assert info["kind"] == "classifier" and info["labels"] == ["neg", "neutral", "pos"]
    answer = classifier.ok("/api/batch", {"sentences": ["the dog", "a quick brown fox"],
                                          "layer": 1, "head": "all"})
    assert answer["max_weight_on_padded_keys"] == 0.0
    row0 = answer["rows"][0]
    assert row0["tokens"][:3] == ["<bos>", "t", "h"]  # as the classifier was trained
    real = row0["real"]
    # Bidirectional: a real query may attend to every real key, later ones included.
    assert answer["allowed"][0] == [[int(r) for r in real] for _ in real]
    for head_weights in answer["weights"][0]:
        assert_softmax_rows(head_weights, answer["allowed"][0])
    assert len(answer["predictions"]) == 2
    for pred in answer["predictions"]:
        assert math.isclose(sum(pred["probs"]), 1.0, abs_tol=1e-4)
        best = max(range(len(pred["probs"])), key=pred["probs"].__getitem__)
        assert pred["label"] == info["labels"][best]
    status, refused = classifier.post("/api/generate/start", {"prompt": "the"})
    assert status == 400 and "language-model run" in refused["error"]


def test_classifier_keeps_the_start_of_a_long_text(classifier: Client) -> None:
    long_text = "abcdefghijklmnopqrstuvwxyz"
    answer = classifier.ok("/api/attention", {"prompt": long_text, "layer": 0, "head": 0})
    assert answer["tokens"] == ["<bos>", *long_text[:MAX_LEN - 1]]
    assert any(f"first {MAX_LEN - 1}" in n and "dropped" in n for n in answer["notices"])
    assert answer["allowed"] == [[1] * MAX_LEN] * MAX_LEN  # bidirectional, no padding


def test_other_run_folders_fail_clearly(tmp_path: Path) -> None:
    run_dir = make_classifier_run(tmp_path / "clf")
    (run_dir / "labels.json").write_text('{"labels": ["a", "b"]}', encoding="utf-8")
    with pytest.raises(RunFolderError, match="2 labels but the model has 3 classes"):
        load_explore_run(run_dir)
    (run_dir / "labels.json").unlink()
    with pytest.raises(RunFolderError, match=r"missing \[.labels\.json.\]"):
        load_explore_run(run_dir)
    (run_dir / "config.json").write_text('{"seq2seq": {}}', encoding="utf-8")
    with pytest.raises(RunFolderError, match="seq2seq run"):
        load_explore_run(run_dir)


def test_a_diverged_model_gets_a_message_not_a_crash(lm_dir: Path) -> None:
    explorer = Explorer(load_explore_run(lm_dir))
    with torch.no_grad():
        explorer.run.model.blocks[0].self_attn.in_proj.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or Inf attention weights"):
        explorer.attention("the", 0, 0)


# -- binding and the command line --------------------------------------------------------------
def test_refuses_non_loopback_addresses_unless_allowed(lm_dir: Path) -> None:
    explorer = Explorer(load_explore_run(lm_dir))
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    for host in ("0.0.0.0", "192.168.1.5", "example.com"):
        with pytest.raises(RemoteBindError, match="--allow-remote"):
            ExploreServer(explorer, host, 0)
    server = ExploreServer(explorer, "0.0.0.0", 0, allow_remote=True)
    try:
        assert server.server_address[1] > 0 and not server.check_host_header
    finally:
        server.server_close()


def test_a_signal_stops_the_loop_between_requests_and_handlers_come_back(
        lm_dir: Path) -> None:
    """While serving, SIGINT and SIGTERM belong to the server — already when ``on_ready``
    runs (where the CLI prints the URL a client may then signal by): the first one stops the
    loop (not a ``KeyboardInterrupt`` inside it, which could land while a handler thread is
    being started), the request before it was answered, and the previous handlers are back
    after."""
    server = ExploreServer(Explorer(load_explore_run(lm_dir)), port=0)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen: dict[str, Any] = {}

    def probe() -> None:
        try:
            with urllib.request.urlopen(server.url + "api/info", timeout=30) as resp:
                seen["status"] = resp.status
            seen["installed"] = {s: signal.getsignal(s) is not before[s] for s in before}
        finally:
            if all(seen.get("installed", {}).values()):
                os.kill(os.getpid(), signal.SIGINT)  # only into a handler that is there
            else:
                server.shutdown()
    def on_ready() -> None:
        seen["ready"] = {s: signal.getsignal(s) is not before[s] for s in before}
        threading.Thread(target=probe, daemon=True).start()

    assert server.serve_until_stopped(on_ready) == signal.SIGINT
    assert seen == {"status": 200, "ready": {signal.SIGINT: True, signal.SIGTERM: True},
                    "installed": {signal.SIGINT: True, signal.SIGTERM: True}}
    assert {s: signal.getsignal(s) for s in before} == before
    assert server.socket.fileno() == -1  # closed


def test_the_signal_helper_is_done_with_the_server_when_serving_returns(
        lm_dir: Path) -> None:
    """The helper thread that a signal starts holds the server (it calls ``shutdown``);
    serving returns only once that thread has ended, so the server and its model are freed
    by the caller, never by a daemon thread still running while the interpreter tears down
    (cut off inside torch's tensor destructor, the process aborts). ``shutdown`` is slowed
    here so a helper left running would still be seen."""
    class SlowToStop(ExploreServer):
        def shutdown(self) -> None:
            super().shutdown()
            time.sleep(0.5)

    server = SlowToStop(Explorer(load_explore_run(lm_dir)), port=0)

    def on_ready() -> None:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()

    assert server.serve_until_stopped(on_ready) == signal.SIGTERM
    assert [t.name for t in threading.enumerate() if t.name == "explore-stop"] == []


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="handformer")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_serves_prints_the_url_and_stops(lm_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["explore", "--run", str(lm_dir), "--port", "0"])
    assert args.handler is run_explore
    seen: dict[str, Any] = {}

    def on_ready(server: ExploreServer) -> None:
        def probe() -> None:
            try:
                with urllib.request.urlopen(server.url + "api/info", timeout=30) as resp:
                    seen["kind"] = json.load(resp)["kind"]
            finally:
                server.shutdown()
        threading.Thread(target=probe, daemon=True).start()

    assert run_explore(args, on_ready=on_ready) == 0
    assert seen["kind"] == "lm"
    assert re.search(r"http://127\.0\.0\.1:\d+/", capsys.readouterr().out)


def test_cli_errors_are_one_line_messages(lm_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert run_explore(_parse(["explore", "--run", str(tmp_path / "none")])) == 1
    assert "run folder not found" in capsys.readouterr().err
    assert run_explore(_parse(["explore", "--run", str(lm_dir), "--host", "0.0.0.0"])) == 2
    assert "--allow-remote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["explore", "--run", str(lm_dir), "--port", "70000"])


def test_an_id_past_a_padded_vocabulary_is_shown_not_an_error() -> None:
    """A published model pads its vocabulary past its tokenizer: such ids have embeddings
    and can be sampled, and the page names them instead of answering 500."""
    from handformer.explore.prompts import token_text
    from handformer.tokenizers import BPETokenizer

    tok = BPETokenizer.train("the quick brown fox " * 20, vocab_size=270)
    char = CharTokenizer.from_text("abc")
    assert token_text(tok, tok.vocab_size + 3) == f"<id {tok.vocab_size + 3}>"
    assert token_text(char, char.vocab_size) == f"<id {char.vocab_size}>"
    assert token_text(char, char.stoi["a"]) == "a"
