"""``handformer serve`` as a user runs it: a real process, the same text as ``handformer
generate --temperature 0``, and SIGTERM finishing the stream in flight before exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from handformer.runs import save_run  # noqa: E402
from tests.serve.helpers import TOKENIZER, tiny_lm  # noqa: E402
from tests.serve.server import ENV, running_server  # noqa: E402


def _handformer(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handformer", *args], capture_output=True,
                          text=True, env=ENV, timeout=120, **kwargs)


@pytest.mark.slow
def test_serve_answers_what_generate_prints_and_sigterm_finishes_in_flight(tmp_path) -> None:
    run = save_run(tmp_path / "run", tiny_lm(max_len=64), TOKENIZER)
    with running_server(run, "--kv-blocks", "16", "--block-size", "4") as (server, base):
        answer = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "run", "prompt": "the cat ", "max_tokens": 40, "temperature": 0})
        text = answer.json()["choices"][0]["text"]
        printed = _handformer("generate", "--run", str(run), "--prompt", "the cat ",
                              "--temperature", "0", "--max-new-tokens", "40")
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout == "the cat " + text + "\n"

        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "run", "prompt": "a", "max_tokens": 400, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        server.send_signal(signal.SIGTERM)
        reader.join(60)
        _, err = server.communicate(timeout=60)
        assert server.returncode == 0, err
        assert events[-1] == "data: [DONE]"  # the request in flight was finished
        last = json.loads(events[-2][6:])["choices"][0]
        assert last["finish_reason"] in ("length", "stop")
        assert "Traceback" not in err and "stopped" in err
        # The test extras install uvicorn's C loop and parser, as handformer[serve] does.
        assert "; uvloop + httptools" in err.splitlines()[1], err


def test_without_the_c_loop_and_parser_uvicorn_serves_on_asyncio_and_h11(monkeypatch) -> None:
    from handformer.cli.serve import event_loop_and_http

    assert event_loop_and_http() == ("uvloop", "httptools")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import that fails
    assert event_loop_and_http() == ("asyncio", "httptools")
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert event_loop_and_http() == ("asyncio", "h11")


def test_binding_beyond_loopback_needs_an_api_key(tmp_path) -> None:
    result = _handformer("serve", "--run", str(tmp_path), "--host", "0.0.0.0")
    assert result.returncode == 2
    assert "--api-key" in result.stderr and "Traceback" not in result.stderr


def test_matmul_choice_packs_only_float32_cpu_weights(capsys) -> None:
    import argparse

    import torch

    from handformer.cli.common import UsageError
    from handformer.cli.serve import _pick_matmul
    from handformer.models.packing import packed_layers
    from handformer.nn.packed import onednn_packing_available

    def args(matmul: str, dtype: str = "float32") -> argparse.Namespace:
        return argparse.Namespace(matmul=matmul, dtype=dtype, device="cpu", max_batch=4)

    model = tiny_lm()
    _pick_matmul(model, args("blas"))
    assert not packed_layers(model)
    assert "float32 matrix products: blas (--matmul blas)" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--matmul onednn is for float32 weights on the "
                       "CPU; got --dtype bfloat16"):
        _pick_matmul(tiny_lm().to(torch.bfloat16), args("onednn", "bfloat16"))
    _pick_matmul(tiny_lm().to(torch.bfloat16), args("auto", "bfloat16"))  # nothing to say
    assert capsys.readouterr().err == ""
    if onednn_packing_available():
        _pick_matmul(model, args("onednn"))
        assert len(packed_layers(model)) == len(
            [m for m in tiny_lm().modules() if type(m) is torch.nn.Linear])
        _pick_matmul(tiny_lm(), args("auto"))
        assert "— measured over" in capsys.readouterr().err


def test_what_the_engine_process_refuses_is_one_line_from_serve(tmp_path) -> None:
    missing = _handformer("serve", "--run", str(tmp_path))
    assert missing.returncode == 1
    assert missing.stderr.splitlines() == [
        f"handformer serve: error: {tmp_path} is not a complete run folder: missing "
        "['model.safetensors', 'config.json', 'tokenizer.json']"]
    run = save_run(tmp_path / "run", tiny_lm(), TOKENIZER)
    usage = _handformer("serve", "--run", str(run), "--dtype", "bfloat16", "--matmul",
                        "onednn")
    assert usage.returncode == 2
    assert usage.stderr.splitlines() == [
        "handformer serve: error: --matmul onednn is for float32 weights on the CPU; got "
        "--dtype bfloat16, --device cpu (see handformer serve --help)"]
