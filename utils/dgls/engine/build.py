"""Build: turn a :class:`~..streaming.config.SwapConfig` into the engine's parts, and say at start-up what was built.

Order
    - Checks first, before anything is packed or moved: device support of the casts, the planner's budget,
      swap units (:mod:`..streaming.units`) and checkpointed pieces, the measured layouts (a cast that casts nothing is
      refused; a full fine-tune under a budget also counts what its resident layers' training keeps on the device,
      :mod:`.training_costs`), the placement (:mod:`..streaming.placement`), the update buffers, the planner's
      minimum, the host RAM full fine-tuning needs.
    - Then the parts, none of which changes the model: the masters (packed host copies,
      :mod:`..streaming.masters`), the transport (:mod:`..memory.transport`), the slot pool and the weight copier,
      and the features (:mod:`..streaming.feature`): full fine-tuning, activation offload (with recompute offload),
      unit checkpoints, forward patches, the profiler, the VRAM-budget planner and the trainable params' cast, in
      the order the engine installs them.
    - The engine (:class:`~.swapper.LayerSwapper`) streams and places the layers, installs its hooks, then the
      features in list order; the cast comes last (it is lossy, and nothing after it can fail).

Invariants
    - Every ``config.<field>`` the engine's parts need is read here; the parts get values (or a policy), not the
      config (the engine keeps ``config`` only for readers: re-placement writes the prefetch depth it chose into
      ``config.placement.prefetch``).
    - A build that fails half-way frees what it made (pinned memory, shared segments, worker threads) and has
      changed no param.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from ..activations.activation_offload import ActivationOffloader
from ..activations.unit_checkpoints import Piece, UnitCheckpoints, pieces_to_checkpoint
from ..errors import DGLSUserError
from ..memory.copier import Copier, CudaCopier, DeferredCopier
from ..memory.device_pool import DevicePool
from ..memory.disk_tier import DiskTier
from ..memory.fetch_share import FetchShare
from ..memory.layout import MB, LayerLayout, LayerSizes, TrainingLayout, human_bytes, measure
from ..memory.peers import NO_OTHERS, Others, others_on_machine
from ..memory.precision import CastRules, check_device_support, name_of
from ..memory.transport import CudaTransport, Direction, Transport, make_transport
from ..planning.agreement import PlanAgreement
from ..planning.autoplan import PlacementDriver, resolve_budget
from ..planning.disk_check import DiskPlanCheck
from ..planning.unit_choice import choose_unit_bytes
from ..streaming.config import SwapConfig
from ..streaming.feature import Feature
from ..streaming.forward_patches import ForwardPatches
from ..streaming.masters import Masters, has_fp8
from ..streaming.placement import Placement, plan_placement
from ..streaming.tiers import RING_BUFFERS, Tiers, plan_tiers, resolve_ram_budget, tier_labels
from ..streaming.trainable_cast import TrainableCast
from ..streaming.units import Entry, split_layers, split_note, split_points
from ..torch_private import check_torch
from ..training.data_parallel import SharedGradients, agree, job_ownership, refuse_whole_step
from ..training.disk_state import DiskState, plan_full_tiers, refuse_disk_state
from ..training.host_training import (
    HostTraining,
    check_host_training,
    host_training_beside,
    host_training_need,
    training_layout,
    update_buffer_bytes,
)
from ..training.shared_saves import READER
from ..training.training_feature import TrainingFeature
from ..watching.profiler import Profiler
from .disk_planning import DiskChoice, StateChoice
from .training_costs import with_training_costs


@dataclass
class Parts:
    """What the engine is made of (see :func:`build`)."""

    layers: list  # the entries' modules
    entries: list[Entry]  # the layers, some split into swap units (units.py); indices below are theirs
    layouts: list[LayerLayout]
    unit_bytes: int | None
    pieces: list[Piece]
    placement: Placement
    masters: Masters
    transport: Transport
    pool: DevicePool
    copier: Copier
    features: list[Feature]  # installed in this order, closed in reverse
    # modules whose next call starts no use (unit checkpoints' kept outputs); None: no module ever replays
    replays: Callable[[nn.Module], bool] | None
    batch_move: bool  # one submit for all the prefetches of a use
    sync_each_step: bool
    copy_streams: int
    plan_finished: Callable[[], bool]
    # for readers (the planner, the drop-in, tests); the engine itself only iterates ``features``
    driver: PlacementDriver | None
    training: HostTraining | None
    activations: ActivationOffloader | None
    tiers: Tiers | None = None  # with a host RAM budget: which masters live in RAM and which on disk


def resolve_device(device: torch.device | str | None) -> torch.device:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build(
    layers: list, config: SwapConfig, device: torch.device, log: Callable[[str], None], share_group: str = ""
) -> Parts:
    """Check the configuration against the layers, then make the parts (nothing in the model changes here)."""
    if not layers:
        raise DGLSUserError("no layers to place: the layer list is empty")
    notice = check_torch()  # refuses a torch that lacks a private API DGLS calls
    if notice:
        log(notice)
    c = config
    cast_rules = CastRules.from_policy(c.compute)
    check_device_support(device, cast_rules)
    host_trained = c.training.host_optimizer is not None
    budget = _budget(c, device, log)
    # data parallel: the processes holding these layers plan one placement, for the smallest of their budgets
    agreement = PlanAgreement.among(layers, share_group, c.placement.first_layer) if budget is not None else None
    budgets = agreement.budget(budget) if agreement is not None else (budget, budget)
    budget = budgets[0]
    unit_bytes = _unit_bytes(layers, c, cast_rules, host_trained, budget, log)
    entries = split_layers(layers, unit_bytes, trainable_streams=host_trained)
    values = [entry.value for entry in entries]
    pieces = pieces_to_checkpoint(entries, host_trained) if c.activations.checkpoint_units else []
    if c.activations.checkpoint_units and not pieces:
        raise DGLSUserError(
            "checkpoint_units checkpoints the child modules of each layer, and no layer has child modules with "
            "params: drop checkpoint_units"
        )
    UnitCheckpoints.check(pieces)
    measured = measure(values, cast_rules, c.compute.mixed_precision, host_trained=host_trained)
    layouts = [layout.of_entry(entry.layer, entry.part, entry.holder) for layout, entry in zip(measured, entries)]
    _check_casts_match(layouts, cast_rules)
    if host_trained and budget is not None:  # what the trainer keeps on the device for resident layers' params
        layouts = with_training_costs(values, layouts, c.training.host_optimizer, c.compute.mixed_precision)
    sizes = tuple(layout.sizes for layout in layouts)
    placement = plan_placement(sizes, c.placement, c.transfer.cuda_streams)
    trained = None  # the training layout: the RAM check's figure, then what full fine-tuning allocates
    shared = None  # data parallel: this process's share of the host-trained layers (training/data_parallel.py)
    others = NO_OTHERS  # data parallel: the other shares (this machine holds them all)
    if host_trained:
        streamed_layouts = {idx: layouts[idx] for idx in placement.streamed}
        trained = training_layout(
            streamed_layouts, c.training.host_optimizer, c.training.accumulation_steps,
            c.training.clip_grads, c.training.speculates,
        )  # fmt: skip
        if c.training.data_parallel:  # the machine holds every share: what the others need, from the whole layout
            whole = (host_training_need(trained), host_training_beside(trained))
            shared, trained = _data_parallel_share(c, entries, trained, streamed_layouts)
            size = shared.ownership.size if shared is not None else 1
            others = Others(whole[0] - host_training_need(trained), size - 1, whole[1] - host_training_beside(trained))
        update = update_buffer_bytes(trained, c.training.host_optimizer)  # what HostTraining reserves
        buckets = shared.pool_bytes if shared is not None else 0  # data parallel's, during the backward
        placement = dataclasses.replace(placement, update_bytes=update, reduce_bytes=buckets)
    driver = _start_driver(c, budget, unit_bytes, device, log, agreement, budgets[1])
    if driver is not None:
        driver.check_static_minimum(sizes, placement.update_bytes)
    # which layers spill (disk_planning.py); a layer-major step's fetches each compute its micro-batches
    # (full fine-tuning: no read-ahead, its fetches read: LayerSwapper.read_ahead)
    micro_batches = c.placement.layer_major_micro_batches
    disk_choice = DiskChoice(layouts, placement, device, c.transfer.disk_dir, micro_batches, read_ahead=trained is None)
    tiers, state_spilled = _tiers(c, values, layouts, placement, trained, disk_choice)
    training_note = _check_host_ram(c, trained, others)
    with ExitStack() as undo:  # a failure below frees what was made
        disk_state = None
        if state_spilled:  # full fine-tuning: masters and optimizer state that do not fit (training/disk_state.py)
            disk_state = DiskState.open(c.transfer.disk_dir, trained, state_spilled)
            undo.callback(disk_state.close)
        disk = None
        if tiers is not None and tiers.spilled:  # the directory is checked before anything is written
            disk = DiskTier.open(c.transfer.disk_dir, tiers.spilled, tiers.ring_count, pin=device.type == "cuda")
            undo.callback(disk.close)
        masters = Masters(
            values, layouts, placement.streamed, device, cast_rules, c.transfer.pinned_ram_budget_gb,
            c.transfer.selective_packing, log, share_group, disk, versioned=shared is not None,
        )  # fmt: skip
        undo.callback(masters.release)
        if disk is not None:
            disk.read_gbps = disk_choice.read_gbps or disk.measure()  # the disk's read bandwidth, for its line
            if driver is not None:  # the VRAM planner's plans count the reads of the layers on disk
                driver.disk_reads = {i: disk.file.extents[i][1] for i in disk.spilled}
                driver.read_bytes_per_ms = max(disk.read_gbps, 1e-6) * 1e6  # a measure of 0 must not divide
        # weight copies and activation restores are timed for the stats (collect_timing: copy GB/s, the compute
        # stream's waits for each); the other directions only for --profile
        timed = {d for d in Direction if d is not Direction.WEIGHTS_IN} if c.observe.profile else set()
        timed |= {Direction.WEIGHTS_IN, Direction.ACTIVATIONS_IN} if c.observe.collect_timing else set()
        transport = make_transport(device, weight_lanes=c.transfer.cuda_streams, timed=timed)
        undo.callback(transport.close)
        if disk is not None:
            transport.read_from(disk.reader)
        if disk_state is not None:
            disk_state.start(transport, disk.file if disk is not None else None)
            masters.store.closing.append(disk_state.close)  # after the true weights were read back at removal
        features: list[Feature] = []
        undo.callback(lambda: [feature.close() for feature in reversed(features)])
        training = None
        if host_trained:
            trainer = TrainingFeature.start(
                masters, trained, transport, c.training.host_optimizer, training_note, device=device,
                threading=c.transfer.threading, accumulation_steps=c.training.accumulation_steps,
                clipping=c.training.clip_grads, speculate=c.training.speculates, clip_mode=c.training.clip_mode,
                plan_fix=driver.fix_plan if driver is not None else None, shared=shared, disk_state=disk_state,
            )  # fmt: skip
            features.append(trainer)
            training = trainer.training
        activations = None
        if _offloads_activations(c, driver, device):
            activations = ActivationOffloader(
                device,
                keep=max(1, c.placement.prefetch),
                recompute=c.activations.offload_recompute,
                transport=transport,
            )
            features.append(activations)
        unit_checkpoints = None
        if pieces:
            calling = (lambda: activations.calling) if c.activations.keep_piece_outputs else None
            unit_checkpoints = UnitCheckpoints(
                pieces, device, calling, layers=len({entries[piece.entry].layer for piece in pieces})
            )
            features.append(unit_checkpoints)
        eager = {idx for idx, entry in enumerate(entries) if entry.holder} | {piece.entry for piece in pieces}
        compile_backend = c.compute.compile_backend if c.compute.compile else None
        features.append(ForwardPatches(values, device, c.compute.autocast, compile_backend, eager))
        if c.observe.profile:
            features.append(
                Profiler(
                    c.observe.profile,
                    device,
                    c.observe.profile_warmup_steps,
                    c.observe.profile_steps,
                    c.transfer.cuda_streams,
                    log,
                )
            )
        if driver is not None:
            features.append(driver)
        elif disk is not None and disk_choice.costs is not None:  # no probe measures the compute: pass 2 does
            features.append(DiskPlanCheck(disk_choice.costs, placement.streamed, disk.spilled, device, log))
        features.append(TrainableCast(values, cast_rules, c.compute.autocast, c.compute.mixed_precision))
        share = _fetch_share(c, masters, placement, device, log)
        if share is not None and driver is not None:  # one re-planning alone would change its fetches
            driver.lockstep = True
        if isinstance(transport, CudaTransport):
            copier: Copier = CudaCopier(
                transport,
                masters.store,
                ordered_by_events=c.transfer.ordered_by_events,
                use_thread=c.transfer.threading or disk is not None,  # a read's wait is the worker's, not compute's
                landing_bytes=placement.landing_bytes,
                share=share,
            )
        else:
            copier = DeferredCopier(masters.store, use_thread=c.transfer.threading, transport=transport, share=share)
        undo.callback(copier.close)
        pool = DevicePool(device, placement.slot_count, placement.slot_bytes + copier.slot_padding)
        undo.callback(pool.release)
        masters.store.ensure_staging(2, placement.slot_bytes)
        undo.pop_all()
    return Parts(
        layers=values,
        entries=entries,
        layouts=layouts,
        unit_bytes=unit_bytes,
        pieces=pieces,
        placement=placement,
        masters=masters,
        transport=transport,
        pool=pool,
        copier=copier,
        features=features,
        replays=unit_checkpoints.replays if unit_checkpoints is not None else None,
        batch_move=c.transfer.batch_move,
        sync_each_step=c.transfer.sync_each_step,
        copy_streams=c.transfer.cuda_streams,
        plan_finished=_plan_finished(c.placement.plan, driver),
        driver=driver,
        training=training,
        activations=activations,
        tiers=tiers,
    )


def _fetch_share(
    c: SwapConfig, masters: Masters, placement: Placement, device: torch.device, log: Callable[[str], None]
) -> FetchShare | None:
    """Data parallel on one machine: this process's share of each streamed layer's copy (:mod:`..memory.fetch_share`),
    or None (it copies every byte). Every rank calls it (groups are made by all), after the masters found the sets."""
    streamed = [masters.host(i) for i in placement.streamed if masters.has(i)]
    pinned = [h.buffer[: h.nbytes] for h in streamed if h.pinned and not h.on_disk]
    largest = max(pinned, key=lambda b: b.numel(), default=None)  # auto measures a host copy from it
    share, line = FetchShare.among(masters.peers.sets, c.transfer.share_fetch, device, largest)
    if share is not None:
        line = share.line(len(streamed), sum(not h.packed for h in streamed))
    if line:
        log(line)
    return share


def _check_host_ram(c: SwapConfig, trained: TrainingLayout | None, shares: Others) -> str:
    """Full fine-tuning's host RAM check at start-up (:func:`check_host_training`), its start-up line. Processes that
    each train their own layers (pipeline stages) count what the job's others on this machine need too, and all stop
    on one's refusal, with its line, before any of them allocates: every process of a full fine-tune calls this
    (a collective), one without host-trained layers needing none. Data parallel checked every share in each process
    (:func:`_data_parallel_share`) and counts the other shares here (``shares``: their need, count and holdings,
    from the whole layout), so each process's optional spares take its share of what is left."""
    if c.training.host_optimizer is None:
        return ""
    probe = c.placement.planned
    if c.training.data_parallel:
        return check_host_training(trained, probe=probe, others=shares) if trained is not None else ""
    if trained is not None:
        others = others_on_machine(host_training_need(trained, probe=probe), host_training_beside(trained, probe))
    else:
        others = others_on_machine(0)
    note, problem = "", None
    try:
        note = check_host_training(trained, probe=probe, others=others) if trained is not None else ""
    except DGLSUserError as exc:
        problem = str(exc)
    agree(problem)
    return note


def _data_parallel_share(
    c: SwapConfig, entries: list[Entry], trained: TrainingLayout, streamed_layouts: dict[int, LayerLayout]
) -> tuple[SharedGradients | None, TrainingLayout]:
    """Data-parallel full fine-tuning: every process's owners of the host-trained layers, and the training layout
    of this process's share (:mod:`..training.data_parallel`). Refused with a VRAM budget, whose planner may make
    layers resident after step 1's probe (the owners are fixed at start-up); with ``plan`` (only shown, the probe's
    placement stays) it is not. The host RAM check counts every share (one machine holds them all); the start-up
    line is this process's share's. With several processes, every one makes the saves' gloo group here
    (:mod:`..training.shared_saves`: the masters go over it on the CPU)."""
    if c.placement.planned and not c.placement.plan:
        raise DGLSUserError(
            "data-parallel full fine-tuning fixes each streamed layer's owner at start-up, and a VRAM budget's planner "
            "re-places layers after its probe: give the placement instead (--gpu_layers or --blocks_to_swap; "
            "--vram_budget with --plan prints the one it would choose)"
        )
    refuse_whole_step(c.training.host_optimizer)
    numels = {idx: place.numel for idx, place in trained.layers.items()}
    ownership = job_ownership(numels, {idx: entries[idx].layer for idx in numels})
    # the machine holds every share (the processes' shares together are this layout), and while a save runs the
    # reader holds the other owners' own fp32 masters too (:mod:`..training.shared_saves`)
    lent = [p for idx, place in trained.layers.items() if ownership.owners[idx] != READER for p in place.params]
    problem = None
    try:  # each process reads the free RAM itself: all stop on one's refusal, before the collectives below
        check_host_training(trained, save_copy=sum(4 * p.numel for p in lent if p.own_master))
    except DGLSUserError as exc:
        problem = str(exc)
    agree(problem)
    params = {idx: [p.param.param for p in place.params] for idx, place in trained.layers.items()}
    owned = training_layout(
        {idx: streamed_layouts[idx] for idx in ownership.owned}, c.training.host_optimizer,
        c.training.accumulation_steps, c.training.clip_grads, c.training.speculates,
    )  # fmt: skip
    shapes = {idx: [(p.param.shape, p.param.dtype) for p in place.params] for idx, place in trained.layers.items()}
    own = frozenset(id(p.param.param) for place in trained.layers.values() for p in place.params if p.own_master)
    if ownership.size == 1:
        return None, owned
    saves = torch.distributed.new_group(backend="gloo")  # every rank, here: the saves' masters go on the CPU
    return SharedGradients(ownership, params, shapes, own_masters=own, save_group=saves), owned


def start_report(parts: Parts) -> list[str]:
    """The start-up lines: the placement, swap units, each feature's lines, warnings."""
    store = parts.masters.store
    lines = [parts.placement.table(tier_labels(store) if parts.tiers is not None else None)]
    if parts.tiers is not None:
        lines += [parts.tiers.line(), *parts.tiers.forecast]
    if store.disk is not None:
        lines += [store.disk.describe(), *store.disk.notes]
    if parts.training is not None and parts.training.disk_state is not None:
        lines.append(parts.training.disk_state.describe())
    if note := split_note(parts.entries, parts.unit_bytes):
        lines.append(note)
    lines += [line for feature in parts.features for line in feature.describe()]
    lines += parts.placement.notes()
    if pageable := store.pageable_layers:
        lines.append(
            f"DGLS: the pinned-RAM budget ({human_bytes(store.pinned_budget)}) covers "
            f"{len(store.layers) - len(pageable)} of {len(store.layers)} streamed layers; the other "
            f"{len(pageable)} stay pageable and are staged through 2 pinned buffers (slower): free RAM or raise "
            "pinned_ram_budget_gb"
        )
    return lines


def _tiers(
    config: SwapConfig,
    layers: list,
    layouts: list[LayerLayout],
    placement: Placement,
    trained: TrainingLayout | None,
    choose: DiskChoice,
) -> tuple[Tiers | None, dict[int, int]]:
    """With ``host_ram_budget``: which streamed layers' packed weights spill to disk (:mod:`..streaming.tiers`), and for
    a full fine-tune (``trained``, the training layout) whose masters and optimizer state do, with their extents'
    bytes (:mod:`..training.disk_state`, which spills those first: they are read once a step)."""
    value = config.transfer.host_ram_budget
    if value is None:
        return None, {}
    streamed = set(placement.streamed)
    hosted = [lay.index for lay in layouts if lay.index in streamed or has_fp8(lay)]
    on_cpu = sum(
        layouts[i].sizes.streamable_bytes
        for i in hosted
        if all(p.param.device.type == "cpu" for p in layouts[i].params)
    )
    budget = resolve_ram_budget(value, on_cpu)
    if trained is None:
        tiers, state = plan_tiers(layouts, hosted, placement.streamed, budget, RING_BUFFERS, choose=choose), {}
    else:  # what this run cannot keep on disk is refused before the disk plan probes the disk
        _, state = plan_full_tiers(layouts, hosted, placement.streamed, budget, RING_BUFFERS, trained)
        if state:
            refuse_disk_state(config, trained, len(state))
        t = config.training
        layer_major = config.placement.layer_major_micro_batches
        states = StateChoice(
            choose, trained, t.host_optimizer, t.clip_grads, t.accumulation_steps, layer_major, clip_mode=t.clip_mode
        )
        tiers, state = plan_full_tiers(
            layouts, hosted, placement.streamed, budget, RING_BUFFERS, trained, choose, states
        )  # fmt: skip
        if state and (forecast := states.forecast(list(state))) is not None:  # which layers' state, the time added
            tiers = dataclasses.replace(tiers, forecast=(forecast.line(),))
    if state:
        trained.spill(state)
    if tiers.spilled and (forecast := choose.forecast(list(tiers.spilled))) is not None:
        tiers = dataclasses.replace(tiers, forecast=(*tiers.forecast, forecast.line()))
    return tiers, state


def _plan_finished(plan_only: bool, driver: PlacementDriver | None) -> Callable[[], bool]:
    """``plan_only``: finished once the plan was shown (an explicit placement is shown at construction)."""
    if not plan_only:
        return lambda: False
    if driver is None:
        return lambda: True

    def finished() -> bool:
        driver.step()  # the last pass's decision, before the caller stops (nothing when no pass is pending)
        return driver.done

    return finished


def _budget(config: SwapConfig, device: torch.device, log: Callable[[str], None]) -> int | None:
    """The VRAM budget in bytes when the planner places the layers (None: explicit placement, or no budget)."""
    if config.placement.vram_budget is None:
        return None
    if config.placement.explicit:
        log(
            f"DGLS: {', '.join(config.placement.explicit)} given: explicit placement wins over vram_budget "
            f"{config.placement.vram_budget} (the planner is off)"
        )
        return None
    if device.type == "cuda":  # segments the allocator cached before the run (model loading, caching) would be
        torch.cuda.empty_cache()  # reused by it, never released, and read by the probe as its activations
    return resolve_budget(config.placement.vram_budget, device)


def _start_driver(
    config: SwapConfig,
    budget: int | None,
    unit_bytes: int | None,
    device: torch.device,
    log: Callable[[str], None],
    agreement: PlanAgreement | None = None,
    largest_budget: int | None = None,
) -> PlacementDriver | None:
    """The planner for ``budget``: measuring plans on the first steps, or for a full fine-tune one plan fixed
    before its first update (:mod:`..planning.autoplan`). ``agreement``: data parallel, the processes holding these
    layers, whose smallest budget ``budget`` is (the largest: ``largest_budget``; :mod:`..planning.agreement`)."""
    if budget is None:
        return None
    shared = f" ({agreement.budget_note(budget, largest_budget or budget)})" if agreement is not None else ""
    fixed = config.training.host_optimizer is not None
    if fixed:
        log(
            f"DGLS: planning a full fine-tune for a {human_bytes(budget)} VRAM budget{shared}: step 1 runs with every "
            "layer streamed (the probe); before its optimizer step the fastest predicted plan that fits is fixed for "
            "the run (layers it keeps resident train with the trainer's optimizer from step 1 on, so no step moves "
            "them)"
        )
    else:
        log(
            f"DGLS: planning for a {human_bytes(budget)} VRAM budget{shared}: steps 1-2 run with every layer streamed "
            "(warm-up, then the probe); then the best predicted plans are measured on the next steps (about 35), "
            "and the fastest that fits is kept"
        )
    return PlacementDriver(
        budget,
        device,
        log,
        plan_only=config.placement.plan,
        copy_streams=config.transfer.cuda_streams,
        fixed=fixed,
        first_layer=config.placement.first_layer,
        unit_bytes=unit_bytes,
        agreement=agreement,
    )


def _unit_bytes(
    layers: list,
    config: SwapConfig,
    rules: CastRules | None,
    host_trained: bool,
    budget: int | None,
    log: Callable[[str], None],
) -> int | None:
    """The largest swap unit in bytes (None: whole layers): ``swap_unit_mb`` if given, else the planner's
    choice for the VRAM budget and the step's layer-major micro-batches (:mod:`..planning.unit_choice`)."""
    given = config.placement.swap_unit_mb
    if given is not None:  # rounded up: any size above 0, however small, splits (0 alone means whole layers)
        return math.ceil(given * MB) or None
    if budget is None:
        return None

    def sizes(unit: int | None) -> list[LayerSizes]:
        entries = split_layers(layers, unit, trainable_streams=host_trained)
        laid = measure([e.value for e in entries], rules, config.compute.mixed_precision, host_trained=host_trained)
        return [layout.of_entry(e.layer, e.part, e.holder).sizes for layout, e in zip(laid, entries)]

    micro_batches = config.placement.layer_major_micro_batches
    points = split_points(layers, host_trained) if micro_batches > 1 else set()  # the candidates it tries
    choice = choose_unit_bytes(sizes(None), budget, micro_batches, sizes, points)
    if choice.line:
        log(choice.line)
    return choice.unit_bytes


def _offloads_activations(config: SwapConfig, driver: PlacementDriver | None, device: torch.device) -> bool:
    """``offload_activations`` resolved: unset means offload what a VRAM budget needs, on CUDA (on the CPU
    there is no device memory to save, and the planner measures none)."""
    if config.activations.offload_recompute or config.activations.keep_piece_outputs:
        return True
    if config.activations.offload_activations is None:
        return driver is not None and device.type == "cuda"
    return config.activations.offload_activations


def _check_casts_match(layouts: list[LayerLayout], rules: CastRules | None) -> None:
    """Refuse a cast_target pair that casts nothing: never report a cast that does not happen."""
    if rules is None:
        return
    cast_from = {p.param.dtype for layout in layouts for p in layout.params if p.stored != p.param.dtype}
    unused = [(a, b) for a, b in rules.pairs if a not in cast_from]
    if unused:
        present = sorted({name_of(p.param.dtype) for layout in layouts for p in layout.params})
        pairs = ", ".join(f"{name_of(a)} {name_of(b)}" for a, b in unused)
        raise DGLSUserError(
            f"cast_target {pairs} casts nothing: no frozen param of a layer is {name_of(unused[0][0])} (they are "
            f"{', '.join(present) or 'absent'}; norm layers only count with --cast_norms): drop the pair"
        )
