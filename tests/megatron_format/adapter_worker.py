"""One rank of the adapter's multi-node memory resume (tests/megatron_format/test_megatron_adapter.py), with
Megatron's objects faked (fakes.py): save to shm only and die, or resume through the adapter."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from fakes import fake_rank, fingerprint, scramble  # noqa: E402
from megatron_synthetic import ModelSpec, SyntheticJob  # noqa: E402
from rank_main import rank_main  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402
from tiered_ckpt.megatron import adapter  # noqa: E402


def body(rank: int, world: int, spec: dict, out: dict) -> None:
    job = SyntheticJob(ModelSpec(num_layers=2), **spec["job"])
    r = fake_rank(job, rank)
    engine = CheckpointEngine(spec["config"], job.parallel)
    if spec["mode"] == "save":
        adapter.save_checkpoint(job.iteration, r.model, r.optimizer, r.scheduler, 3.0, engine=engine, args=r.args,
                                rng_tracker=r.rng_tracker).wait(timeout=60)
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing is closed, the shm snapshots stay
    want = hashlib.sha256(json.dumps(fingerprint(r), default=repr, sort_keys=True).encode()).hexdigest()
    scramble(r)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("tiered_ckpt.megatron.adapter").addHandler(handler)
    logging.getLogger("tiered_ckpt.megatron.adapter").setLevel(logging.INFO)
    got = adapter.load_checkpoint(r.model, r.optimizer, r.scheduler, engine=engine, args=r.args,
                                  rng_tracker=r.rng_tracker)
    out["result"] = list(got)
    out["source"] = [rec.getMessage() for rec in records if "model_optim_rng from" in rec.getMessage()]
    out["same"] = hashlib.sha256(json.dumps(fingerprint(r), default=repr, sort_keys=True).encode()).hexdigest() == want
    engine.close()


if __name__ == "__main__":
    rank_main(body)
