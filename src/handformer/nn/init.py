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

from torch import nn

__all__ = ["init_weights"]


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
