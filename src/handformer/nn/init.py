"""Weight initialisation shared by every handformer model.

GPT-2's recipe: matrices N(0, 0.02); the output projections that write into the residual
stream (attention ``out_proj``, FFN ``fc_out``) scaled by 1/√(2L) so the stream's variance
does not grow with depth; biases zero; LayerNorm gains one. With ``zero_out=True`` those
output projections start at exactly zero instead (the speedrun recipes' choice): every block
then begins as the identity on the residual stream, and the first steps train the
embedding-to-head path before the blocks join in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["init_weights", "skip_init"]


def init_weights(model: nn.Module, n_layers: int, *, zero_out: bool = False) -> None:
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    for name, param in model.named_parameters():
        if param.dim() < 2:
            if name.endswith("bias"):
                nn.init.zeros_(param)
            continue
        writes_residual = name.endswith(("out_proj.weight", "fc_out.weight"))
        if writes_residual and zero_out:
            nn.init.zeros_(param)
            continue
        std = residual_std if writes_residual else 0.02
        nn.init.normal_(param, mean=0.0, std=std)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class _SkipInit(TorchFunctionMode):
    """``torch.nn.init``'s fills pass their tensor back untouched; every other call runs."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@contextmanager
def skip_init() -> Iterator[None]:
    """Build a model whose every weight is about to be loaded, without drawing its random
    start: ``torch.nn.init``'s random fills (``normal_``, ``uniform_``, ``kaiming_uniform_``)
    leave their tensors as allocated.

    Drawing a large model's weights only to overwrite them with a file's is most of the time
    to load it; on the meta device, ``normal_`` also imports torch's compiler. Only for a load
    that fills every parameter and persistent buffer (a strict one): the rest hold whatever
    the allocator gave. Buffers computed from the config (rotary frequencies, ALiBi slopes)
    are not fills and are computed as usual.
    """
    with _SkipInit():
        yield
