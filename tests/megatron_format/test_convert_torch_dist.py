"""`tiered-ckpt convert` between Megatron's torch and torch_dist formats: refused, saying why and what to do."""

from __future__ import annotations

from pathlib import Path

from tiered_ckpt.cli import main


def test_to_torch_dist_is_refused_with_what_to_do(tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "torch_dist"]) == 2
    err = capsys.readouterr().err
    assert "without the model" in err and "sharded_state_dict" in err and "args.ckpt_format" in err, err
    assert not (tmp_path / "dst").exists()


def test_a_torch_dist_source_is_refused_with_what_to_do(tmp_path: Path, capsys) -> None:
    step = tmp_path / "src" / "iter_0000003"
    step.mkdir(parents=True)
    (tmp_path / "src" / "latest_checkpointed_iteration.txt").write_text("3")
    (step / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "megatron"]) == 1
    err = capsys.readouterr().err
    assert "torch_dist (distributed) checkpoint" in err and "needs no conversion for another TP/PP/DP" in err, err
