"""One rank of a DCP test job (started by tests/dcp/test_dcp_multirank.py): an FSDP2 model and its optimizer,
saved and loaded with torchtitan's calls (``get_state_dict`` / ``set_state_dict``) through ``dcp.save``,
``dcp.async_save`` and ``dcp.load``, with our writer and reader or DCP's own ``FileSystem*``."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from rank_main import rank_main  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402
from tiered_ckpt.dcp import TieredStorageReader, TieredStorageWriter  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)


def build(seed: int, train_steps: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model sharded with FSDP2 over every rank; ``train_steps`` AdamW steps give it optimizer state."""
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 12),
                                torch.nn.LayerNorm(12))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(train_steps):
        torch.manual_seed(1000 + i)
        model(torch.randn(8, 24)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": step, "note": f"after step {step}"}}


def fingerprint(state: dict) -> str:
    """A digest of the whole (unsharded) state: DTensors are gathered, so every rank computes the same."""
    h = hashlib.sha256()

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            h.update(f"{prefix}:{full.dtype}:{tuple(full.shape)}".encode())
            h.update(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("", state)
    return h.hexdigest()


def body(rank: int, world: int, spec: dict, out: dict) -> None:
    model, opt = build(seed=0, train_steps=spec.get("train_steps", 2), world=world)
    for action in spec["actions"]:
        kind = action["do"]
        if kind == "train":  # one more optimizer step: the state changes
            model(torch.randn(8, 24)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        elif kind == "save":
            step = action["step"]
            state = app_state(model, opt, step)
            out[action.get("tag", f"saved_{step}")] = fingerprint(state)
            if action.get("writer") == "filesystem":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(action["dir"]))
                continue
            with CheckpointEngine(action["config"]) as engine:
                writer = TieredStorageWriter(engine, persistent=action.get("persistent", True))
                if action.get("fail_finish"):  # the coordinator fails after every rank's write_data
                    def finish(metadata, results):
                        raise RuntimeError("injected: the coordinator's finish failed")

                    writer.finish = finish
                    try:
                        dcp.save(state, storage_writer=writer, checkpoint_id=step)
                    except BaseException as exc:  # DCP raises CheckpointException (a BaseException) on every rank
                        out["save_failed"] = "injected" in str(exc)
                    engine.wait()
                    continue
                if action.get("async"):
                    fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)
                    fut.result()
                else:
                    dcp.save(state, storage_writer=writer, checkpoint_id=step,
                             use_collectives=action.get("use_collectives", True))
                out.setdefault("blocking_s", []).append(writer.last_handle.blocking_s)
                if action.get("sigkill"):
                    print("{}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                writer.wait(timeout=120)
                # committed on every rank once wait() returns, not only on the committing rank
                out.setdefault("listed_after_wait", {})[step] = sorted(
                    t for t, steps in engine.available_steps().items() if step in steps)
        elif kind == "load":
            fresh, fresh_opt = build(seed=1, train_steps=0, world=world)  # other values everywhere
            state = app_state(fresh, fresh_opt, -1)
            name = action["name"]
            if action.get("reader") == "filesystem":
                dcp.load(state, storage_reader=dcp.FileSystemReader(action["dir"]))
                out[name] = {"step": state["extra"]["step"]}
            elif action.get("reader") == "path":
                reader = TieredStorageReader(path=action["dir"])
                dcp.load(state, storage_reader=reader)
                out[name] = {"step": state["extra"]["step"], "sources": reader.sources, "verified": reader.verified}
            else:
                with CheckpointEngine(action["config"]) as engine:
                    reader = TieredStorageReader(engine, step=action.get("step"))
                    dcp.load(state, storage_reader=reader)
                    out[name] = {"step": reader.step, "sources": reader.sources, "verified": reader.verified}
            set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            out[name]["fingerprint"] = fingerprint(app_state(fresh, fresh_opt, state["extra"]["step"]))
            out[name]["extra"] = state["extra"]


if __name__ == "__main__":
    rank_main(body, exit_at_once=True)  # DTensor keeps the gloo group alive past its destroy: see rank_main
