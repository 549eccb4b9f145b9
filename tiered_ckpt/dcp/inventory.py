"""What the CLI (``ls``, ``inspect``, ``verify``, ``gc``) knows of DCP checkpoints.

* A committed step of the ``dcp`` layout is a step like any other (our manifest lists its files and checksums);
  ``verify`` re-hashes them and also checks DCP's structure: ``.metadata`` unpickles through our allow-list and
  every item it names lies inside a data file of the step (:func:`structure_problems`).
* A DCP directory without our manifest (written by DCP's ``FileSystemWriter``): as a step directory on a tier
  (``iter_0000010/.metadata``) or as the directory given (``tiered-ckpt inspect /ckpt/step10``), it is listed as
  ``dcp, no manifest`` (nothing to verify it against), inspected from its ``.metadata``, and never removed as
  debris.
"""

from __future__ import annotations

from typing import Any

from ..layouts.dcp import METADATA_FILE, METADATA_NAME


def plain_step_dirs(keys: list[str]) -> set[str]:
    """The directories (``""`` for the root) that hold DCP's ``.metadata`` (or a rank's ``__{rank}.metadata``):
    with or without our manifest."""
    return {k.rpartition("/")[0] for k in keys if METADATA_NAME.match(k.rpartition("/")[2])}


def _metadata(data: bytes, where: str) -> Any:
    from ._format import load_metadata

    return load_metadata(data, where)


def describe(tier: Any, prefix: str) -> tuple[Any, list[dict[str, Any]]]:
    """DCP's Metadata of the checkpoint in ``prefix`` (``""``: the root) and one record per stored item (fqn, the
    chunk's offsets in the whole tensor, kind, shape of the whole tensor, dtype, file, offset, length)."""
    from ..tiers.base import as_memoryview

    key = f"{prefix}/{METADATA_FILE}" if prefix else METADATA_FILE
    metadata = _metadata(bytes(as_memoryview(tier.read_blob(key))), key)
    items = []
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: (kv[1].relative_path,
                                                                                    kv[1].offset)):
        md = metadata.state_dict_metadata.get(index.fqn)
        props = getattr(md, "properties", None)
        items.append({"fqn": index.fqn, "chunk": None if index.offset is None else list(index.offset),
                      "kind": "tensor" if props is not None else "bytes",
                      "shape": list(md.size) if props is not None else None,
                      "dtype": str(props.dtype).removeprefix("torch.") if props is not None else None,
                      "file": info.relative_path, "offset": info.offset, "length": info.length})
    return metadata, items


def structure_problems(store: Any, manifest: Any) -> list[str]:
    """DCP's structure of a committed ``dcp`` step, against our manifest: its ``.metadata`` (or, saved without
    collectives, every rank's ``__{rank}.metadata``) is there and loads, and every item it names lies inside one of
    the step's data files."""
    from ..tiers.base import as_memoryview

    step_dir = store.layout.step_dir(manifest.step)
    sizes = {f.key: f.size for f in manifest.files}
    keys = sorted(f.key for f in manifest.files if METADATA_NAME.match(f.key.rsplit("/", 1)[-1]))  # any layout
    if not keys:
        return [f"{step_dir}/{METADATA_FILE}: not in the manifest: DCP cannot load this step"]
    problems: list[str] = []
    for key in keys:
        try:
            metadata = _metadata(bytes(as_memoryview(store.tier.read_blob(key))), key)
        except Exception as exc:  # unreadable or refused: the step is not loadable by DCP
            problems.append(f"{key}: {exc}")
            continue
        for index, info in (metadata.storage_data or {}).items():
            data_key = f"{step_dir}/{info.relative_path}"
            if data_key not in sizes:
                problems.append(f"{key}: {index.fqn} is stored in {info.relative_path}, which is not in the "
                                "manifest")
            elif info.offset < 0 or info.offset + info.length > sizes[data_key]:
                problems.append(f"{key}: {index.fqn} at bytes {info.offset}+{info.length} runs past the end of "
                                f"{info.relative_path} ({sizes[data_key]} bytes)")
            if len(problems) >= 10:
                return [*problems, "(further problems not listed)"]
    return problems


def inspect_plain(store: Any, step: int | None, as_json: bool
                  ) -> dict[str, Any] | tuple[list[str], list[list[Any]]] | None:
    """``inspect`` of a DCP directory without our manifest: the given directory itself, or its step
    directory ``step`` (None: the newest such). None when there is none."""
    keys = store.tier.list("")
    dirs = plain_step_dirs(keys)
    committed = store.layout.committed_in(keys)
    steps = {s: d for d in dirs if (s := store.layout.parse_step_dir(d)) is not None and s not in committed}
    if step is None and "" in dirs:
        prefix = ""
    elif steps and (step is None or step in steps):
        prefix = steps[max(steps) if step is None else step]
    else:
        return None
    metadata, items = describe(store.tier, prefix)
    where = prefix or "."
    if as_json:
        return {"tier": store.name, "directory": where, "format": "dcp", "verified": False,
                "version": getattr(metadata, "version", None), "items": items}
    files = sorted({i["file"] for i in items})
    rows = [[i["fqn"] + ("" if i["chunk"] is None else f" @{tuple(i['chunk'])}"), i["kind"],
             "" if i["shape"] is None else tuple(i["shape"]), i["dtype"] or "", i["file"], i["offset"], i["length"]]
            for i in items]
    return [f"tier {store.name!r} ({store.tier.describe()}), {where}: a DCP checkpoint without our manifest "
            f"(DCP version {getattr(metadata, 'version', '?')}; nothing to verify it against)",
            f"{len(items)} stored items in {len(files)} file(s): {', '.join(files)}"], rows
