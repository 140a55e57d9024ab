"""Processes that train one model each while sharing their fetches (utils/dgls/memory/fetch_share.py): shared by the
CPU tests (gloo) and the GPU tests (NCCL, delays injected).

Every process trains the same layers on the same data, alone: no gradient crosses processes. The one thing they
share is each streamed layer's copy: a process copies its share of the layer from host memory and gathers the rest
from the others. So every process must train exactly what it trains with every layer resident, and a gather that
brings a wrong share (another layer's, a share not copied yet, a slot overwritten early) changes the numbers. Rank
``slow`` sleeps in every layer use, so the others' gathers wait for it (and its own run behind theirs).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
from helpers import SMALL, make_layers, round_as_stored, train

from utils.dgls import LayerSwapper, Listener, SwapConfig
from utils.dgls.demo.model import DemoModelConfig
from utils.dgls.memory import fetch_share
from utils.dgls.memory.fetch_share import FetchShare
from utils.dgls.memory.precision import CastRules
from utils.dgls.memory.transport import Direction
from utils.dgls.streaming.config import ComputePolicy

FLUX_WIDTH = DemoModelConfig(hidden=3072, heads=24, double_blocks=2, single_blocks=2, text_dim=64, latent_channels=16)
MS = 2_000_000  # torch.cuda._sleep cycles per millisecond at ~2 GHz


class Sleep(Listener):
    """A slower process: a sleep at the start of every layer use (on the compute stream on CUDA)."""

    def __init__(self, ms: float, cuda: bool) -> None:
        self.ms, self.cuda = ms, cuda

    def use_started(self, layer, phase, streamed, missed):
        if self.cuda:
            torch.cuda._sleep(int(self.ms * MS))
        else:
            time.sleep(self.ms / 1000)


def rank_main(
    rank: int, world: int, port: int, folder: Path, cuda: bool, settings: dict, mutate: str, slow_rank: int
) -> None:
    """One process: the resident run, then the streamed run with shared fetches; both records to ``folder``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.use_deterministic_algorithms(True)
    dtype, cfg = (torch.bfloat16, FLUX_WIDTH) if cuda else (torch.float32, SMALL)
    if mutate == "no_gather":  # the canary: each process keeps only its own share of every layer
        FetchShare.gather = lambda self, regions: None
    if mutate == "slow_gather":  # auto measures a gather too slow to pay: it declines, and lets its group go
        fetch_share.MARGIN = 1e9
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        template, _ = make_layers(dtype, cfg)
        layers = copy.deepcopy(template)
        trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        for layer in layers:
            layer.to(device)
        if "cast_target" in settings:  # fp8 storage: the reference's cast params rounded as DGLS rounds them
            round_as_stored(layers, CastRules.from_policy(ComputePolicy(cast_target=settings["cast_target"])), device)
        resident = train(layers, trainable, device, "nonreentrant", dtype=dtype, cfg=cfg)
        layers = copy.deepcopy(template)
        trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        lines: list[str] = []
        config = SwapConfig.of(**settings)
        with LayerSwapper(layers, config, device=device, log=lines.append) as swapper:
            shared = swapper.copier.share is not None
            if cuda:
                for direction in Direction:
                    swapper.transport.delay[direction] = int((20 if direction is Direction.WEIGHTS_IN else 5) * MS)
            if rank == slow_rank:
                swapper.add_listener(Sleep(5.0, cuda))
            streamed = train(layers, trainable, device, "nonreentrant", dtype=dtype, cfg=cfg)
            fetches = swapper.total_stats(sync=True).fetches
        torch.save(
            {"resident": resident, "streamed": streamed, "lines": lines, "shared": shared, "fetches": fetches},
            folder / f"rank{rank}.pt",
        )
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(folder: Path, world: int, cuda: bool, settings: dict, mutate: str = "", slow_rank: int = 1) -> list[dict]:
    """Spawn ``world`` processes of :func:`rank_main` (``settings``: the SwapConfig's); their records in rank order."""
    from utils.dgls.program.distributed import free_port

    args = (world, free_port(), folder, cuda, settings, mutate, slow_rank)
    torch.multiprocessing.spawn(rank_main, args=args, nprocs=world)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]
