"""The restricted loader: Megatron's files load without Megatron, nothing else executes, enums survive a
re-save."""

from __future__ import annotations

import argparse
import copy
import datetime
import io
import json
import logging
import os
import pickle
import pickletools
import signal
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from megatron_fixtures import all_dirs, distrib_optim_path, model_path

from tiered_ckpt.errors import DecodeError, UnsafePickleError
from tiered_ckpt.megatron import _standins, safe_load
from tiered_ckpt.megatron.torch_zip import iter_torch_save

REPO = Path(__file__).resolve().parents[2]
MODEL = model_path("dp2_tp1_pp2", "mp_rank_00_000")
MEGATRON_GLOBALS = {
    "megatron.core.enums ModelType",
    "megatron.core.transformer.enums AttnBackend",
    "megatron.core.transformer.enums InferenceCudaGraphScope",
}


@pytest.fixture(autouse=True)
def _no_placeholder_modules_left() -> Iterator[None]:
    yield
    _standins.remove_stand_in_modules()


def _globals_of(data: bytes) -> set[str]:
    """The GLOBAL opcodes of a torch zip file's pickle."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return {arg for op, arg, _ in pickletools.genops(z.read(pkl)) if op.name == "GLOBAL"}


def _data_pkl(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(pkl)


def _assert_equal(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, argparse.Namespace):
        _assert_equal(vars(a), vars(b), path)
    else:
        assert a == b, path


# megatron-core is a test dependency (the end-to-end tests use it); these scripts play a reader without it.
_NO_MEGATRON = """
import sys as _sys
class _NoMegatron:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "megatron":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None
_sys.meta_path.insert(0, _NoMegatron())
"""


def _enum_id(member: object) -> tuple[str, str, object]:
    return type(member).__module__, type(member).__qualname__, member.value


def _save(obj: object) -> bytes:
    """The file our writer makes of ``obj`` (torch.save's bytes; stand-ins under their original globals)."""
    return b"".join(bytes(c) for c in iter_torch_save(obj))


def _run(script: str, tmp_path: Path, extra_path: list[Path] = ()) -> dict:
    """Run ``script`` in a fresh interpreter whose sys.path holds the repo (and extra_path), not the tests."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *map(str, extra_path)])
    proc = subprocess.run(
        [sys.executable, "-P", "-c", ("" if extra_path else _NO_MEGATRON) + textwrap.dedent(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------------
# Megatron's files, in a process where megatron cannot be imported


def test_fixture_files_load_and_resave_without_megatron(tmp_path: Path) -> None:
    files = [str(p) for c, d in all_dirs() for p in (model_path(c, d), distrib_optim_path(c, d))]
    result = _run(
        f"""
        import argparse, importlib.util, io, json, pickletools, signal, sys, zipfile
        import numpy as np, torch
        from tiered_ckpt.megatron import safe_load
        out = {{"loaded": [], "enums": None}}
        for path in {files!r}:
            obj = safe_load.load(path)
            out["loaded"].append(path)
            if path.endswith("model_optim_rng.pt"):
                args = obj["args"]
                assert type(args) is argparse.Namespace
                assert args.exit_signal is signal.SIGTERM
                np_state = obj["rng_state"][0]["np_rng_state"]
                assert np_state[0] == "MT19937" and np_state[1].dtype == np.uint32
                assert np_state[1].shape == (624,)
                assert obj["checkpoint_version"] == 3.0 and obj["iteration"] == 10
                out["enums"] = [[type(e).__module__, type(e).__qualname__, e.name, e.value]
                                for e in (args.model_type, args.attention_backend,
                                          args.inference_cuda_graph_scope)]
                model_obj = obj
        out["placeholders_after_load"] = sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
        buf = io.BytesIO()
        torch.save(model_obj, buf)
        again = safe_load.load_bytes(buf.getvalue())
        assert again["args"].model_type is model_obj["args"].model_type
        assert vars(again["args"]) == vars(model_obj["args"])
        z = zipfile.ZipFile(buf)
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
        out["globals"] = sorted({{a for op, a, _ in pickletools.genops(z.read(pkl)) if op.name == "GLOBAL"}})
        print(json.dumps(out))
    """,
        tmp_path,
    )
    assert result["loaded"] == files
    assert result["enums"] == [
        ["megatron.core.enums", "ModelType", "encoder_or_decoder", 1],
        ["megatron.core.transformer.enums", "AttnBackend", "auto", 5],
        ["megatron.core.transformer.enums", "InferenceCudaGraphScope", "none", 1],
    ]
    assert result["placeholders_after_load"] == []  # loading registers nothing
    assert MEGATRON_GLOBALS <= set(result["globals"])


_FAKE_MEGATRON = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/core/enums.py": "import enum\n\nclass ModelType(enum.Enum):\n    encoder_or_decoder = 1\n",
    "megatron/core/transformer/__init__.py": "",
    "megatron/core/transformer/enums.py": (
        "import enum\n\nclass AttnBackend(enum.Enum):\n    flash = 1\n    auto = 5\n\n"
        "class InferenceCudaGraphScope(enum.Enum):\n    none = 1\n"
    ),
}


def test_resaved_file_loads_in_megatrons_own_weights_only_load(tmp_path: Path) -> None:
    """With a (stub) Megatron installed: stand-ins pickle as the real classes, and a plain
    ``torch.load(weights_only=True)`` with Megatron's safe globals (what Megatron does) reads our file."""
    fake = tmp_path / "site"
    for rel, text in _FAKE_MEGATRON.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    result = _run(
        f"""
        import argparse, io, json, signal, sys
        import numpy as np, torch
        from tiered_ckpt.megatron import safe_load
        obj = safe_load.load({str(MODEL)!r})
        assert "megatron" not in sys.modules            # not imported by loading: stand-ins
        standin = type(obj["args"].model_type).__mro__[1].__name__
        buf = io.BytesIO()
        torch.save(obj, buf)                            # pickling imports the real classes
        from megatron.core.enums import ModelType
        from megatron.core.transformer.enums import AttnBackend, InferenceCudaGraphScope
        from numpy._core.multiarray import _reconstruct
        torch.serialization.add_safe_globals([argparse.Namespace, signal.Signals, ModelType, AttnBackend,
                                              InferenceCudaGraphScope, np.ndarray, np.dtype, _reconstruct,
                                              type(np.dtype("uint32"))])
        buf.seek(0)
        plain = torch.load(buf, weights_only=True)
        again = safe_load.load_bytes(buf.getvalue())    # now Megatron is imported: real classes
        print(json.dumps({{"standin": standin,
                          "plain": plain["args"].model_type is ModelType.encoder_or_decoder,
                          "again": again["args"].attention_backend is AttnBackend.auto}}))
    """,
        tmp_path,
        [fake],
    )
    assert result == {"standin": "MegatronEnumStandIn", "plain": True, "again": True}


def test_round_trip_in_process_is_byte_identical() -> None:
    original = MODEL.read_bytes()
    obj = safe_load.load(MODEL)
    data = _save(obj)
    assert MEGATRON_GLOBALS <= _globals_of(data)
    assert _globals_of(data) == _globals_of(original)
    assert _data_pkl(data) == _data_pkl(original)  # the pickle Megatron wrote, byte for byte
    _assert_equal(safe_load.load_bytes(data), obj)


@pytest.mark.parametrize(("config", "subdir"), all_dirs())
def test_load_bytes_equals_load(config: str, subdir: str) -> None:
    for path in (model_path(config, subdir), distrib_optim_path(config, subdir)):
        data = path.read_bytes()
        _assert_equal(safe_load.load_bytes(memoryview(data), where=str(path)), safe_load.load(path))
        _assert_equal(safe_load.load_bytes(bytearray(data)), safe_load.load(path, mmap=True))


# ------------------------------------------------------------------------------------------------------------
# refusals


class _System:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


class _Eval:
    def __reduce__(self) -> tuple:
        return (eval, ("1 + 1",))


def test_os_system_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(lr=1.0, hook=_System(f"touch {marker}"))
    torch.save({"args": args, "model": {"w": torch.ones(2)}}, evil)
    with pytest.raises(UnsafePickleError) as info:
        safe_load.load(evil)
    assert not marker.exists()
    assert str(evil) in str(info.value) and "posix.system" in str(info.value)
    assert info.value.globals == ["posix.system"] and info.value.path == str(evil)
    with pytest.raises(UnsafePickleError, match="posix.system"):
        safe_load.load_bytes(evil.read_bytes(), where="blob")
    assert safe_load.unsafe_globals(evil) == ["posix.system"]
    assert not marker.exists()


def test_every_offending_global_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": _Eval(), "b": datetime.date(2020, 1, 2), "c": argparse.Namespace(x=1)}, path)
    with pytest.raises(UnsafePickleError) as info:
        safe_load.load(path)
    assert info.value.globals == ["builtins.eval", "datetime.date"]
    assert safe_load.unsafe_globals(path.read_bytes()) == ["builtins.eval", "datetime.date"]


def test_trust_pickles_loads_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "x.pt"
    obj = safe_load.load(MODEL)
    obj["when"] = datetime.date(2020, 1, 2)
    path.write_bytes(_save(obj))
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.megatron.safe_load"):
        loaded = safe_load.load(path, trust_pickles=True)
    assert loaded["when"] == datetime.date(2020, 1, 2)
    # stand-ins also under full unpickling (or the real enum, once a full unpickle imported megatron-core)
    assert _enum_id(loaded["args"].model_type) == _enum_id(obj["args"].model_type)
    assert any("trust_pickles=True" in r.message and "datetime.date" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        safe_load.load(MODEL, trust_pickles=True)  # a safe file: no full unpickling, no warning
    assert not caplog.records


def test_pickle_protocol_above_two_needs_trust(tmp_path: Path) -> None:
    """torch's weights-only unpickler lacks protocol 4's opcodes: refused as unsafe, loadable when trusted."""
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(3)}, path, pickle_protocol=4)
    with (
        pytest.raises(UnsafePickleError, match="Unsupported operand"),
        pytest.warns(UserWarning, match="protocol 4"),
    ):
        safe_load.load(path)
    with pytest.warns(UserWarning, match="protocol 4"):  # torch's own warning
        assert torch.equal(safe_load.load(path, trust_pickles=True)["w"], torch.ones(3))


def test_unreadable_files_are_decode_errors(tmp_path: Path) -> None:
    cases = {
        "garbage.pt": b"hello world" * 20,
        "empty.pt": b"",
        "truncated.pt": MODEL.read_bytes()[:5000],
        "zip_no_pickle.pt": _zip_without_pickle(),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DecodeError, match=name):
            safe_load.load(tmp_path / name)
        with pytest.raises(DecodeError):
            safe_load.load_bytes(data)
    with pytest.raises(FileNotFoundError):
        safe_load.load(tmp_path / "missing.pt")


def _zip_without_pickle() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------------------
# the allow-list stays ours


def test_allow_list_is_active_only_while_loading() -> None:
    before = torch.serialization.get_safe_globals()
    safe_load.load(MODEL)
    # the same entries afterwards; torch keeps them in a set, so their order is not part of the contract
    after = torch.serialization.get_safe_globals()
    assert len(after) == len(before) and set(after) == set(before)
    # torch alone still refuses Megatron's file (for Namespace, or, once megatron.core registered its own list in
    # this process, for the enum that megatron-core 0.16 lacks)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(MODEL, weights_only=True)


def test_user_registered_globals_survive() -> None:
    with torch.serialization.safe_globals([argparse.Namespace, signal.Signals]):
        safe_load.load(MODEL)
        assert {argparse.Namespace, signal.Signals} <= set(torch.serialization.get_safe_globals())


def test_concurrent_loads_share_the_allow_list() -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(3):
                safe_load.load(MODEL)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert safe_load._depth == 0 and safe_load._active is None


# ------------------------------------------------------------------------------------------------------------
# stand-ins


def test_enum_stand_ins_behave_like_enum_members() -> None:
    cls = _standins.stand_in("megatron.core.enums.ModelType")
    assert cls is _standins.stand_in("megatron.core.enums.ModelType")
    assert (cls.__module__, cls.__qualname__) == ("megatron.core.enums", "ModelType")
    member = cls(1)
    assert member is cls(1) and member == cls(1) and member != cls(2)
    assert (member.name, member.value) == ("encoder_or_decoder", 1)
    assert repr(member) == "<ModelType.encoder_or_decoder: 1>"
    assert cls(99).name is None and repr(cls(99)) == "<ModelType.?: 99>"
    assert copy.deepcopy(member) is member and copy.copy(member) is member
    with pytest.raises(AttributeError):
        member.value = 2
    assert _standins.stand_in("os.system") is None
    rerun = _standins.stand_in("megatron.core.rerun_state_machine.RerunMode")("disabled")
    assert rerun.name == "DISABLED"


def test_record_stand_in_round_trip() -> None:
    cls = _standins.stand_in("megatron.core.optimizer.optimizer_config.OptimizerConfig")
    cfg = cls.__new__(cls)
    cfg.__dict__.update({"lr": 1e-3, "optimizer": "adam", "params_dtype": torch.bfloat16})
    data = _save({"cfg": cfg})
    assert "megatron.core.optimizer.optimizer_config OptimizerConfig" in _globals_of(data)
    assert "NEWOBJ" in {op.name for op, _, _ in pickletools.genops(_data_pkl(data))}
    loaded = safe_load.load_bytes(data)["cfg"]
    if type(loaded) is cls:  # megatron-core not imported in this process: the stand-in comes back
        assert loaded == cfg
    else:  # the real OptimizerConfig (its defaults, then our fields)
        assert (type(loaded).__module__, type(loaded).__qualname__) == (cls.__module__, cls.__qualname__)
        assert {k: getattr(loaded, k) for k in cfg.__dict__} == cfg.__dict__
    assert loaded.params_dtype is torch.bfloat16


def test_placeholder_modules_only_when_pickling(tmp_path: Path) -> None:
    """Other picklers (plain torch.save) find a stand-in through placeholder modules, where Megatron is missing."""
    result = _run(
        f"""
        import json, pickle, sys
        from tiered_ckpt.megatron import _standins, safe_load
        obj = safe_load.load({str(MODEL)!r})
        assert "megatron.core.enums" not in sys.modules
        pickle.dumps(obj["args"].model_type, protocol=2)
        assert sys.modules["megatron.core.enums"].ModelType is type(obj["args"].model_type)
        try:
            import megatron.core.transformer  # the placeholders are not packages
            imported = True
        except ImportError:
            imported = False
        removed = "megatron.core.enums" in _standins.remove_stand_in_modules()
        print(json.dumps([imported, removed, "megatron.core.enums" in sys.modules, "torch.ops" in sys.modules]))
    """,
        tmp_path,
    )
    assert result == [False, True, False, True]  # modules that answer every getattr (torch.ops) are left alone
