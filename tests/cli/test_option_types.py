"""The argparse types for seeds, devices and ports: a value torch cannot take is a usage error at
parse time (exit 2, naming the option), not a failure deep inside the run."""

from __future__ import annotations

import argparse

import pytest

from handformer.cli.common import SEED_RANGE, device_name, port_number, seed_int


@pytest.mark.parametrize("text", ["0", "1337", "-1", str(SEED_RANGE[0]), str(SEED_RANGE[1])])
def test_seeds_torch_takes(text: str) -> None:
    import torch

    seed = seed_int(text)
    assert torch.Generator().manual_seed(seed).initial_seed() is not None


@pytest.mark.parametrize("text", [str(2**64), str(-(2**63) - 1), str(2**70), "1.5", "x", ""])
def test_seeds_torch_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="seed"):
        seed_int(text)


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:1", "mps", "meta"])
def test_device_names(text: str) -> None:
    assert device_name(text) == text  # named well; whether it exists is checked at use


@pytest.mark.parametrize("text", ["quantum", "cuda:x", "", "gpu0"])
def test_device_typos(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda"):
        device_name(text)


@pytest.mark.parametrize("text", ["0", "1", "8000", "65535"])
def test_ports(text: str) -> None:
    assert port_number(text) == int(text)


@pytest.mark.parametrize(("text", "said"), [("-1", "in [0, 65535]; got -1"),
                                            ("65536", "in [0, 65535]; got 65536"),
                                            ("http", "port number; got 'http'"), ("", "got ''")])
def test_port_typos(text: str, said: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=said.replace("[", r"\[")
                       .replace("]", r"\]")):
        port_number(text)


def test_through_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    from handformer.cli import main

    for argv, said in [
            (["generate", "--run", "x", "--device", "quantum"],
             "argument --device: expected auto, cpu, cuda[:N] or mps; got 'quantum'"),
            (["generate", "--run", "x", "--seed", str(2**70)], "argument --seed: expected a seed"),
            (["experiment", "length", "--steps", "0"], "argument --steps: expected a positive"),
            (["experiment", "length", "--train-len", "-3"], "argument --train-len: expected")]:
        with pytest.raises(SystemExit) as stop:  # argparse's own exit: code 2
            main(argv)
        assert stop.value.code == 2
        assert said in capsys.readouterr().err
