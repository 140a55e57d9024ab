"""Trainers: DGLS inside diffusion-pipe's ``train.py`` and DeepSpeed's engine.

Modules
    - ``diffusion_pipe.py``: runs a checkout's own, unmodified ``train.py`` with DGLS placing its layers.
    - ``pipeline_hook.py``: takes over each DeepSpeed pipeline stage's layers as it builds them, before they
      move to the GPU.
    - ``engine_hooks.py``: joins DeepSpeed's engine when streamed layers train on the host: clipping, the step,
      checkpoints.
    - ``layer_major_batches.py``: DeepSpeed's pipeline engine runs a step's micro-batches layer-major (one stage: the
      demo's and train.py's steps, ``--layer_major``).
    - ``joined_backward.py``: with several pipeline stages, each stage's backward runs once per micro-batch for all
      the tensors it sends on (DeepSpeed 0.19's pass runs one per tensor, recomputing the stage each time).
    - ``interleaved_steps.py``: with several pipeline stages, a stage's ``train_batch`` is one step for DGLS (its
      micro-batches interleave: the planner re-places layers between steps only).
    - ``file_backed_casts.py``: under a host RAM budget, the dtype casts diffusion-pipe's loaders make (diffusers',
      accelerate's, ``p.data = p.data.to(dtype)``, ``Module.to(dtype)``) go to a scratch file in the disk_dir while
      the model loads, not to RAM (a torch-function mode, on only while train.py loads).
    - ``shm_op.py``: keeps DeepSpeed's CPU shared-memory all-reduce op (a C++ build DGLS never uses) out of
      every run.

May import: memory, streaming, watching, training, engine, program.
"""
