"""Engine: ``LayerSwapper`` and the builder that makes its parts.

Modules
    - ``swapper.py``: ``LayerSwapper``, the engine's entry: which layer gets a slot, prefetch, re-placement,
      removal; it iterates over its features and never asks which there are.
    - ``build.py``: turns the configuration into the parts (layouts, placement, masters, the transport) and
      the list of features, after every check.
    - ``layer_major.py``: gradient accumulation layer by layer: each layer over all of a step's micro-batches before
      the next, so each streamed layer is fetched once a direction a step (a step function, and the losses of one
      for a trainer's own backward).
    - ``row_keeping.py``: a layer's swap units kept in their slots over a layer-major step's micro-batches of that
      layer (all when they fit the slots, else as many as leave two slots to the others:
      :func:`~..planning.row_copies.plan_row`), and the use predictor told those micro-batches repeat the first.
    - ``training_costs.py``: what a full fine-tune keeps on the device beyond the weights (the trainer's gradients
      and optimizer state of resident layers), from the objects that allocate it: the VRAM planner's figures.
    - ``disk_planning.py``: with a host RAM budget, the disk plan's inputs (the layouts, the placement, the disk's and
      the copies' measured bandwidths) and the chooser of the layers that spill to disk.

May import: memory, streaming, watching, activations, training, planning.
"""
