"""LoRA: fine-tune a frozen linear layer through a low-rank update beside it.

A pretrained weight ``W`` (N, K) stays frozen; next to it sit two small matrices, ``A``
(r, K) and ``B`` (N, r), and the layer computes

    y = x·Wᵀ + b + (alpha / r) · dropout(x)·Aᵀ·Bᵀ

so the update ``ΔW = (alpha / r)·B·A`` has rank at most r and costs r·(K + N) parameters
instead of N·K. ``A`` starts as ``nn.Linear`` initialises its weights (Kaiming-uniform, as
PEFT does) and ``B`` starts at zero: at step 0 the update is exactly zero and the model is the
pretrained one. ``alpha / r`` keeps the update's size roughly independent of r, so a learning
rate found at one rank carries to another.

handformer stacks projections into one ``nn.Linear``: attention's ``in_proj`` holds q, k and v
side by side, SwiGLU's ``fc_in`` holds gate and up. Hugging Face models (and so PEFT) keep them
apart, so each *target* here is its own (A, B) pair acting on its own span of output rows:
adapting ``q`` and ``v`` of ``in_proj`` is exactly PEFT's two adapters on ``q_proj`` and
``v_proj``. ``qkv`` is one pair over the whole ``in_proj`` (GPT-2's single ``c_attn``).

Targets: ``q`` ``k`` ``v`` ``qkv`` ``o`` (attention) and ``gate`` ``up`` ``down`` (the FFN:
``up`` is the whole ``fc_in`` of an ungated FFN), or the groups ``attn`` (q, k, v, o),
``mlp`` (the FFN's) and ``all-linear`` (both). Only self-attention and the FFN are adapted;
embeddings, norms, the output head and cross-attention stay frozen.

Shape legend: ``B`` batch, ``T`` tokens, ``K`` input features, ``N`` output features (rows of
the stacked weight), ``n`` rows of one target's span, ``r`` rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.nn.attention import MultiHeadAttention
from handformer.nn.feedforward import FeedForward

__all__ = ["LORA_GROUPS", "LORA_TARGETS", "LoRAAdapter", "LoRAConfig", "LoRAError",
           "LoRALinear", "apply_lora", "lora_layers", "lora_state_dict", "merge_lora",
           "resolve_targets", "trainable_parameters"]

LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "qkv", "o", "gate", "up", "down")
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "attn": ("q", "k", "v", "o"),
    "mlp": ("gate", "up", "down"),
    "all-linear": ("q", "k", "v", "o", "gate", "up", "down"),
}


class LoRAError(ValueError):
    """A LoRA request that cannot be applied to this model (bad rank or targets)."""


@dataclass(frozen=True)
class LoRAConfig:
    """What ``apply_lora`` builds: rank ``r``, scale ``alpha / r`` (``alpha=None`` means
    ``alpha = r``, scale 1), dropout on the LoRA path, and the target names."""

    r: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")

    @property
    def scale(self) -> float:
        return (self.r if self.alpha is None else self.alpha) / self.r

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> LoRAConfig:
        targets = data.get("targets", ("q", "v"))
        if not isinstance(targets, (list, tuple)):
            raise LoRAError(f"lora targets must be a list of names; got {targets!r}")
        return cls(r=int(data["r"]),  # type: ignore[call-overload]
                   alpha=None if data.get("alpha") is None else float(data["alpha"]),  # type: ignore[arg-type]
                   dropout=float(data.get("dropout", 0.0)),  # type: ignore[arg-type]
                   targets=tuple(str(t) for t in targets))


class LoRAAdapter(nn.Module):
    """One low-rank pair for output rows ``[start, stop)`` of a stacked linear layer: its
    update is (alpha / r)·B·A (n, K). ``LoRALinear`` runs it (with the layer's other pairs)."""

    def __init__(self, in_features: int, start: int, stop: int, r: int, scale: float) -> None:
        super().__init__()
        self.start, self.stop, self.r, self.scale = start, stop, r, scale
        self.lora_A = nn.Parameter(torch.empty(r, in_features))  # (r, K)
        self.lora_B = nn.Parameter(torch.zeros(stop - start, r))  # (n, r)
        # nn.Linear's own initialisation of a (r, K) weight: the update starts at zero
        # because B does, while A already points in random directions for B to learn along.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def delta_weight(self) -> Tensor:
        """The update this pair adds to its rows: (alpha / r)·B·A, (n, K)."""
        return self.scale * (self.lora_B @ self.lora_A)


class _AddToSpans(torch.autograd.Function):
    """``out[:, start:stop] += update`` for each span, in place, with the backward an addition
    has: the incoming gradient goes on to ``out`` as it is, and each update gets its span of
    it. Autograd's own in-place slice write cannot know the op is an addition, so for every
    span it would copy the whole (M, N) gradient and zero the span before handing it on."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, spans: tuple[tuple[int, int], ...],
                *updates: Tensor) -> Tensor:
        for (start, stop), update in zip(spans, updates, strict=True):
            out[:, start:stop] += update  # (M, n)
        ctx.mark_dirty(out)
        ctx.spans = spans
        return out  # (M, N)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (grad, None, *(grad[:, start:stop] for start, stop in ctx.spans))


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` with LoRA pairs on named spans of its output rows.

    It *is* the original layer (same ``weight`` and ``bias`` parameters, same state-dict
    names), so code that reads ``layer.weight`` keeps working; the pairs live in
    ``adapters`` (state-dict names ``….adapters.<target>.lora_A`` / ``lora_B``).
    ``merge()`` folds every update into ``weight`` (then the forward is the plain layer's);
    ``unmerge()`` takes it out again.
    """

    def __init__(self, base: nn.Linear, spans: dict[str, tuple[int, int]], r: int,
                 scale: float, dropout: float) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the weights are base's, not new ones
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.r, self.scale = r, scale
        self.adapters = nn.ModuleDict({
            name: LoRAAdapter(base.in_features, start, stop, r, scale)
            for name, (start, stop) in sorted(spans.items(), key=lambda kv: kv[1])})
        self.adapters.to(device=base.weight.device, dtype=base.weight.dtype)
        self.dropout = nn.Dropout(dropout)  # on the LoRA path only, one draw per pair
        self.merged = False

    def forward(self, x: Tensor) -> Tensor:
        if self.merged:
            return F.linear(x, self.weight, self.bias)  # (…, N)
        # Rows without an adapter pass through; each adapted span gets its own update, added
        # in place into the frozen product (which backward does not need). The product is
        # taken over flattened rows so that it is a tensor of its own, not a view: autograd
        # would otherwise route the in-place write through the view's base.
        rows = x.reshape(-1, self.in_features)  # (M, K), M = all leading dims
        out = F.linear(rows, self.weight, self.bias)  # (M, N)
        pairs = list(self.adapters.values())
        # The scale goes on the narrow (M, P·r) product rather than on each (M, n) update.
        if self.dropout.training and self.dropout.p > 0.0:
            # Each pair its own dropout draw of the input, as PEFT draws one per target.
            h = torch.cat([F.linear(self.dropout(rows), p.lora_A) for p in pairs],
                          dim=1) * self.scale  # (M, P·r)
        else:
            # Every pair reads the same input: their A's run as one (P·r, K) matmul.
            a = pairs[0].lora_A if len(pairs) == 1 else torch.cat([p.lora_A for p in pairs])
            h = F.linear(rows, a) * self.scale  # (M, P·r)
        updates = [F.linear(h_p, p.lora_B)  # (M, n)
                   for h_p, p in zip(h.split(self.r, dim=1), pairs, strict=True)]
        out = _AddToSpans.apply(out, tuple((p.start, p.stop) for p in pairs), *updates)
        return out.view(*x.shape[:-1], self.out_features)  # (…, N)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold each pair's ``(alpha / r)·B·A`` into its rows of ``weight`` (idempotent)."""
        if not self.merged:
            for a in self.adapters.values():
                self.weight[a.start:a.stop] += a.delta_weight().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo ``merge()``: subtract the updates again (idempotent)."""
        if self.merged:
            for a in self.adapters.values():
                self.weight[a.start:a.stop] -= a.delta_weight().to(self.weight.dtype)
            self.merged = False

    def plain(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding the merged weight (the adapters folded in)."""
        self.merge()
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        out.weight = nn.Parameter(self.weight.detach().clone())
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.detach().clone())
        return out


# -- which rows of which layer each target name means -------------------------------------
def _attention_spans(attn: MultiHeadAttention) -> dict[str, tuple[str, tuple[int, int]]]:
    q, kv = attn.q_dim, attn.kv_dim
    return {"q": ("in_proj", (0, q)), "k": ("in_proj", (q, q + kv)),
            "v": ("in_proj", (q + kv, q + 2 * kv)), "qkv": ("in_proj", (0, q + 2 * kv)),
            "o": ("out_proj", (0, attn.out_proj.out_features))}


def _ffn_spans(ffn: FeedForward) -> dict[str, tuple[str, tuple[int, int]]]:
    rows = ffn.fc_in.out_features
    spans = {"down": ("fc_out", (0, ffn.fc_out.out_features))}
    if ffn.activation == "swiglu":  # fc_in = [gate | up], F rows each
        spans.update(gate=("fc_in", (0, rows // 2)), up=("fc_in", (rows // 2, rows)))
    else:
        spans["up"] = ("fc_in", (0, rows))
    return spans


def _sites(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, tuple[str, tuple[int, int]]]]]:
    """(module name, module, target → (linear attribute, row span)) for every self-attention
    and FFN of the model's blocks; cross-attention (``cross_attn``) is left out."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention) and not name.endswith("cross_attn"):
            found.append((name, module, _attention_spans(module)))
        elif isinstance(module, FeedForward):
            found.append((name, module, _ffn_spans(module)))
    return found


def resolve_targets(names: Iterable[str]) -> tuple[str, ...]:
    """Expand groups (``attn``, ``mlp``, ``all-linear``) into target names, in order, each
    once. Unknown names are kept, for ``apply_lora`` to refuse with what exists."""
    out: list[str] = []
    for name in names:
        for target in LORA_GROUPS.get(name.strip(), (name.strip(),)):
            if target not in out:
                out.append(target)
    return tuple(out)


def apply_lora(model: nn.Module, config: LoRAConfig, *,
               trainable: Sequence[str] = ()) -> nn.Module:
    """Put LoRA pairs on ``config.targets`` of every block of ``model`` (in place) and freeze
    every other parameter, except those whose name starts with one of ``trainable`` (a new
    classification head, say). Returns ``model``.

    Groups expand as ``resolve_targets`` says, and a group's member that this model does not
    have (``gate`` in an ungated FFN) is skipped; a name given on its own must match. Raises
    ``LoRAError`` (one line) for r ≤ 0, r larger than a targeted span's rows or inputs, a
    target that matches nothing (naming the ones that exist), ``qkv`` together with ``q``,
    ``k`` or ``v``, or a model that already has LoRA.
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise LoRAError("this model already has LoRA adapters; apply LoRA to the base model once")
    if not isinstance(config.r, int) or config.r <= 0:
        raise LoRAError(f"LoRA rank r must be a positive integer; got {config.r!r}")
    if not 0.0 <= config.dropout < 1.0:
        raise LoRAError(f"LoRA dropout must be in [0, 1); got {config.dropout}")
    sites = _sites(model)
    existing = [t for t in LORA_TARGETS if any(t in spans for _, _, spans in sites)]
    grouped = {t for n in config.targets for t in LORA_GROUPS.get(n, ())}
    targets = [t for t in resolve_targets(config.targets)
               if t in existing or t not in grouped]
    unknown = [t for t in targets if t not in existing]
    if unknown or not targets:
        raise LoRAError(f"LoRA target(s) {unknown or list(config.targets)} match no layer of "
                        f"this model; it has {', '.join(existing)} (and the groups "
                        f"{', '.join(LORA_GROUPS)})")
    if "qkv" in targets and {"q", "k", "v"} & set(targets):
        raise LoRAError("LoRA target qkv is the whole in_proj: give it alone, or q/k/v apart")
    plan: list[tuple[nn.Module, str, dict[str, tuple[int, int]]]] = []
    for name, module, spans in sites:
        per_layer: dict[str, dict[str, tuple[int, int]]] = {}
        for target in targets:
            if target in spans:
                attr, span = spans[target]
                per_layer.setdefault(attr, {})[target] = span
        for attr, layer_spans in per_layer.items():
            layer = getattr(module, attr)
            if type(layer) is not nn.Linear:
                raise LoRAError(f"{name}.{attr} is a {type(layer).__name__}, not a float "
                                "nn.Linear (LoRA goes on the fp32 base, before int8)")
            for target, (start, stop) in layer_spans.items():
                limit = min(stop - start, layer.in_features)
                if config.r > limit:
                    raise LoRAError(f"LoRA rank r={config.r} exceeds target {target!r} of "
                                    f"{name}.{attr}: its update is {stop - start}×"
                                    f"{layer.in_features}, so r ≤ {limit}")
            plan.append((module, attr, layer_spans))
    for param in model.parameters():
        param.requires_grad_(False)
    for module, attr, layer_spans in plan:
        setattr(module, attr, LoRALinear(getattr(module, attr), layer_spans, config.r,
                                         config.scale, config.dropout))
    for name, param in model.named_parameters():
        if any(name == p or name.startswith(p + ".") for p in trainable):
            param.requires_grad_(True)
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """Every ``LoRALinear`` of ``model``, by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def lora_state_dict(model: nn.Module, *, trainable: Sequence[str] = ()) -> dict[str, Tensor]:
    """What a LoRA run stores: the adapters' ``lora_A`` / ``lora_B`` and the parameters named
    by ``trainable`` prefixes (a new head), never the frozen base."""
    keep = {}
    for name, tensor in model.state_dict().items():
        is_adapter = ".adapters." in name and name.endswith(("lora_A", "lora_B"))
        if is_adapter or any(name == p or name.startswith(p + ".") for p in trainable):
            keep[name] = tensor
    return keep


def trainable_parameters(model: nn.Module) -> int:
    """How many parameters an optimizer would update (``requires_grad``), a tied one once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every ``LoRALinear`` by a plain ``nn.Linear`` holding its merged weight, and
    make every parameter trainable again: the result is an ordinary model (in place)."""
    for name, layer in lora_layers(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, layer.plain())
    for param in model.parameters():
        param.requires_grad_(True)
    return model
