"""ZeRO stages 1, 2 and 3: data parallelism that stops keeping N copies of everything.

Read in this order: the whole idea first, then its pieces in the order a step uses them,
then the views from outside.

1. :mod:`~edu3d.parallel.zero.sharding`: ``Zero``, stages 1, 2 and 3 with any torch
   optimizer: where each byte of training state lives, and the step that composes the
   pieces below;
2. :mod:`~edu3d.parallel.zero.units`: how any model is cut into units (child modules of one
   dtype): what is sharded, gathered and reduced together;
3. :mod:`~edu3d.parallel.zero.flat_unit`: one unit laid flat, its parameters end to end in
   one buffer, and this rank's shard of it;
4. :mod:`~edu3d.parallel.zero.gathering`: ZeRO-3's parameter life cycle, gathered before a
   unit computes and freed after;
5. :mod:`~edu3d.parallel.zero.reduction`: gradients averaged one unit at a time into this
   rank's slice, per micro-batch or once per step;
6. :mod:`~edu3d.parallel.zero.sharded_grads`: what ``p.grad`` holds after ``finish()``, the
   global norm and clipping;
7. :mod:`~edu3d.parallel.zero.shard_optimizer`: an element-wise optimizer over views of the
   shard; :mod:`~edu3d.parallel.zero.whole_tensors`: any other, each rank owning whole
   parameters;
8. :mod:`~edu3d.parallel.zero.mixed_precision`: FSDP2's mixed-precision policy;
9. :mod:`~edu3d.parallel.zero.holdings`: what a rank holds, and what the model would be
   whole (full shapes, full tensors, memory by category);
10. :mod:`~edu3d.parallel.zero.zero_state`: saving and resuming a sharded run.
"""
