"""The embedded default: a tiny diffusion transformer, synthetic data, and a DeepSpeed run.

Modules
    - ``model.py``: a tiny Flux-shaped model (double and single blocks of different sizes) as a layer list.
    - ``data.py``: synthetic, deterministic latents and captions: no images, no downloads.
    - ``settings.py``: the demo's TOML tables, checked in full before anything is built.
    - ``train.py``: the run, through DeepSpeed's pipeline engine as diffusion-pipe's ``train.py`` does.

May import: memory, watching, training, engine, program, trainers (a trainer of its own, beside diffusion-pipe's:
outside the layers' order, as program checks a demo config with its settings and model).
"""
