"""Planning: the placement that fits a VRAM budget and runs fastest.

Modules
    - ``planner.py``: a model of a step's copies and compute; the fastest placement that fits a budget.
    - ``autoplan.py``: ``--vram_budget``: probe, shortlist, measure, refine, settle (a full fine-tune: one plan,
      fixed before step 1's update); a typed driver stepped between passes (a feature of the engine), its phases
      an enum.
    - ``agreement.py``: data parallel: the processes holding the same layers plan one placement together (the
      smallest budget; the probe's profile and every measured step time and peak agreed, the largest over them).
    - ``row_copies.py``: layer-major swap units: which of a layer's units stay in the slots over its micro-batches
      (the rule the engine applies) and the planner's replay of what the others cost a step.
    - ``unit_choice.py``: the swap-unit size for a VRAM budget, knowing the step's layer-major micro-batches (units
      whose count per layer fits the slots, so they stay over the micro-batches), chosen before the probe.
    - ``disk_plan.py``: with a host RAM budget, which streamed layers spill to disk (their reads hiding behind the
      longest compute) and the floor the disk sets on a step.
    - ``disk_check.py``: without a VRAM budget, the disk plan's line again after pass 2, with that pass's compute
      measured (the start-up line estimates it).
    - ``state_plan.py``: with a host RAM budget, which full fine-tuned layers keep their fp32 masters and optimizer
      state on disk (their reads and write-backs hiding behind the updates and compute left in the step), and the
      time they add.

May import: memory, streaming, watching.
"""
