"""Give freed tensor memory back to the system, so a training process's resident memory stays where its weights,
gradients, optimizer state and one micro-batch's activations put it.

    bound_heap()     # once, in a process that trains (training.run.load_learner, training.sft.run_sft)

glibc's malloc serves a block above its mmap threshold with its own mapping, unmapped when freed, and everything
below from heaps that it rarely shrinks. The threshold starts at 128 KiB and rises to the size of each mapped block
freed, up to 32 MiB, so after the first backward pass the activations of every later micro-batch (a few MiB each,
a different size each time) come from heaps that fragment and keep growing. Measured on this machine with
SmolLM2-135M (weights, gradients and AdamW state: 2.1 GB), a plate run's process (vLLM sampling) grew
2.8 -> 6.1 -> 9.1 GB over three steps and was killed past 14 GB; with the threshold fixed at 128 KiB it stayed at
2.6-2.8 GB over five steps (peak during an update 6.4 GB). The update alone on 4 synthetic sequences a step: 0.56
-> 5.5 GB unbounded, 2.1 GB flat bounded (1 MiB: 2.3 -> 2.8 GB in 8 steps, still growing). The price is the page
faults of fresh mappings: that update took 38 % longer (28.3 s vs 20.5 s a step, 6 steps each; PyTorch's
THP_MEM_ALLOC_ENABLE huge pages did not help: 30.3 s). A killed run costs more.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h); setting it also stops its adaptation."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own starting value: larger blocks are mapped and unmapped; 1 MiB already let the heap grow (above)."""


def bound_heap() -> bool:
    """Fix glibc's mmap threshold for this process; False (and a log line) where the C library is not glibc."""
    libc, _ = platform.libc_ver()
    if libc != "glibc":
        logger.info("C library %r, not glibc: the training process's heap is left to its allocator", libc)
        return False
    return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
