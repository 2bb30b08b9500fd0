"""What the fast-path tests run on every rank (tests/test_fast_path.py, tests/test_compile.py):
several variants of one layout in one launch, each returning its losses (and gradients)."""

import torch

from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args
from edu3d.train.trainer import Trainer


def variants(mesh, layout: dict, runs: list[dict], steps: int = 3, grads: bool = True):
    """For each ``runs[i]`` (options over ``layout``'s): the first batch's gathered gradients
    (when ``grads``) and the losses of ``steps`` steps."""
    out = []
    for extra in runs:
        args = Run.of(**layout, **extra, steps=steps)
        config, _ = check_args(args)
        trainer = Trainer(GPT(config, seed=0), mesh, args)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
        rec = {}
        if grads:
            trainer.forward_backward(*corpus.batch(1, args.batch.global_batch))
            rec["grads"] = {k: v.clone() for k, v in trainer.gather("grad").items()}
        rec["losses"] = [trainer.step(*corpus.batch(s, args.batch.global_batch), s)["loss"]
                         for s in range(1, steps + 1)]
        out.append(rec)
    return out


def compile_layouts(mesh, layouts: list[dict], common: dict, steps: int = 2):
    """For each layout (its axes and options, e.g. ``{"pp": 2}``): the losses of ``steps``
    steps eager and compiled. One launch for every layout: each builds its own mesh over
    the same ranks."""
    from edu3d.config.layout import Layout
    from edu3d.distributed.mesh import Mesh

    out = []
    for layout in layouts:
        axes = {k: v for k, v in layout.items() if k in ("dp", "tp", "pp", "cp")}
        here = Mesh.build(Layout(**axes), mesh.rank)
        got = [variants(here, {**common, **layout}, [{"compile": c}], steps, grads=False)[0]
               ["losses"] for c in (False, True)]
        out.append(got)
    return out
