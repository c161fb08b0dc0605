"""The public API documents itself: every exported name has a docstring, the main classes'
docstrings answer what a user asks (shapes, mask polarity, defaults, errors), and every CLI
command's ``--help`` carries examples that the real parser accepts."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import shlex
from pathlib import Path

import pytest

import handformer
from handformer.cli import build_parser
from handformer.cli.examples import EXAMPLES, iter_commands

ROOT = Path(__file__).resolve().parent.parent

# The modules a reader of the tour imports from, besides the package itself.
USER_FACING_MODULES = [
    "handformer.masks", "handformer.loss", "handformer.data", "handformer.tokenizers",
    "handformer.generate", "handformer.config", "handformer.nn.attention",
    "handformer.nn.positional", "handformer.nn.block", "handformer.nn.feedforward",
    "handformer.nn.kv_cache", "handformer.nn.tiled_attention", "handformer.models.embedding",
    "handformer.models.decoder_lm", "handformer.models.budget",
    "handformer.models.encoder", "handformer.models.seq2seq", "handformer.doctor",
    "handformer.train.trainer", "handformer.train.checkpoint", "handformer.interop.torch_nn",
    "handformer.learn",
]


def own_docstring(obj: object) -> str:
    """The object's own docstring: not inherited, and not the signature a dataclass writes
    when the class has none."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__  # type: ignore[union-attr]
    doc = (doc or "").strip()
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(
            f"{obj.__name__}("):
        return ""
    return doc


def undocumented_members(cls: type) -> list[str]:
    """Public methods and properties defined on ``cls`` itself that have no docstring."""
    missing = []
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        if inspect.isfunction(fn) and not (fn.__doc__ or "").strip():
            missing.append(f"{cls.__name__}.{name}")
    return missing


def test_every_name_exported_by_handformer_has_a_docstring() -> None:
    missing = []
    for name in handformer.__all__:
        obj = getattr(handformer, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if not own_docstring(obj):
                missing.append(name)
            if inspect.isclass(obj):
                missing += undocumented_members(obj)
        elif name != "__version__":
            # A constant is documented where it is defined: its module's docstring names it.
            homes = [m for m in USER_FACING_MODULES
                     if name in getattr(importlib.import_module(m), "__all__", ())]
            if not any(name in (importlib.import_module(m).__doc__ or "") for m in homes):
                missing.append(f"{name} (constant not described in {homes})")
    assert not missing, f"public names without a docstring: {missing}"


@pytest.mark.parametrize("module_name", USER_FACING_MODULES)
def test_user_facing_modules_document_what_they_export(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert (module.__doc__ or "").strip(), f"{module_name} has no module docstring"
    missing = []
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        home = obj.__module__
        if home != module_name and not home.startswith(module_name + "."):
            continue  # re-exported from elsewhere: checked where it is defined
        if not own_docstring(obj):
            missing.append(name)
    assert not missing, f"{module_name}: exported without a docstring: {missing}"


def test_the_checker_sees_a_dataclass_without_a_docstring() -> None:
    @dataclasses.dataclass
    class Bare:
        x: int

    @dataclasses.dataclass
    class Documented:
        """What x is."""

        x: int

    assert own_docstring(Bare) == ""
    assert own_docstring(Documented) == "What x is."


def _full_doc(obj: object, *methods: str) -> str:
    parts = [inspect.getdoc(obj) or ""]
    parts += [inspect.getdoc(getattr(obj, m)) or "" for m in methods]
    return "\n".join(parts)


# What `help(...)` must answer for the main entry points: shapes, mask polarity, defaults and
# the errors raised. Each entry: the object, the methods whose docstrings count, and phrases
# (regular expressions) that must appear.
HELP_MUST_SAY = {
    "DecoderLM": (handformer.DecoderLM, ("__init__", "forward"),
                  [r"\(B, T\)", r"\(B, T, V\)", r"True on real tokens", r"ValueError",
                   r"make_cache", r"tie_weights"]),
    "MultiHeadAttention": (handformer.MultiHeadAttention, ("__init__", "forward"),
                           [r"\(B, T, C\)", r"True = may attend", r"ValueError",
                            r"n_kv_heads", r"[Dd]efault"]),
    "TransformerBlock": (handformer.TransformerBlock, ("__init__", "forward"),
                         [r"\(B, T, C\)", r"True = may attend", r"pre", r"post",
                          r"ValueError", r"[Dd]efault"]),
    "scaled_dot_product_attention": (handformer.scaled_dot_product_attention, (),
                                     [r"\(B, H, T, D\)", r"True", r"ValueError",
                                      r"1/√D|sqrt"]),
    "generate": (handformer.generate, (), [r"\(B, T\)", r"temperature", r"ValueError",
                                           r"True on real|real prompt tokens"]),
    "lm_loss": (handformer.lm_loss, (), [r"\(B, T, V\)", r"IGNORE_INDEX", r"ValueError"]),
    "ModelConfig": (handformer.ModelConfig, (), [r"d_ff", r"n_kv_heads", r"ValueError",
                                                 r"positional", r"attention"]),
    "TrainConfig": (handformer.TrainConfig, (), [r"warmup", r"grad_clip", r"precision",
                                                 r"ValueError"]),
    "Batch": (handformer.Batch, (), [r"\(B, T\)", r"IGNORE_INDEX", r"True on real tokens"]),
    "CharTokenizer": (handformer.CharTokenizer, (), [r"<pad>", r"<unk>", r"ValueError"]),
}


@pytest.mark.parametrize("name", sorted(HELP_MUST_SAY))
def test_main_docstrings_state_shapes_masks_defaults_and_errors(name: str) -> None:
    obj, methods, phrases = HELP_MUST_SAY[name]
    text = _full_doc(obj, *methods)
    absent = [p for p in phrases if not re.search(p, text)]
    assert not absent, f"help({name}) does not mention {absent}:\n{text}"


# -- the command line -------------------------------------------------------------------------
COMMANDS = iter_commands(build_parser())
EXAMPLE_LINE = re.compile(r"^\s+(handformer\b.*?)\s*(?:#.*)?$")


def _examples_in_help(text: str) -> list[str]:
    if "examples:" not in text:
        return []
    tail = text.split("examples:", 1)[1]
    return [m.group(1) for line in tail.splitlines() if (m := EXAMPLE_LINE.match(line))]


def test_the_commands_are_the_documented_ones() -> None:
    verbs = {path for path, _ in COMMANDS if path and " " not in path}
    assert verbs >= {"train", "generate", "classify", "seq2seq", "doctor", "explore", "embed",
                     "convert", "bench", "experiment"}
    assert not set(EXAMPLES) - {path for path, _ in COMMANDS}, "examples for unknown commands"


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: p or "handformer")
def test_every_command_help_has_examples_the_parser_accepts(path: str) -> None:
    parser = dict(COMMANDS)[path]
    text = parser.format_help()
    examples = _examples_in_help(text)
    assert examples, f"`handformer {path} --help` shows no examples:\n{text}"
    assert any(e.startswith(f"handformer {path}".strip()) for e in examples), examples
    for example in examples:
        argv = shlex.split(example)[1:]
        if "VERB" in argv:
            continue  # the placeholder line of the top-level help
        build_parser().parse_args(argv)  # SystemExit (and a usage error) if it is not valid


def test_readme_command_tables_use_real_commands_and_options() -> None:
    for readme in ("README.md", "README.zh.md"):
        rows = [line for line in (ROOT / readme).read_text(encoding="utf-8").splitlines()
                if line.startswith("| `") and "`handformer " in line]
        assert len(rows) >= 10, f"{readme}: the command table is missing"
        for row in rows:
            example = re.search(r"`(handformer [^`]+)`", row).group(1)  # type: ignore[union-attr]
            build_parser().parse_args(shlex.split(example)[1:])
