"""Activations: checkpointed layers' activations in host memory between forward and backward.

Modules
    - ``activation_offload.py``: checkpointed layers' inputs to host memory during forward, back before their
      recompute (a feature).
    - ``recompute_offload.py``: what a recompute saves for its backward, to host memory until the backward
      reaches it.
    - ``unit_checkpoints.py``: ``--checkpoint_units`` and ``--keep_piece_outputs``: a layer's pieces under
      checkpoints of their own (a feature).

May import: memory, streaming.
"""
