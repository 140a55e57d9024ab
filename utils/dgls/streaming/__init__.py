"""Streaming: the parts every streamed layer goes through, and the lifecycle features follow.

Modules
    - ``config.py``: ``SwapConfig``, the settings as policies (placement, transfer, compute, activations,
      training, observe), each checking itself; shared by the command line, the TOML and the library.
    - ``placement.py``: which layers stream and how deep prefetch goes, in bytes (explicit placement).
    - ``feature.py``: the lifecycle protocol every optional part follows (install, fetch gates, after backward,
      between passes, placement, true values, pinned bytes, describe, close).
    - ``hooks.py``: forward, recompute, backward and saved-tensor events as ``use(layer, phase)``; the end of
      each backward as ``pass_end()``.
    - ``schedule.py``: the phase of a use, and which uses come next, learned from the order seen.
    - ``residency.py``: one streamed layer's state (host, fetching, in use, released), a method per transition.
    - ``bindings.py``: what each param points at (placeholder, slot view, device copy), and its home.
    - ``masters.py``: the true weights in host memory, and the state-dict hooks that read and write them.
    - ``tiers.py``: ``--host_ram_budget``: which streamed layers' masters stay in RAM and which spill to disk.
    - ``units.py``: swap units: a large layer streamed as the child modules it runs.
    - ``forward_patches.py``: ``--autocast`` and ``--compile``: how a layer's forward runs, apart from where
      its weights are (a feature).
    - ``trainable_cast.py``: ``--mixed_precision``: the trainable params in its dtype (a feature, installed last).

May import: memory.
"""
