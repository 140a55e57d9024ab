"""Engine: ``LayerSwapper`` and the builder that makes its parts.

Modules
    - ``swapper.py``: ``LayerSwapper``, the engine's entry: which layer gets a slot, prefetch, re-placement,
      removal; it iterates over its features and never asks which there are.
    - ``build.py``: turns the configuration into the parts (layouts, placement, masters, the transport) and
      the list of features, after every check.
    - ``training_costs.py``: what a full fine-tune keeps on the device beyond the weights (the trainer's gradients
      and optimizer state of resident layers), from the objects that allocate it: the VRAM planner's figures.

May import: memory, streaming, watching, activations, training, planning.
"""
