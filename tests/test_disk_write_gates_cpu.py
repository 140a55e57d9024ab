"""The CPU transport's disk writes wait for their gates when they run, as the CUDA backend's disk job does.

- A write's gates land when the write is performed (waited for), not when it is submitted: a write gated on the
  copy that fills its source writes that copy's bytes, even where the copy was issued after the write was submitted
  (landing a gate not issued yet does nothing).
- Mutations: a write gated on nothing, or on another copy, writes the source's NaN bytes (the fill copy is late) and
  the check fails.
- A gate waited for only by a write lands no earlier than the write: an earlier write it is gated on stays out of
  the file until then, so a read that does not wait for that earlier write still reads the old bytes.
"""

import os
import threading

import pytest
import torch

from utils.dgls.memory.disk_io import ThreadReader
from utils.dgls.memory.disk_tier import DiskFile
from utils.dgls.memory.pinned import PAGE, page_aligned_empty
from utils.dgls.memory.transport import POISON, Copy, Direction, Transport

CPU = torch.device("cpu")
OLD, STALE, FRESH = 3, 5, 7  # the file's bytes before, the source's before its fill copy, the fill copy's


@pytest.fixture
def disk(tmp_path):
    """A two-page file of OLD bytes, its reader and a CPU transport."""
    file = DiskFile(tmp_path, 2 * PAGE)
    os.pwrite(file.fd, bytes([OLD]) * file.nbytes, 0)
    reader = ThreadReader(file.fd, 1)
    transport = Transport(CPU)
    try:
        yield file, reader, transport
    finally:
        transport.close()
        reader.close()
        file.close()


def in_file(file: DiskFile, offset: int) -> set[int]:
    return set(os.pread(file.fd, PAGE, offset))


@pytest.mark.parametrize("issued_first", [False, True], ids=["fill issued after the write", "fill issued first"])
@pytest.mark.parametrize("gate", ["the fill copy", "nothing", "another copy"])
def test_a_write_writes_the_bytes_of_the_copy_it_is_gated_on(disk, gate, issued_first):
    file, reader, transport = disk
    src = page_aligned_empty(PAGE).fill_(STALE)
    fresh = torch.full((PAGE,), FRESH, dtype=torch.uint8)
    fill = Copy(direction=Direction.STATE_OUT, issued=threading.Event())  # its token, handed out before it is issued

    def issue_fill() -> None:  # late: src holds NaN bytes until something waits for the fill
        transport.submit(Direction.STATE_OUT, [(src, fresh)], into=fill)
        fill.issued.set()

    if issued_first:
        issue_fill()
    other = transport.submit(Direction.STATE_OUT, [(torch.empty(PAGE, dtype=torch.uint8), fresh)])
    gates = {"the fill copy": [fill], "nothing": [], "another copy": [other]}[gate]
    write = transport.write(src, 0, gates, disk=reader)
    assert in_file(file, 0) == {OLD}  # late: nothing written before the write is waited for
    if not issued_first:
        issue_fill()
    transport.land(write)
    if gate == "the fill copy":
        assert in_file(file, 0) == {FRESH}
    else:  # the mutation: the fill never landed before the write read src
        assert in_file(file, 0) == {POISON}
    assert in_file(file, PAGE) == {OLD}


def test_a_gate_waited_for_only_by_a_write_lands_with_the_write_not_at_its_submission(disk):
    """The second write is gated on the first (the slot's write before): the first lands when the second is waited
    for. Until then a read of the first's extent that does not wait for it reads the old bytes, as on the device,
    where the first may not have run yet: the mutation shows."""
    file, reader, transport = disk
    first = transport.write(page_aligned_empty(PAGE).fill_(FRESH), 0, [], disk=reader)
    second = transport.write(page_aligned_empty(PAGE).fill_(FRESH), PAGE, [first], disk=reader)
    dst = page_aligned_empty(PAGE)
    transport.land(transport.read(dst, 0, [], disk=reader))  # not gated on ``first``
    assert set(dst.tolist()) == {OLD}
    transport.land(second)
    assert first.pending is None and in_file(file, 0) == {FRESH} and in_file(file, PAGE) == {FRESH}
    transport.land(transport.read(dst, 0, [first], disk=reader))
    assert set(dst.tolist()) == {FRESH}
