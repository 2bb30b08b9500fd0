"""What ``--precision fp8`` composes with, checked before a process starts.

After reading this file you can say which runs train in FP8 and why each refusal stands
(:mod:`edu3d.parallel.fp8` has the mechanics):

* FP8 composes with data parallelism, ZeRO 1/2/3 (ZeRO-3 gathers tensorwise weights in
  FP8), tensor and sequence parallelism, pipelines, micro-batches, recomputation and
  offload, each proven equal to the emulated serial FP8 run (tests/test_fp8_parity.py);
  frozen parameters and ``--compile`` are accepted but not in that matrix;
* refused: a mixture of experts (its experts' products are not FP8 here, and their token
  groups change with the layout), context parallelism (a tensorwise amax would have to be
  reduced over the sequence's ranks too), ``--tp-overlap`` (its overlap lives inside TP's
  own fp32 matrix product), ``--impl torch`` (PyTorch's FP8 training is torchao's, not
  installed here), delayed scaling with rowwise scales (a row is a token: there is no
  history to keep) or with checkpoints (the amax histories are not saved, so a resumed
  run would scale differently);
* the FP8 flags (``--fp8-scaling``, ``--fp8-recipe``, ``--fp8-history``) mean nothing
  without ``--precision fp8``: changing one alone is refused rather than ignored.

:func:`edu3d.train.preflight.check_args` calls :func:`check_fp8`; no torch here.
"""

from __future__ import annotations

from edu3d.config.layout import LayoutError
from edu3d.config.sections import Precision, Run

SCALINGS = ("tensorwise", "rowwise")  # edu3d.parallel.fp8.SCALINGS; a test checks
RECIPES = ("current", "delayed")  # edu3d.parallel.fp8.KINDS; a test checks


def check_fp8(run: Run) -> None:
    """Refuse (:class:`~edu3d.config.layout.LayoutError`, one line) what FP8 does not
    compose with, and FP8 flags without ``--precision fp8``."""
    p, default = run.precision, Precision()
    if p.fp8_scaling not in SCALINGS:
        raise LayoutError(f"--fp8-scaling {p.fp8_scaling!r}: choose one of {', '.join(SCALINGS)}")
    if p.fp8_recipe not in RECIPES:
        raise LayoutError(f"--fp8-recipe {p.fp8_recipe!r}: choose one of {', '.join(RECIPES)}")
    if not isinstance(p.fp8_history, int) or isinstance(p.fp8_history, bool) or \
            p.fp8_history < 1:
        raise LayoutError(f"--fp8-history {p.fp8_history!r}: steps of amax history, >= 1")
    if p.dtype != "fp8":
        given = [f"--{name.replace('_', '-')} {getattr(p, name)}" for name in
                 ("fp8_scaling", "fp8_recipe", "fp8_history")
                 if getattr(p, name) != getattr(default, name)]
        if given:
            raise LayoutError(f"{given[0]} sets how FP8 scales; add --precision fp8 (or drop "
                              "it)")
        return
    refused = [(run.model.experts, "--experts: the mixture of experts' products are not FP8 "
                "here; drop --experts, or train it in --precision bf16"),
               (run.layout.cp > 1, f"--cp {run.layout.cp}: an FP8 scale would need the "
                "amaxes of every context-parallel rank's tokens; drop --cp, or use "
                "--precision bf16"),
               (run.parallel.tp_overlap, "--tp-overlap overlaps TP's own fp32 product, not "
                "FP8's; drop --tp-overlap"),
               (run.parallel.impl != "edu3d", f"--impl {run.parallel.impl}: PyTorch's FP8 "
                "training is torchao's (not installed here); use --impl edu3d"),
               (p.fp8_recipe == "delayed" and p.fp8_scaling == "rowwise", "--fp8-recipe "
                "delayed keeps one amax history per tensor, and a rowwise scale belongs to a "
                "token: use --fp8-recipe current with rowwise"),
               (p.fp8_recipe == "delayed" and run.checkpoint.ckpt_dir, "--fp8-recipe "
                "delayed with --ckpt-dir: the amax histories are not in the checkpoint, so "
                "a resumed run would scale differently; use --fp8-recipe current")]
    for bad, why in refused:
        if bad:
            raise LayoutError(f"--precision fp8: {why}")
