"""``tiered-ckpt demo``: a small GPT trains on 4 ranks, checkpoints through the tiers, crashes, and resumes.

The schedule's arithmetic is here, in the standard library only, so the command line checks ``--steps`` before it
imports torch.
"""

from __future__ import annotations

SAVE_EVERY = 5  # a checkpoint every this many steps


def default_kill_step(steps: int) -> int:
    """The step at which the demo's crashed run loses a rank: late in the run, between two saves where it can."""
    return steps * 3 // 4 + 1


def min_steps(save_every: int = SAVE_EVERY) -> int:
    """The fewest steps with which the demo can crash and resume: a save must come *before* the kill step.

    A save at an earlier step is complete on every rank when the rank dies (every rank has to be in the kill
    step's collectives for it to get there), and without a save every rank finds nothing to resume from. (A save
    on the kill step itself is complete too, since the ranks meet at a barrier before the kill, but a run whose
    only save is at the step where it fails shows little of a resume.)"""
    steps = 1
    while default_kill_step(steps) <= save_every:
        steps += 1
    return steps
