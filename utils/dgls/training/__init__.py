"""Training: full fine-tuning of streamed layers: their fp32 masters, gradients and optimizer steps.

Modules
    - ``host_training.py``: the facade the engine and the trainer call: layout, gradient return and updates.
    - ``training_feature.py``: full fine-tuning as a feature of the engine (fetch gates, evictions, true
      values).
    - ``grad_return.py``: gradients sent home in groups and summed, each layer's gradient state an enum.
    - ``device_sums.py``: under layer-major accumulation, a layer's gradients summed on the device over a step's
      micro-batches, sent home once.
    - ``jobs.py``: host work (gradient sums, host updates) in order on the transport's job worker, timed.
    - ``updaters.py``: where a step runs: the CPU, the GPU, or split between them.
    - ``host_optimizer.py``: which optimizer updates the host-trained params, built per layer.
    - ``optimizer_types.py``: diffusion-pipe's ``[optimizer]`` types: how each trains streamed layers (DGLS's
      kernels, its own class once per layer, or once over every param), or the one line that refuses it.
    - ``optimizer_state.py``: the bytes an optimizer class keeps for a param of a shape and dtype, measured on the
      class (the host RAM check's, the start-up line's and the VRAM planner's figure).
    - ``whole_step.py``: one instance of an optimizer whose step sums over every param (Prodigy ...), over a
      stage's masters and host copies of its resident params, stepped once after the backward.
    - ``optimizer_kernels.py``: the arithmetic a step runs on the GPU, one kernel per optimizer (AdamW, SGD, Lion).
    - ``bitsandbytes_kernel.py``: ``AdamW8bit``'s step on the GPU: bitsandbytes' own kernel on its class's own
      8-bit state, launched on the default stream between the update's copies.
    - ``device_update.py``: a layer's step on the GPU, its state streamed in and out.
    - ``update_split.py``: which layers take that step on the GPU and which on the CPU (``--host_adam split``).
    - ``speculation.py``: under clipping, steps that start before the gradient norm is known, undone and redone
      in a step that clips (exact); their old values' spares.
    - ``previous_norm.py``: ``clip_mode previous_norm`` (opt-in, inexact): steps that start as their gradients land,
      scaled by the previous step's clip coefficient.
    - ``data_parallel.py``: data-parallel full fine-tuning over the processes' shared host copy: an owner per
      layer, each layer's gradients reduced to it in one bucket beside the backward, each layer's update published
      to the others (its version in shared memory) once written.
    - ``shared_saves.py``: what a data-parallel full fine-tune saves: every owner's masters sent to the process that
      writes, each process's share of the host optimizer state in a file of its own, merged on resume.
    - ``disk_state.py``: with a host RAM budget, the fp32 masters and optimizer state of the layers that do not fit
      live in a file on disk, read before each one's host update and written back after it (they spill before the
      weights: read once a step).
    - ``jit_ops.py``: DeepSpeed's C++ optimizer op, built on first use: said before the build; a lock left by
      a killed build refused in one line.

May import: memory, streaming.
"""
