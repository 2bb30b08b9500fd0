import sys
from tests.dbg_work import work
from edu3d.launch import launch
from tests.workers_5d import options, serial_reference, rel
from tests import workers_5d as w
from edu3d.train.options import check_args

def _unused(mesh, argv, ref):
    from edu3d.model.gpt import GPT
    from edu3d.train.options import config_from_args
    from edu3d.train.data import SyntheticCorpus
    from edu3d.train.trainer import Trainer
    adam = options(argv)
    config = config_from_args(adam)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=adam.seed)
    trainer = Trainer(GPT(config, seed=adam.seed), mesh, adam)
    ours = [trainer.step(*corpus.batch(s, adam.global_batch), s) for s in range(1, 6)]
    final = trainer.gather("param")
    errs = sorted(((rel(final[n], p), n) for n, p in ref["final"].items()), reverse=True)[:6]
    return errs, [(a["loss"], b["loss"]) for a, b in zip(ours, ref["records"])]

argv = (sys.argv[1]).split()
ref = serial_reference(argv, 5)
_, layout = check_args(options(argv))
r = launch(work, layout.world_size, args=(argv, ref), layout=layout, timeout=200, echo=False)
for e in r.results[0][0]: print(e)
for e in r.results[0][1]: print(e)
