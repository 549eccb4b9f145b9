"""The peers tables of ``make bench`` (``run_all.py``): the rows, the machine's ceilings, the targets judged on
them (MET / MISSED), and the table text. Pure functions of the candidates' result JSON; nothing here measures.
"""

from __future__ import annotations

import statistics
from typing import Any


# ----- statistics -----------------------------------------------------------------------------------------------
def stat(samples: list[float]) -> dict[str, Any] | None:
    samples = [float(s) for s in samples if s is not None]
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples),
            "samples": samples}


def gather(runs: list[dict], pick) -> list[float]:
    out: list[float] = []
    for r in runs:
        if "error" in r:
            continue
        try:
            v = pick(r)
        except (KeyError, IndexError, TypeError):
            continue
        out.extend(v if isinstance(v, list) else [v])
    return out


# Rows: (key, label, unit, {column: picker}, limit key). Columns: ours, torch_save, dcp_save, dcp_async, dlrover.
COLUMNS = ["ours", "torch_save", "dcp_save", "dcp_async", "dlrover"]
ROWS: list[tuple[str, str, str, dict[str, Any], str | None]] = [
    ("prepare", "prepare(): allocate + pre-fault the slots", "s", {"ours": lambda r: r["prepare_s"]}, None),
    ("first", "save() blocking, first", "s", {
        "ours": lambda r: r["first_s"], "torch_save": lambda r: r["durable_total_s"][0],
        "dcp_save": lambda r: r["save_s"][0], "dcp_async": lambda r: r["async_blocking_s"][0],
        "dlrover": lambda r: r["first_s"]}, None),
    ("first_no_prepare", "save() blocking, first, no prepare()", "s", {"ours": lambda r: r["first_no_prepare_s"]},
     None),
    ("warm", "save() blocking, warm", "s", {
        "ours": lambda r: r["warm_s"] + r["warm_series_s"], "torch_save": lambda r: r["durable_total_s"][1:],
        "dcp_save": lambda r: r["save_s"][1:], "dcp_async": lambda r: r["async_blocking_s"][1:],
        "dlrover": lambda r: r["warm_s"]}, "copy"),
    ("warm_busy", "save() blocking, warm, previous step draining", "s", {
        "ours": lambda r: r["warm_busy_s"]}, "copy"),
    ("durable_total", "save() call -> durable on local disk", "s", {
        "ours": lambda r: r["durable_total_s"], "torch_save": lambda r: r["durable_total_s"][1:],
        "dcp_save": lambda r: r["save_s"][1:], "dcp_async": lambda r: r["async_total_s"][1:],
        "dlrover": lambda r: r["durable_total_s"]}, "direct_write"),
    ("durable_after", "save() return -> durable (background)", "s", {
        "ours": lambda r: r["durable_after_s"],
        "dcp_async": lambda r: [t - b for t, b in zip(r["async_total_s"][1:], r["async_blocking_s"][1:],
                                                      strict=True)],
        "dlrover": lambda r: r["durable_after_s"]}, "direct_write"),
    ("restore_shm", "restore shm into the model's tensors", "s", {
        "ours": lambda r: r["restore_shm_into_s"], "dlrover": lambda r: r["restore_shm_views_copy_s"]},
     "copy_out"),
    ("restore_shm_views", "  ours: load(copy=False) views + copy_", "s", {
        "ours": lambda r: r["restore_shm_views_copy_s"]}, "copy_out"),
    ("restore_shm_load", "    of which load(copy=False): verify, views", "s", {
        "ours": lambda r: r["restore_shm_views_load_part_s"], "dlrover": lambda r: r["restore_shm_views_load_part_s"]},
     None),
    ("restore_shm_fresh", "restore shm: load(copy=True), new memory", "s", {
        "ours": lambda r: r["restore_shm_fresh_s"]}, "copy_out"),
    ("restore_disk", "restore local disk -> model tensors", "s", {
        "ours": lambda r: r["restore_disk_s"], "torch_save": lambda r: r["restore_disk_s"],
        "dcp_save": lambda r: r["restore_disk_s"], "dlrover": lambda r: r["restore_disk_s"]}, "direct_read"),
    ("peak_rss", "peak RSS of the training process", "MiB", {
        "ours": lambda r: r["memory"]["peak_rss_mib"], "torch_save": lambda r: r["memory"]["peak_rss_mib"],
        "dcp_save": lambda r: r["memory_save"]["peak_rss_mib"],
        "dcp_async": lambda r: r["memory_async"]["peak_rss_mib"], "dlrover": lambda r: r["memory"]["peak_rss_mib"]},
     None),
    ("slots", "slots / staging memory held", "MiB", {
        "ours": lambda r: r["memory"]["slot_mib"], "torch_save": lambda r: r["memory"]["slot_mib"],
        "dcp_save": lambda r: r["memory_save"]["slot_mib"], "dcp_async": lambda r: r["memory_async"]["slot_mib"],
        "dlrover": lambda r: r["memory"]["slot_mib"]}, None),
    ("extra_mem", "host memory added beyond the slots", "MiB", {
        "ours": lambda r: r["memory"]["extra_total_mib"], "torch_save": lambda r: r["memory"]["extra_total_mib"],
        "dcp_save": lambda r: r["memory_save"]["extra_total_mib"],
        "dcp_async": lambda r: r["memory_async"]["extra_total_mib"],
        "dlrover": lambda r: r["memory"]["extra_total_mib"]}, None),
]
SOURCE = {"ours": "ours", "torch_save": "torch_save", "dcp_save": "dcp", "dcp_async": "dcp", "dlrover": "dlrover"}
# The machine's limits, measured in ours' processes alternately with it (see peers/ours.py), and in DLRover's.
# The copy ceilings are the fastest (by median) of the ways every copy sample is taken (limits.ParallelCopy):
# (row key, label, label in limit_copy_ways or the result key of a single-way limit).
LIMIT_ROWS = [("copy", "ceiling: copy into pre-faulted shm, all cores", "in"),
              ("copy_busy", "  the same while the previous step drains", "in_busy"),
              ("copy_out", "ceiling: copy out of it into tensors", "out"),
              ("direct_write", "ceiling: O_DIRECT write + fsync", "limit_direct_write_s"),
              ("direct_read", "ceiling: O_DIRECT read", "limit_direct_read_s"),
              ("write_fsync_buffered", "  info: buffered write + fsync", "limit_write_fsync_buffered_s")]
BUSY_MAX_OVER_MEDIAN = 1.3  # no save while the previous step drains slower than this times their median
MEM_TOLERANCE_MIB = 16  # allocator and interpreter noise allowed on top of the slots


def aggregate(state_runs: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for key, _label, _unit, pickers, _limit in ROWS:
        rows[key] = {col: stat(gather(state_runs["candidates"].get(SOURCE[col], []), pick))
                     for col, pick in pickers.items()}
    ours, dl = state_runs["candidates"].get("ours", []), state_runs["candidates"].get("dlrover", [])
    return {"rows": rows, "limits": limit_stats(ours), "limits_dlrover_process": limit_stats(dl)}


def limit_stats(runs: list[dict]) -> dict[str, Any]:
    """Each ceiling over every run's samples; a copy ceiling is the fastest way by median (``way`` says which,
    ``ways`` gives every way's median)."""
    out: dict[str, Any] = {}
    for key, _label, src in LIMIT_ROWS:
        if src.startswith("limit_"):
            out[key] = stat(gather(runs, lambda r, src=src: r[src]))
            continue
        ways = {w: stat(gather(runs, lambda r, w=w, src=src: r["limit_copy_ways"][src][w]))
                for w in ("single", "threaded", "streaming")}
        ways = {w: v for w, v in ways.items() if v is not None}
        if not ways:
            out[key] = None
            continue
        best = min(ways, key=lambda w: ways[w]["median"])
        out[key] = {**ways[best], "way": best, "ways": {w: v["median"] for w, v in ways.items()}}
    return out


def med(x: dict[str, Any] | None) -> float | None:
    return None if x is None else x["median"]


def targets(agg: dict[str, Any], skipped: dict[str, str]) -> list[dict[str, Any]]:
    rows, lim = agg["rows"], agg["limits"]
    r = {k: {c: med(v) for c, v in cols.items()} for k, cols in rows.items()}
    copy_s, copy_out_s, write_s = med(lim["copy"]), med(lim["copy_out"]), med(lim["direct_write"])
    dl_why = skipped.get("dlrover", "DLRover did not run")
    out = []

    def add(row: str, what: str, ratio: float | None, ok: bool | None, why: str = "", short: str = "") -> None:
        out.append({"row": row, "target": what, "ratio": ratio, "met": ok, "note": why, "short": short})

    ours_warm, dl_warm = r["warm"].get("ours"), r["warm"].get("dlrover")
    if ours_warm and copy_s:
        ratio = copy_s / ours_warm
        add("warm", "warm blocking >= 0.9x the all-core copy ceiling (ceiling s / ours s >= 0.9)", ratio,
            ratio >= 0.9)
    if ours_warm and dl_warm:
        add("warm", "warm blocking <= 0.75x DLRover's warm save_to_memory (ours / DLRover <= 0.75)",
            ours_warm / dl_warm, ours_warm <= 0.75 * dl_warm, short="vs DLRover (<= 0.75)")
        dl_copy = med(agg["limits_dlrover_process"]["copy"])
        if dl_copy:
            add("warm", "(each against the copy ceiling paired in its own process: (ours/ceiling) / "
                "(DLRover/ceiling))", (ours_warm / copy_s) / (dl_warm / dl_copy) if copy_s else None, None,
                short="vs DLRover, each / own ceiling")
    else:
        add("warm", "warm blocking <= 0.75x DLRover's warm save_to_memory", None, None, dl_why,
            short="vs DLRover (<= 0.75)")
    busy = rows["warm_busy"].get("ours")
    if busy:
        spread_ratio = busy["max"] / busy["median"]
        add("warm_busy", f"no save slower than {BUSY_MAX_OVER_MEDIAN}x the median while the previous step drains "
            f"(max / median of {busy['n']})", spread_ratio, spread_ratio <= BUSY_MAX_OVER_MEDIAN)
        if copy_s:
            add("warm_busy", "(while draining, against the quiet copy ceiling: ceiling s / ours s)",
                copy_s / busy["median"], None, short="vs quiet ceiling")
        busy_copy = med(lim["copy_busy"])
        if busy_copy:
            add("warm_busy", "(while draining, against the copy ceiling measured while draining)",
                busy_copy / busy["median"], None, short="vs ceiling while draining")
        if ours_warm:
            add("warm_busy", "(median while draining / quiet median: what the drain costs a save)",
                busy["median"] / ours_warm, None, short="busy / quiet")
    ours_first, dl_first = r["first"].get("ours"), r["first"].get("dlrover")
    if ours_first and dl_first:
        add("first", "first save <= 0.25x DLRover's first (ours / DLRover <= 0.25)", ours_first / dl_first,
            ours_first <= 0.25 * dl_first)
        nop = r["first_no_prepare"].get("ours")
        if nop:
            add("first_no_prepare", "(same, without prepare(): not the target, for information)", nop / dl_first,
                nop <= 0.25 * dl_first, short="vs DLRover first (info)")
    else:
        add("first", "first save <= 0.25x DLRover's first", None, None, dl_why)
    total, after = r["durable_total"].get("ours"), r["durable_after"].get("ours")
    if total and write_s:
        ratio = write_s / total
        add("durable_total", "time to durable >= 0.85x the O_DIRECT write+fsync ceiling, rank_sharded "
            "(ceiling s / ours save() call -> durable s >= 0.85)", ratio, ratio >= 0.85)
    if after and write_s:
        add("durable_after", "(the drain alone, save() return -> durable, on the same measure)", write_s / after,
            None)
        dl_after, dl_write = r["durable_after"].get("dlrover"), med(agg["limits_dlrover_process"]["direct_write"])
        if dl_after and dl_write:
            add("durable_after", "(DLRover on the same measure, for information)", dl_write / dl_after, None,
                short="DLRover on this measure")
    shm = r["restore_shm"].get("ours")
    if shm and copy_out_s:
        ratio = copy_out_s / shm
        add("restore_shm", "restore from shm >= 0.8x the copy ceiling (load(into=model), verified; ceiling s / "
            "ours s)", ratio, ratio >= 0.8)
    views = r["restore_shm_views"].get("ours")
    if views and copy_out_s:
        add("restore_shm_views", "(load(copy=False) + copy_ into the model on the same measure, for information)",
            copy_out_s / views, None)
    fresh = r["restore_shm_fresh"].get("ours")
    if fresh and copy_out_s:
        add("restore_shm_fresh", "(load(copy=True) into new memory on the same measure, for information)",
            copy_out_s / fresh, None)
    disk, read_s = r["restore_disk"].get("ours"), med(lim["direct_read"])
    if disk and read_s:
        add("restore_disk", "(restore from disk against the O_DIRECT read ceiling, for information)",
            read_s / disk, None)
    slots, extra = r["slots"].get("ours"), r["extra_mem"].get("ours")
    if slots is not None and extra is not None:
        add("extra_mem", f"host memory added by saves <= the slots (extra beyond slots <= {MEM_TOLERANCE_MIB} MiB)",
            (slots + extra) / slots if slots else None, extra <= MEM_TOLERANCE_MIB)
    return out


# ----- the table ------------------------------------------------------------------------------------------------
def fmt(x: dict[str, Any] | None, unit: str) -> str:
    if x is None:
        return "-"
    v = x["median"]
    if unit == "MiB":
        return f"{v:.0f}"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}"


def spread(x: dict[str, Any] | None, unit: str) -> str:
    if x is None or x["n"] < 2:
        return ""
    if unit == "MiB":
        return f"{x['min']:.0f}-{x['max']:.0f}"
    return f"{x['min']:.3f}-{x['max']:.3f}"


def table(state: str, info: dict[str, Any], agg: dict[str, Any], tg: list[dict[str, Any]]) -> str:
    gib = info["bytes"] / 2**30
    lim = agg["limits"]
    head = ["measurement", "unit", *COLUMNS, "limit", "ratio", "target"]
    lines = [f"### {state}: {info['description']} ({gib:.2f} GiB), {info['rounds']} round(s); "
             "medians (spread: min-max of all samples below)", ""]
    by_row: dict[str, list[dict[str, Any]]] = {}
    for t in tg:
        by_row.setdefault(t["row"], []).append(t)
    body = []
    for key, label, unit, _p, limit in ROWS:
        cols = agg["rows"][key]
        verdicts = [t for t in by_row.get(key, []) if t["met"] is not None or t["ratio"] is not None]
        main = verdicts[0] if verdicts else None
        ratio = "" if not main or main["ratio"] is None else f"{main['ratio']:.2f}"
        verdict = "" if not main else ("n/a" if main["met"] is None and main["ratio"] is None else
                                       ("info" if main["met"] is None else ("MET" if main["met"] else "MISSED")))
        body.append([label, unit, *[fmt(cols.get(c), unit) for c in COLUMNS],
                     fmt(lim.get(limit), "s") if limit else "", ratio, verdict])
        for extra in verdicts[1:]:
            body.append(["  " + (extra["short"] or extra["target"][:40]), "", *[""] * len(COLUMNS), "",
                         "" if extra["ratio"] is None else f"{extra['ratio']:.2f}",
                         "info" if extra["met"] is None else ("MET" if extra["met"] else "MISSED")])
    for key, label, _src in LIMIT_ROWS:
        x = lim.get(key)
        bw = "" if x is None else f"{info['bytes'] / x['median'] / 1e9:.2f} GB/s"
        if x is not None and "way" in x:
            bw += f" ({x['way']})"
        body.append([label, "s", *[""] * len(COLUMNS), fmt(x, "s"), "", bw])
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    fmt_row = lambda row: "| " + " | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    lines.append(fmt_row(head))
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [fmt_row(row) for row in body]
    lines += ["", "Targets:"]
    for t in tg:
        verdict = "n/a   " if t["met"] is None and t["ratio"] is None else (
            "info  " if t["met"] is None else ("MET   " if t["met"] else "MISSED"))
        ratio = "" if t["ratio"] is None else f" ratio {t['ratio']:.2f}"
        lines.append(f"  {verdict} {t['target']}{ratio}{(' - ' + t['note']) if t['note'] else ''}")
    lines += ["", "Spread (min-max over all samples; n per cell in the JSON):"]
    for key, label, unit, _p, _l in ROWS:
        cells = [f"{c} {spread(agg['rows'][key].get(c), unit)}" for c in COLUMNS if spread(agg["rows"][key].get(c),
                                                                                            unit)]
        if cells:
            lines.append(f"  {label}: " + "; ".join(cells))
    for key, label, _src in LIMIT_ROWS:
        x = lim.get(key)
        if spread(x, "s"):
            ways = "" if "ways" not in x else " (medians: " + ", ".join(
                f"{w} {v:.3f}" for w, v in x["ways"].items()) + ")"
            lines.append(f"  {label.strip()}: {spread(x, 's')}{ways}")
    notes = busy_notes(info)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def busy_notes(entry: dict[str, Any]) -> list[str]:
    """What qualifies the 'previous step draining' row: saves whose previous step had already finished draining
    (not overlapped, so not a busy sample), and saves that waited for a free slot."""
    notes = []
    for r in entry["candidates"].get("ours", []):
        if "error" in r:
            continue
        flags = r.get("busy_overlapped", [])  # per save: [previous step draining at its start, at its end]
        started = sum(1 for a, _ in flags if not a)
        ended = sum(1 for a, b in flags if a and not b)
        if started:
            notes.append(f"note: {started} of {len(flags)} saves 'while the previous step drains' started after that "
                         "drain had finished (nothing overlapped them)")
        if ended:
            notes.append(f"note: {ended} of {len(flags)} of them outlasted the previous step's drain (it finished "
                         "during the save)")
        if r.get("slot_wait_s"):
            notes.append(f"note: saves that waited for a free slot: {r['slot_wait_s']} (step: seconds)")
    return notes
