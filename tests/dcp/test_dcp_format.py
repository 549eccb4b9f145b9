"""DCP's file format through our writer and reader in one process: the bytes DCP's FileSystemWriter writes, the
offsets computed from the plan, a corrupt file taken from the next tier, the .metadata allow-list, the CLI."""

from __future__ import annotations

import io
import json
import pickle
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import EXIT_FAILED, EXIT_OK, main
from tiered_ckpt.dcp import TieredStorageReader, TieredStorageWriter
from tiered_ckpt.dcp._format import DistcpCodec, iter_tensor_record, load_metadata, torch_save_length
from tiered_ckpt.dcp.writer import parse_step
from tiered_ckpt.errors import ConfigError, DecodeError, EncodeError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is up


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
                      "mask": torch.rand(3, 3, generator=g) > 0.5, "count": torch.tensor(7 + seed)},
            "extra": {"step": seed, "name": f"run {seed}", "lr": [0.1, 0.01]}}


def zeros_like(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
            "extra": {"step": -1, "name": "", "lr": []}}


def assert_same(a: dict, b: dict) -> None:
    assert a["extra"] == b["extra"]
    for k, v in a["model"].items():
        assert v.dtype == b["model"][k].dtype and torch.equal(v, b["model"][k]), k


def engine_config(tmp_path: Path, names: tuple[str, ...] = ("disk",), shm: str | None = None) -> dict:
    tiers = [{"name": "shm", "kind": "shm", "path": shm}] if shm else []
    tiers += [{"name": n, "kind": "local", "path": str(tmp_path / n)} for n in names]
    return {"run_id": f"dcp{uuid.uuid4().hex[:8]}", "layout": "dcp", "drain": {"mode": "thread"}, "tiers": tiers}


def _flip_middle_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def save(cfg: dict, sd: dict, step: int) -> None:
    with CheckpointEngine(cfg) as engine:
        writer = TieredStorageWriter(engine)
        dcp.save(sd, storage_writer=writer, checkpoint_id=step)
        writer.wait(timeout=60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 3), (64, 65), (2, 3, 4)])
def test_torch_save_length_is_the_length_of_torch_save(dtype, shape):
    t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 3).reshape(shape).to(dtype)
    buf = io.BytesIO()
    torch.save(t, buf)
    ours = b"".join(bytes(memoryview(c).cast("B")) if not isinstance(c, torch.Tensor) else c.numpy().tobytes()
                    for c in iter_tensor_record(t))
    assert torch_save_length(dtype, shape) == len(buf.getvalue()) == len(ours)
    assert ours == buf.getvalue()  # torch.save's very bytes


def test_our_files_are_dcp_filesystemwriter_bytes_and_both_readers_read_both(tmp_path, shm_root):
    sd = state(1)
    cfg = engine_config(tmp_path, shm=shm_root)
    save(cfg, sd, 10)
    ours = tmp_path / "disk" / "iter_0000010"
    theirs = tmp_path / "theirs"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(theirs)))
    assert (ours / "__0_0.distcp").read_bytes() == (theirs / "__0_0.distcp").read_bytes()
    with open(ours / ".metadata", "rb") as f_ours, open(theirs / ".metadata", "rb") as f_theirs:
        m_ours, m_theirs = pickle.load(f_ours), pickle.load(f_theirs)
    assert m_ours.state_dict_metadata == m_theirs.state_dict_metadata
    assert {k: (v.relative_path, v.offset, v.length) for k, v in m_ours.storage_data.items()} == {
        k: (v.relative_path, v.offset, v.length) for k, v in m_theirs.storage_data.items()}
    # DCP's reader on our step directory; our reader on DCP's directory and on our tiers
    loaded = zeros_like(sd)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(ours)))
    assert_same(sd, loaded)
    loaded = zeros_like(sd)
    reader = TieredStorageReader(path=theirs)
    dcp.load(loaded, storage_reader=reader)
    assert_same(sd, loaded) and not reader.verified
    with CheckpointEngine(cfg) as engine:
        loaded = zeros_like(sd)
        reader = TieredStorageReader(engine)
        dcp.load(loaded, storage_reader=reader)
        assert_same(sd, loaded)
        assert (reader.step, reader.sources, reader.verified) == (10, {"__0_0.distcp": "shm"}, True)


def test_a_corrupt_file_is_taken_from_the_next_tier_and_named_when_no_tier_has_it(tmp_path, caplog, recorder):
    sd = state(2)
    cfg = engine_config(tmp_path, ("fast", "slow"))
    save(cfg, sd, 5)
    _flip_middle_byte(tmp_path / "fast" / "iter_0000005" / "__0_0.distcp")
    with CheckpointEngine(cfg) as engine:
        loaded = zeros_like(sd)
        reader = TieredStorageReader(engine)
        dcp.load(loaded, storage_reader=reader)
    assert_same(sd, loaded)
    assert reader.sources == {"__0_0.distcp": "slow"} and reader.verified
    assert "checksum mismatch" in caplog.text and "fast" in caplog.text
    fallback, = recorder.kinds("fallback", tier="fast")
    assert fallback.step == 5 and fallback.detail["key"] == "__0_0.distcp" and "checksum" in fallback.message
    load, = recorder.kinds("load")
    assert (load.tier, load.step, load.detail["verified"], load.detail["format"]) == ("slow", 5, True, "dcp")
    only_fast = {**cfg, "tiers": cfg["tiers"][:1]}
    with CheckpointEngine(only_fast) as engine, pytest.raises(CheckpointException) as err:
        dcp.load(zeros_like(sd), storage_reader=TieredStorageReader(engine))
    assert "__0_0.distcp" in str(err.value) and "checksum mismatch" in str(err.value)


def test_a_tier_s_step_directory_as_checkpoint_id_reads_through_the_tiers(tmp_path):
    """checkpoint_id=<tier root>/iter_N named a plain directory: a damaged file was read unverified, with a verified
    copy on the next tier, and the path stuck to the reader when a step was named next (a DCP trial)."""
    sd, newer = state(3), state(4)
    cfg = engine_config(tmp_path, ("fast", "slow"))
    save(cfg, sd, 5)
    save(cfg, newer, 6)
    _flip_middle_byte(tmp_path / "fast" / "iter_0000005" / "__0_0.distcp")
    with CheckpointEngine(cfg) as engine:
        reader = TieredStorageReader(engine)
        loaded = zeros_like(sd)
        dcp.load(loaded, storage_reader=reader, checkpoint_id=str(tmp_path / "fast" / "iter_0000005"))
        assert_same(sd, loaded)
        assert (reader.step, reader.sources, reader.verified) == (5, {"__0_0.distcp": "slow"}, True)
        elsewhere = tmp_path / "plain"
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(elsewhere)))
        export = tmp_path / "slow" / "export"  # in a tier's root, but not a step's directory
        dcp.save(newer, storage_writer=dcp.FileSystemWriter(str(export)))
        for checkpoint_id, want, verified in ((str(elsewhere), sd, False), (6, newer, True),
                                              (str(export), newer, False), ("iter_0000005", sd, True)):
            loaded = zeros_like(sd)
            dcp.load(loaded, storage_reader=reader, checkpoint_id=checkpoint_id)
            assert_same(want, loaded)
            assert reader.verified is verified, checkpoint_id
            loaded = zeros_like(sd)
            dcp.load(loaded, storage_reader=reader)  # no checkpoint_id: the same again, as DCP's own readers do
            assert_same(want, loaded)


def test_a_plain_dcp_step_saved_without_collectives_is_found_on_a_tier(tmp_path):
    """DCP's FileSystemWriter with use_collectives=False writes only __<rank>.metadata: DCP's reader loads it, and
    the engine-backed reader said no tier held the step (a DCP trial)."""
    sd = state(5)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "disk" / "iter_0000040")), no_dist=True,
             use_collectives=False)
    assert sorted(p.name for p in (tmp_path / "disk" / "iter_0000040").iterdir()) == ["__0.metadata",
                                                                                  "__0_0.distcp"]
    with CheckpointEngine(engine_config(tmp_path)) as engine:
        loaded, reader = zeros_like(sd), TieredStorageReader(engine)
        dcp.load(loaded, storage_reader=reader)
    assert_same(sd, loaded)
    assert (reader.step, reader.sources, reader.verified) == (40, {"__0_0.distcp": "disk"}, False)


def test_a_dcp_transform_is_named_not_taken_for_an_unsafe_pickle(tmp_path):
    """FileSystemWriter(_extensions=[ZStandard()]) compresses each record: our reader said "refused by the
    weights-only unpickler" (a DCP trial). It names the transform and what reads it."""
    zstandard = pytest.importorskip("torch.distributed.checkpoint._extension")
    sd = state(6)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "z"), _extensions=[zstandard.ZStandard()]),
             no_dist=True)
    with pytest.raises(CheckpointException, match=r"through DCP.s transform\(s\) stream\.zstd.*FileSystemReader"):
        dcp.load(zeros_like(sd), storage_reader=TieredStorageReader(path=str(tmp_path / "z")), no_dist=True)


def test_the_metadata_reader_refuses_anything_that_could_run_code():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(DecodeError, match="builtins.print is not a DCP metadata class"):
        load_metadata(pickle.dumps(Evil()), ".metadata")


def test_the_codec_refuses_bytes_the_plan_did_not_announce():
    class Source:
        name = "dcp"

        def materialize(self, copy: bool = False):
            return {"entries": [torch.ones(3)], "index": [{"fqn": "w", "kind": "tensor", "offset": 0,
                                                           "length": torch_save_length(torch.float32, (3,)) + 1}]}

    with pytest.raises(EncodeError, match="the plan announced"):
        list(DistcpCodec().encode(Source()))


def test_the_writer_needs_the_dcp_layout_without_compression(tmp_path):
    cfg = engine_config(tmp_path)
    with CheckpointEngine({**cfg, "layout": "rank_sharded"}) as engine, pytest.raises(ConfigError, match="layout: dcp"):
        TieredStorageWriter(engine)
    zstd = {**cfg, "tiers": [{**cfg["tiers"][0], "compression": {"codec": "zstd"}}]}
    with CheckpointEngine(zstd) as engine, pytest.raises(ConfigError, match=r"^tiers\[0\]\.compression: .*"
                                                          r"set compression: \{codec: none\}"):
        TieredStorageWriter(engine)
    # the fix the message gives is one the configuration takes (it said "compression: none", which it refused)
    fixed = {**cfg, "tiers": [{**cfg["tiers"][0], "compression": {"codec": "none"}}]}
    with CheckpointEngine(fixed) as engine:
        TieredStorageWriter(engine)


@pytest.mark.parametrize(("given", "step"), [(10, 10), ("10", 10), ("iter_0000010", 10), ("/ckpt/step_7/", 7)])
def test_checkpoint_ids_name_steps(given, step):
    assert parse_step(given) == step


def test_a_checkpoint_id_without_a_step_is_refused():
    with pytest.raises(ValueError, match="names no step"):
        parse_step("/ckpt/latest")


def test_no_dcp_checkpoint_is_an_error_saying_what_was_looked_at(tmp_path):
    with CheckpointEngine(engine_config(tmp_path)) as engine, pytest.raises(CheckpointException) as err:
        dcp.load(zeros_like(state()), storage_reader=TieredStorageReader(engine))
    assert "no tier holds a DCP checkpoint" in str(err.value) and "use_collectives" not in str(err.value)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_cli_lists_inspects_verifies_and_keeps_dcp_checkpoints(tmp_path, capsys):
    sd = state(3)
    cfg = engine_config(tmp_path)
    save(cfg, sd, 3)
    save(cfg, sd, 4)
    root = tmp_path / "disk"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / "iter_0000001")))
    code, out = run_cli(capsys, "ls", str(root), "--json")
    rows = {r["step"]: r["state"] for r in json.loads(out)}
    assert code == EXIT_OK and rows[3] == rows[4] == "committed" and rows[1].startswith("dcp, no manifest")
    code, out = run_cli(capsys, "inspect", str(root), "--step", "1")
    assert code == EXIT_OK and "without our manifest" in out and "model.w" in out and "__0_0.distcp" in out
    code, out = run_cli(capsys, "inspect", str(root / "iter_0000001"), "--json")
    assert code == EXIT_OK and {i["fqn"] for i in json.loads(out)["items"]} >= {"model.w", "extra.name"}
    code, out = run_cli(capsys, "verify", str(root), "--all")
    assert code == EXIT_OK and "step 3" in out and "step 4" in out
    code, out = run_cli(capsys, "gc", str(root))
    assert code == EXIT_OK and "iter_0000001" not in out  # DCP's own directory is not debris
    code, out = run_cli(capsys, "ls", str(root), "--layout", "dcp", "--json")  # any registered layout is taken
    assert code == EXIT_OK and {r["step"]: r["state"] for r in json.loads(out)} == rows
    code, err = main(["ls", str(root), "--layout", "dpc"]), capsys.readouterr().err
    assert code == 2 and 'unknown layout "dpc"' in err and "dcp, megatron, rank_sharded" in err, err
    with open(root / "iter_0000004" / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    code, out = run_cli(capsys, "verify", str(root))
    assert code == EXIT_FAILED and "__0_0.distcp" in out


def test_async_save_with_the_writer_as_stager_keeping_its_copy(tmp_path, shm_root):
    sd = state(4)
    cfg = engine_config(tmp_path, shm=shm_root)
    with CheckpointEngine(cfg) as engine:
        writer = TieredStorageWriter(engine, cache_staged_state_dict=True)
        for step in (1, 2):
            sd["extra"]["step"] = step
            sd["model"]["w"].add_(1)
            dcp.async_save(sd, storage_writer=writer, checkpoint_id=step).result()
            writer.wait(timeout=60)
        assert writer.state_dict_cache is not None  # the staging copy is kept between saves
        loaded = zeros_like(sd)
        dcp.load(loaded, storage_reader=TieredStorageReader(engine, step=2))
    assert_same(sd, loaded)
    loaded = zeros_like(sd)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path / "disk" / "iter_0000002")))
    assert_same(sd, loaded)
    with pytest.raises(TypeError, match="thread executor"):
        pickle.dumps(writer)


def test_engine_save_of_its_own_items_is_refused_by_the_dcp_layout(tmp_path):
    """Trial: engine.save({"model": ...}) with layout: dcp wrote files beside DCP's that DCP could not load, and
    `verify` failed the step; refused up front, saying what to do, and nothing is saved."""
    cfg = {"run_id": "dcp-own-items", "layout": "dcp", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path)}]}
    with CheckpointEngine(cfg) as engine:
        with pytest.raises(ConfigError, match=r"items \['model'\].*TieredStorageWriter.*layout: rank_sharded"):
            engine.save(1, {"model": {"w": torch.ones(4)}})
        assert engine.available_steps() == {"disk": []}


def test_a_tier_that_cannot_be_listed_is_not_no_dcp_checkpoint(tmp_path):
    """The reader logged a tier it could not list and said "no tier holds a DCP checkpoint": a job would start from
    scratch while its checkpoint sat on a tier that was down. It raises what engine.load() raises (found by a
    review)."""
    save(cfg := engine_config(tmp_path), state(1), 10)
    with CheckpointEngine(cfg) as engine:
        def down(*args, **kwargs):
            raise OSError(111, "Connection refused")

        engine.pipeline.stores["disk"].tier.list = down
        with pytest.raises(CheckpointException) as err:
            dcp.load(zeros_like(state()), storage_reader=TieredStorageReader(engine))
    text = str(err.value)  # DCP passes on the message only
    assert "could not list tier 'disk'" in text and 'This is not "no checkpoint"' in text, text
    assert "no tier holds a DCP checkpoint" not in text.split("Nothing loadable")[0], text


def test_the_reader_says_unverified_for_a_snapshot_of_unverified_origin(tmp_path, shm_root):
    """A snapshot recovered after its saver died before its checksums (marked unverified) loads with
    verified=False through engine.load(); the DCP reader said verified=True (found by a review)."""
    with CheckpointEngine(engine_config(tmp_path, shm=shm_root)) as engine:
        writer = TieredStorageWriter(engine)
        dcp.save(state(2), storage_writer=writer, checkpoint_id=20)
        writer.wait(timeout=60)
        memory = engine.pipeline.stores["shm"]
        for meta in list(memory.metas().values()):
            memory.mark_unverified(meta)
        reader = TieredStorageReader(engine)
        loaded = zeros_like(state())
        dcp.load(loaded, storage_reader=reader)
    assert_same(state(2), loaded)
    assert reader.sources and set(reader.sources.values()) == {"shm"} and reader.verified is False
