"""What tests/test_trainer_comm_count.py runs on every rank: several layouts in one launch,
each trained for a few steps with its events tagged ``case`` (its index) in the trace."""

from edu3d.config.sections import Run
from edu3d.distributed import trace
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.preflight import check_args
from edu3d.train.trainer import Trainer


def traced_steps(mesh, runs: list[dict], steps: int = 2) -> None:
    """Train each of ``runs`` (options, on a mesh of its own layout) for ``steps`` steps."""
    meshes = {mesh.layout: mesh}
    try:
        for case, options in enumerate(runs):
            run = Run.of(**options, steps=steps)
            config, _ = check_args(run)
            if run.layout not in meshes:
                meshes[run.layout] = Mesh.build(run.layout)
            trainer = Trainer(GPT(config, seed=0), meshes[run.layout], run)
            corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
            with trace.current().context(case=case):
                for s in range(1, steps + 1):
                    trainer.step(*corpus.batch(s, run.batch.global_batch), s)
    finally:
        for m in meshes.values():
            if m is not mesh:
                m.release()
