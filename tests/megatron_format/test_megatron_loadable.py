"""Files Megatron-LM can load, whatever process writes them: stand-ins of classes a drain worker never imported are
written under their original globals, byte for byte; a file Megatron's weights-only loader would refuse is never
committed, and ``verify`` / ``convert`` report one they find."""

from __future__ import annotations

import argparse
import enum
import io
import pickle
import pickletools
import sys
import types
import uuid
import zipfile
from pathlib import Path

import pytest
import torch
from megatron_synthetic import SyntheticJob, write_checkpoint

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.codecs import flat
from tiered_ckpt.errors import UnsafePickleError
from tiered_ckpt.handles import SaveError
from tiered_ckpt.inventory import verify_step
from tiered_ckpt.megatron import loadable
from tiered_ckpt.megatron.convert import convert, open_store
from tiered_ckpt.megatron.torch_zip import iter_torch_save


def _file(obj: object, **kw: object) -> bytes:
    return b"".join(bytes(c) for c in iter_torch_save(obj, archive="model_optim_rng", **kw))


def _pkl(data: bytes) -> bytes:
    z = zipfile.ZipFile(io.BytesIO(data))
    return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _globals(data: bytes) -> set[str]:
    return {a for op, a, _ in pickletools.genops(_pkl(data)) if op.name == "GLOBAL"}


@pytest.fixture
def enum_module():
    """An enum in a module that exists now and is gone when the snapshot is restored (as in a drain worker)."""
    name = f"job_enums_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(name)

    class Mode(enum.Enum):
        fast = 1
        safe = 2

    Mode.__module__, Mode.__qualname__ = mod.__name__, "Mode"
    mod.Mode = Mode
    sys.modules[name] = mod
    yield mod
    sys.modules.pop(name, None)


def test_restored_stand_ins_pickle_as_the_original_globals(enum_module) -> None:
    Mode = enum_module.Mode
    args = argparse.Namespace(mode=Mode.fast, again=Mode.fast, other=Mode.safe, lr=0.5)
    state = {"args": args, "w": torch.arange(6.0), "modes": [Mode.safe, Mode.fast]}
    reference = _file(state)
    plan = flat.plan_snapshot(state)
    buf = torch.empty(plan.total_bytes, dtype=torch.uint8)
    flat.copy_into(plan, buf)
    header = flat.encode_header(plan)
    del sys.modules[enum_module.__name__]  # the restoring process never imported it
    restored = flat.restore(flat.decode_header(header), buf)
    assert isinstance(restored["args"].mode, flat.EnumStandIn)
    assert restored["args"].mode is not restored["args"].again  # separate records, still one memo entry below
    written = _file(restored)
    assert written == reference  # byte for byte what the real enum gives
    assert f"{enum_module.__name__} Mode" in _globals(written)
    assert not any("tiered_ckpt" in g for g in _globals(written))
    with pytest.raises(pickle.PicklingError, match=f"stands in for {enum_module.__name__}.Mode"):
        pickle.dumps(restored["args"].mode)  # any other pickler: a clear error, never a tiered_ckpt global


def test_megatron_fixture_resaves_byte_identical_without_megatron_classes() -> None:
    """The fixtures come from a newer Megatron than megatron-core 0.16 (InferenceCudaGraphScope): our writer still
    re-emits every global as Megatron wrote it."""
    from megatron_fixtures import model_path

    from tiered_ckpt.megatron import safe_load

    path = model_path("dp2_tp1_pp2", "mp_rank_00_000")
    obj = safe_load.load(path)
    assert _pkl(_file(obj)) == _pkl(path.read_bytes())


def test_refused_globals_match_megatrons_loader() -> None:
    import numpy as np

    ok = {"args": argparse.Namespace(x=1), "rng": np.random.get_state(), "t": torch.zeros(2)}
    assert loadable.refused_globals(_pkl(_file(ok))) == []
    bad = {"args": argparse.Namespace(hook=print, when=np.float32(1.0).dtype)}
    refused = loadable.refused_globals(_pkl(_file(bad)))
    assert "builtins.print" in refused and "numpy.dtypes.Float32DType" in refused  # Megatron allows only uint32's
    # What torch's own loader with Megatron's safe globals says about the same file (ground truth):
    from megatron.core.safe_globals import SAFE_GLOBALS

    # Megatron's list as its import registers it (explicit: an earlier test of this process may have imported
    # megatron.core already and left torch's safe globals as they were before it)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        torch.load(io.BytesIO(_file(ok)), weights_only=True)
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(_file({"args": argparse.Namespace(when=np.float32(1.0).dtype)})),
                       weights_only=True)


def test_writer_refuses_what_megatron_refuses() -> None:
    from tiered_ckpt.errors import EncodeError

    with pytest.raises(EncodeError, match=r"model_optim_rng.pt: .*refuses builtins.print"):
        _file({"args": argparse.Namespace(hook=print)}, megatron_loadable=True)
    # Another item in torch format (codecs: {state: torch}): the same allow-list, said without Megatron's load
    # (a user's trial: "its load_checkpoint would stop" about a plain item of a rank_sharded job)
    import numpy as np

    from tiered_ckpt.megatron.torch_zip import iter_torch_save

    with pytest.raises(EncodeError, match=r"item 'state' \(codec torch\): numpy.* would not load back.*codec \(flat\)"):
        b"".join(bytes(c) for c in iter_torch_save({"lr": np.float64(0.1)}, archive="state", megatron_loadable=True))


def _engine(tmp_path: Path, shm_root: str, run_id: str, mode: str | None) -> CheckpointEngine:
    cfg = {"run_id": run_id, "layout": "rank_sharded",
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "fsspec", "url": f"file://{tmp_path / mode_dir(mode)}"}]}
    if mode is not None:
        cfg["drain"] = {"mode": mode}
    return CheckpointEngine(cfg)


def mode_dir(mode: str | None) -> str:
    return f"ckpt-{mode or 'default'}"


def test_process_and_thread_drains_write_the_same_model_file(tmp_path: Path, shm_root: str) -> None:
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    state = {"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
                                        lr=1e-4),
             "iteration": 7, "model": {"w": torch.arange(12.0).reshape(3, 4)}}
    files = {}
    for mode in (None, "thread"):  # None: the default (a drain process, which never imports Megatron)
        with _engine(tmp_path, shm_root, f"ld{uuid.uuid4().hex[:6]}", mode) as engine:
            engine.save(7, {"model_optim_rng": state}).wait(timeout=60)
        (path,) = (tmp_path / mode_dir(mode)).rglob("model_optim_rng.pt")
        files[mode] = path.read_bytes()
    assert files[None] == files["thread"]
    assert {"megatron.core.enums ModelType", "megatron.core.transformer.enums AttnBackend"} <= _globals(files[None])
    from megatron.core.safe_globals import SAFE_GLOBALS

    with torch.serialization.safe_globals(SAFE_GLOBALS):  # what megatron.core registers at its (first) import
        loaded = torch.load(io.BytesIO(files[None]), weights_only=True)  # Megatron's own call
    assert loaded["args"].model_type is ModelType.encoder_or_decoder


def test_a_file_megatron_would_refuse_fails_the_step(tmp_path: Path, shm_root: str, recorder, enum_module) -> None:
    run_id = f"ld{uuid.uuid4().hex[:6]}"
    with _engine(tmp_path, shm_root, run_id, None) as engine:
        engine.save(1, {"model_optim_rng": {"args": argparse.Namespace(lr=1.0), "iteration": 1}}).wait(timeout=60)
        # A user's own enum in args: fine in a snapshot, refused by Megatron's loader.
        args = argparse.Namespace(mode=enum_module.Mode.safe)
        handle = engine.save(2, {"model_optim_rng": {"args": args, "iteration": 2}})
        with pytest.raises(SaveError, match=f"refuses {enum_module.__name__}.Mode"):
            handle.wait(timeout=60)
        assert engine.available_steps()["disk"] == [1]  # step 1 stays the newest committed one
    assert any(f"{enum_module.__name__}.Mode" in e.message for e in recorder.events if e.step == 2), recorder.events


def _bad_checkpoint(tmp_path: Path) -> Path:
    job = SyntheticJob(dp=2)
    real = job.model_optim_rng
    job.model_optim_rng = lambda shard: {**real(shard), "hook": print}  # type: ignore[method-assign]
    write_checkpoint(job, tmp_path / "bad", layout="rank_sharded")  # test helper: writes without the check
    return tmp_path / "bad"


def test_verify_reports_a_file_megatron_would_refuse(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = _bad_checkpoint(tmp_path)
    store = open_store(str(src), "rank_sharded", "check")
    (step,) = store.committed_steps()
    report = verify_step(store, step)
    assert not report.ok and any("refuses builtins.print" in p for p in report.problems), report.problems
    assert cli_main(["verify", str(src)]) == 1
    assert "builtins.print" in capsys.readouterr().out


def test_convert_refuses_a_file_megatron_would_refuse(tmp_path: Path) -> None:
    src = _bad_checkpoint(tmp_path)
    with pytest.raises(UnsafePickleError, match="builtins.print"):
        convert(src, tmp_path / "out", to="megatron", progress=False)
    assert not list((tmp_path / "out").glob("iter_*"))  # nothing half-written stays behind to block a retry
    assert cli_main(["convert", str(src), str(tmp_path / "out2"), "--to", "megatron"]) == 1
    report = convert(src, tmp_path / "out", to="megatron", progress=False, trust_pickles=True)  # the retry
    assert report.files
    report = convert(src, tmp_path / "out3", to="megatron", progress=False, trust_pickles=True)
    assert any("builtins.print" in n for n in report.notes)
