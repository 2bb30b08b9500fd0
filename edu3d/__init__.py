"""edu3d: 3D-parallel LLM training you can see.

The library is mechanics; the course is built on it; nothing in the library imports the
course. Each folder is one concept, each module one idea (floors: a folder imports only
folders listed below it; README's "How the package is organised" says the rules)::

    edu3d/      __init__ cli
                                     torch-free; ``from edu3d import comm``;
                                     the ``edu3d`` parser
    commands/   run doctor train plan schedule ckpt generate grade bench tune calibrate
                run_folders top course argtypes plan_validation
                                     one module per subcommand; the door to production/
    widgets/    style packing timeline collectives mesh3d overlap zero tensor_split tp_layer
                pipeline threed memory_plan checkpoint production perf review context
                experts monitor tuning ckpt_reuse memory_timeline grad_reduce fp8_numbers
                offload_curve
                                     (``edu3d.widgets``, source in widgets/)
                                     charts: data in, figure out
      panels/   panel ch00_launching_ranks ch01_collectives ch02_data_parallel ch03_zero
                ch04_tensor_parallel ch05_pipeline_parallel ch06_3d_parallelism ch07_memory
                ch07_memory_fp8 ch07_memory_offload ch08_checkpoints ch09_in_production
                ch10_performance ch11_review ch12_mixture_of_experts ch13_context_parallelism
                                     each chapter's knobs, on one Panel base
    course/     ch00_launching_ranks ch00_launching_ranks_grade ch00_launching_ranks_text
                ch01_collectives ch01_collectives_grade ch02_data_parallel
                ch02_data_parallel_batching ch02_data_parallel_grade ch03_zero ch03_zero_grade
                ch03_zero_reduce ch03_zero_hsdp ch04_tensor_parallel ch04_tensor_parallel_grade
                ch05_pipeline_parallel ch05_pipeline_parallel_grade ch06_3d_parallelism
                ch06_3d_parallelism_grade ch07_memory ch07_memory_fp8 ch07_memory_grade
                ch07_memory_offload ch07_memory_plan ch07_memory_timeline ch07_memory_tune
                ch08_checkpoints ch08_checkpoints_grade ch08_checkpoints_incremental
                ch09_in_production ch09_in_production_grade ch10_performance ch10_performance_grade
                ch10_performance_hangs ch10_performance_live ch10_performance_predict
                ch10_performance_verdicts ch11_review ch11_review_grade ch11_review_recipe
                ch12_mixture_of_experts ch12_mixture_of_experts_grade ch13_context_parallelism
                ch13_context_parallelism_capstone ch13_context_parallelism_grade
                ch13_context_parallelism_ring grading nbtools targets verdict_channel
                                     what each chapter computes and runs; graders
      autograde/  scoring kernel channel hints processes isolate report
                                     edu3d grade's engine: notebooks in sealed kernels, scored
    bench/      harness bench_comm bench_dp bench_tp bench_pp bench_3d bench_recompute
                bench_5d bench_launch bench_gpu bench_overhead bench_mfu bench_goals
                records plot autotune ranking predicted calibration trainer_steps
                profile_fit cpu_fit bench_tune_model bench_offload
                                     edu3d timed against PyTorch's own implementations
    production/ torch_impl torch_tp torch_pp torch_check compare accelerate_train
                deepspeed_map
                                     the same layouts on PyTorch's APIs, Accelerate, DeepSpeed
    train/      trainer state_slots full_tensors moe_stats loop preflight axis_rules
                pipeline_rules fp8_rules data text documents batching cut optim faults publish
                step_stats memory_recorder cuda_memory generation
                                     one Trainer for every layout; one pre-flight; generation
    parallel/   parallelize grads precision recompute optim_state freeze offload_activations
                                     the one place strategies compose; GradSync
      dp/       data_parallel buckets same_start step_guard compress
      zero/     units flat_unit gathering sharding reduction sharded_grads shard_optimizer
                whole_tensors mixed_precision holdings zero_state hybrid
      tp/       ops layers apply activations
      pp/       engine stage
      cp/       zigzag attention sequence
      ep/       dispatch placement
                                     expert parallelism
      fp8/      scaling scales fp8_linear fp8_gather
                                     FP8 casts, layers, gathers
    ckpt/       format checkpointer reshard export untrusted blobs bounds manifest_schema
                                     sharded checkpoints, resharding
    plan/       formulas estimate search fit zero_modes inventory hardware published
                moe_presets kernels roofline links stage_costs step recipes validate cluster
                cpu trainer_comm host_pool
                                     every memory formula; the one estimator;
                                     hardware profiles and published runs (data)
    launch/     api agent supervise worker procs runs run_files heartbeat cores magic status
                live
                                     start, watch (one loop), end ranks; torch-free
      warm/     pool zygote rank
                                     warm ranks for notebook cells
    distributed/  mesh runtime comm algorithms trace coverage meter
                                     what every rank uses
    model/      gpt moe balance shapes param_globs config_schema
                                     the serial reference GPT, mixture of experts, model shapes
    schedules/  actions check simulate partition
                                     pipeline schedules as data
    config/     layout sections
                                     what a run is: the layout and its rank order,
                                     the Run in sections

The package is deliberately light to import: nothing here imports torch, so the launcher
(``edu3d run``) and the rank wrapper start as fast as a bare ``torchrun``. Import the modules
you need (``from edu3d.distributed import mesh, runtime``); learners' files write
``from edu3d import comm``, which this package hands the traced collectives for.

In a notebook, ``%load_ext edu3d`` registers the ``%%torchrun`` cell magic.

The imports inside functions below are what keeps ``import edu3d`` (and so the ``edu3d``
command and every rank's start-up) torch-free: ``comm`` and the magic are imported only when
first asked for.
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name):
    """``from edu3d import comm`` (the path learners' exercise files use) gives
    :mod:`edu3d.distributed.comm`, imported on first use so that ``import edu3d`` stays
    torch-free."""
    if name == "comm":
        return importlib.import_module("edu3d.distributed.comm")
    raise AttributeError(f"module 'edu3d' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """Entry point of ``%load_ext edu3d``: registers ``%%torchrun``."""
    from edu3d.launch.magic import register

    register(ipython)
