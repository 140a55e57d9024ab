"""Program: the process that ``dgls_train.py`` runs: its settings, its checks, its processes, how it ends.

Modules
    - ``launch.py``: the parser, the TOML, which path a config takes, how the process ends (one line for a
      mistake or Ctrl-C).
    - ``options.py``: the settings users give: one table drives the flags, the ``[dgls]`` keys, ``--help`` and
      the README's flags table; each row names its policy field.
    - ``validate.py``: every input checked in one pass before anything slow starts.
    - ``paths.py``: output folders checked before training: writable, and no earlier run replaced.
    - ``dp_config.py``: diffusion-pipe's side of those checks: the checkout, the training TOML's keys, the
      dataset TOMLs.
    - ``dp_model.py``: a diffusion-pipe config's model files and, where its ``config.json`` says, its layer
      count, checked before loading.
    - ``resume.py``: what a diffusion-pipe run resumes from, checked before start-up and again just before
      DeepSpeed loads.
    - ``patches.py``: every attribute of another library DGLS replaces for a run, put back afterwards.
    - ``distributed.py``: the torch.distributed environment: the launcher's, or a one-process job DGLS sets up.
    - ``rendezvous.py``: a job's processes meet before DeepSpeed starts: a missing rank or a busy port is one
      line, not a hang.
    - ``stop_signals.py``: SIGTERM handled as Ctrl-C, once; a process stops when its deepspeed launcher is
      gone.

May import: memory, streaming, training, demo (the demo's settings and model, only inside the functions that
check a demo config).
"""
