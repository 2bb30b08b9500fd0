"""Which ``edu3d train`` options ``--impl torch`` can honour (torch-free: checked before any
process starts).

``--impl torch`` runs the same layout on PyTorch's own parallel APIs
(:mod:`edu3d.production.torch_impl`). Some of edu3d's options are edu3d's own teaching
mechanics (four gradient averagers, compression hooks, a hand-scheduled ZeRO-3 prefetch,
overlapped TP matmuls) or machinery PyTorch's APIs leave to the training script
(checkpoints, fault injection); for each, :func:`unsupported` names the flag and says what
to do instead.
"""

from __future__ import annotations


def unsupported(args) -> str | None:
    """Why ``args`` (:class:`~edu3d.train.preflight.Run`) cannot run on PyTorch's own
    APIs (the flag named), or None."""
    why = "--impl torch runs the layout on PyTorch's own APIs, which have "
    for flag, value in (("--experts", args.model.experts), ("--cp", args.layout.cp > 1),
                        ("--ep", args.layout.ep > 1)):
        if value:
            return (f"{flag}: this bridge maps edu3d's dense 3D layouts onto PyTorch's APIs; "
                    "its context-parallel attention is CUDA-only and it has no public "
                    f"mixture-of-experts layer; drop {flag} or use --impl edu3d")
    if args.parallel.dp_impl != "bucketed":
        return (f"--dp-impl {args.parallel.dp_impl}: {why}one data-parallel averager, DDP's bucketed "
                "all-reduce; drop --dp-impl (or use --impl edu3d to compare the four)")
    if args.parallel.compress:
        return (f"--compress {args.parallel.compress}: {why}no built-in gradient compression in this "
                "bridge (DDP comm hooks are a separate API); drop --compress or use --impl edu3d")
    if args.parallel.prefetch:
        return (f"--prefetch: {why}FSDP2, which prefetches the next unit by itself; drop "
                "--prefetch (or use --impl edu3d to see edu3d's prefetch)")
    if args.parallel.tp_overlap:
        return (f"--tp-overlap: {why}no overlapped tensor-parallel matmul on CPU (async TP "
                "needs CUDA symmetric memory); drop --tp-overlap or use --impl edu3d")
    if args.memory.offload:
        return (f"--offload: {why}FSDP2's CPUOffloadPolicy, which moves parameters and "
                "gradients too, not only the optimizer state; drop --offload or use --impl edu3d")
    if args.parallel.partition != "uniform":
        return (f"--partition {args.parallel.partition}: the PyTorch pipeline is cut at edu3d's "
                "uniform layer boundaries only; drop --partition or use --impl edu3d")
    if args.memory.recompute == "selective":
        return ("--recompute selective: edu3d recomputes only the attention core, a method, "
                "not a module PyTorch's checkpoint_wrapper can wrap; use --recompute full "
                "(checkpoint_wrapper around each block) or --impl edu3d")
    if args.precision.dtype != "fp32":
        return (f"--precision {args.precision.dtype}: this bridge trains in fp32 only (edu3d's "
                "autocast and loss scaler are not mapped onto FSDP2's MixedPrecisionPolicy "
                "here); drop --precision or use --impl edu3d")
    for name, value in (("--ckpt-dir", args.checkpoint.ckpt_dir), ("--resume", args.checkpoint.resume),
                        ("--save-every", args.checkpoint.save_every), ("--async-save", args.checkpoint.async_save),
                        ("--max-restarts", args.checkpoint.max_restarts),
                        ("--inject-fault", args.launch.inject_fault)):
        if value:
            return (f"{name}: edu3d's checkpoints and fault injection work on edu3d's "
                    "trainer, not on PyTorch's (that would be torch.distributed.checkpoint); "
                    f"drop {name} or use --impl edu3d")
    pp, tp = args.layout.pp, args.layout.tp
    tie = args.model.tie
    if tie is None:
        tie = args.model.preset == "gpt2-small"  # the preset that ties (edu3d.model.gpt.PRESETS)
    if tie and pp > 1:
        return ("--tie with --pp > 1: torch.distributed.pipelining gives each stage its own "
                "module, with no embedding group to keep a tied matrix on two stages equal; "
                "drop --tie or use --impl edu3d")
    if args.parallel.zero >= 2 and pp > 1 and args.parallel.grad_reduce == "per-microbatch":
        return ("--grad-reduce per-microbatch with --pp > 1: torch.distributed.pipelining "
                "turns FSDP2's gradient sync off for every backward and reduce-scatters once, "
                "after the last (its stage's backward_maybe_with_nosync and "
                "perform_reduce_grad); add --grad-reduce per-step or use --impl edu3d")
    if args.parallel.hsdp > 1 and args.parallel.zero == 1:
        return ("--hsdp with --zero 1: ZeroRedundancyOptimizer shards over one process group, "
                "with no replica groups; use --zero 2 or 3 (FSDP2 on a 2-D mesh, replicate x "
                "shard) or --impl edu3d")
    if args.parallel.zero == 1 and (tp > 1 or pp > 1):
        flag = "--tp" if tp > 1 else "--pp"
        return (f"--zero 1 with {flag} > 1: ZeroRedundancyOptimizer works beside DDP on plain "
                "tensors, and beside TP or PP data parallelism is FSDP2's replicate, whose "
                "parameters are DTensors; use --zero 2 or 3 (FSDP2 over the dp axis of the "
                "same mesh) or --impl edu3d")
    return None
