"""``ragfix merge``: the job shards of one run (``--shard i/N``, :class:`ragfix.eval.shard.Shard`)
checked and joined into one run folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ragfix.errors import ConfigError, ConfigMismatchError, DataError
from ragfix.eval.run import flat_differences, folder_store, moved_inputs
from ragfix.eval.shard import replace_results, shard_manifests
from ragfix.io import CONFIG_FILE, atomic_write_json, read_run_config


def merge_runs(out: str | Path, sources: Sequence[str | Path]) -> dict:
    """Merge the job shards of one run (``--shard i/N``) into the run folder ``out``.

    Every source folder holds the ``config.json`` of the run and one or more shard manifests
    (one folder may hold every shard: jobs on a shared file system). Checked before anything is
    written: every folder's configuration is the same (settings, the backend's identity, the
    inputs' fingerprints, and that of ``out`` when it holds one; an input the jobs read from
    other paths with the same content counts as the same: :func:`~ragfix.eval.run.moved_inputs`);
    the manifests are of one plan (the same number of cells and :func:`plan_fingerprint`) and of
    one ``N``, with each shard ``0 .. N-1`` once; every shard's assigned cells are stored in its
    folder. ``out`` then gets the configuration and one result file of every shard's cells
    (atomically); the shards' own result files in ``out`` are removed, the source folders are
    left as they are. Run the same command without ``--shard`` over ``out`` to write the
    summary (it loads the backend, checks its identity against the folder, records where its
    inputs lie there and computes nothing).

    Args:
        out: the merged run folder (may be one of ``sources``).
        sources: the shards' run folders.

    Returns:
        ``{"cells": merged cells, "shards": N, "folders": source folders}``.

    Raises:
        DataError: a source without ``config.json`` or without a manifest, an unreadable one.
        ConfigMismatchError: the folders ran other configurations (each differing field named),
            or their manifests are of other plans.
        ConfigError: a shard missing, given twice, or short of cells (how many, and which
            folder to rerun).
    """
    out = Path(out)
    folders = list(dict.fromkeys(Path(s) for s in sources))
    if not folders:
        raise ConfigError("give the shards' run folders")
    configs = []
    for folder in folders:
        theirs = read_run_config(folder)
        if theirs is None:
            raise DataError(folder / CONFIG_FILE, None, None, "not found: not a run folder")
        configs.append((folder, theirs))
    if out not in folders and (theirs := read_run_config(out)) is not None:
        configs.append((out, theirs))  # a merged folder already there: the same run too
    first, config = configs[0]
    for folder, theirs in configs[1:]:
        theirs = {**theirs, **{k: config[k] for k in moved_inputs(config, theirs)}}
        if detail := flat_differences(config, theirs):
            raise ConfigMismatchError(
                f"{folder} ran another configuration than {first} ({'; '.join(detail)}): "
                "the shards of one run share every setting, the weights and the inputs"
            )
    found: list[tuple[Path, dict]] = []
    for folder in folders:
        paths = shard_manifests(folder)
        if not paths:
            raise DataError(folder, None, None, "no shard manifest (shard*of*.json): not a shard")
        for path in paths:
            try:
                found.append((folder, json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, json.JSONDecodeError) as e:
                raise DataError(path, None, None, f"unreadable shard manifest ({e})") from None
    plans = {(m["of"], m["cells"], m["plan"], m["results"], m["key"]) for _, m in found}
    if len(plans) > 1:
        raise ConfigMismatchError(
            "the shards split different runs (another N, another number of cells or other "
            f"cells): {sorted({(m['of'], m['cells']) for _, m in found})} as (N, cells)"
        )
    ((count, total, _, results, key),) = plans
    manifests: dict[int, tuple[Path, dict]] = {}
    for folder, m in found:
        if m["shard"] in manifests:
            raise ConfigError(
                f"shard {m['shard']}/{count} is in both {manifests[m['shard']][0]} and {folder}: "
                "give each shard once"
            )
        manifests[m["shard"]] = (folder, m)
    missing = [i for i in range(count) if i not in manifests]
    if missing:
        raise ConfigError(
            f"shard(s) {', '.join(f'{i}/{count}' for i in missing)} missing: run them, or give "
            "the folders that hold them"
        )
    merged: dict[str, dict] = {}
    for i in range(count):
        folder, m = manifests[i]
        done = folder_store(folder, results, key).load()
        short = [cid for cid in m["assigned"] if cid not in done]
        if short:
            raise ConfigError(
                f"shard {i}/{count} in {folder} has {len(m['assigned']) - len(short)} of its "
                f"{len(m['assigned'])} cells: rerun it (it resumes) before merging"
            )
        merged.update({cid: done[cid] for cid in m["assigned"]})
    if len(merged) != total:
        raise ConfigMismatchError(
            f"the shards hold {len(merged)} distinct cells of the run's {total}: their plans differ"
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / CONFIG_FILE, config)
    replace_results(out, results, merged)
    return {"cells": len(merged), "shards": count, "folders": [str(f) for f in folders]}
