"""``tiered-ckpt demo``: a small GPT trains on 4 ranks, checkpoints through the tiers, crashes, and resumes."""
