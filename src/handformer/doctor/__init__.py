"""The doctor: the tutorial's debugging checklist as code.

    from handformer.doctor import run
    report = run(model, batch_or_windows, loss_fn=lm_loss)
    print(report.format_text())      # or report.to_json(); report.exit_code is 0 unless a FAIL

Checks run in the tutorial's troubleshooting order — shapes, masks, loss, gradients,
learning, then whether the manual/fused kernels and cached/uncached decoding agree — and
each says PASS / WARN / FAIL / SKIP with the evidence it measured and a hint naming the fix.
Any ``nn.Module`` mapping ids (B, T) to logits (B, T, V) gets the checks that need no
internals; models built from handformer's pieces get all of them.
"""

from handformer.doctor.report import CheckResult, ModuleRow, Report, Status
from handformer.doctor.runner import CHECK_NAMES, run

__all__ = ["CHECK_NAMES", "CheckResult", "ModuleRow", "Report", "Status", "run"]
