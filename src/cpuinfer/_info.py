"""The runtime report behind `cpuinfer info` and `cpuinfer.info()`."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

from ._dispatch import Selection


def _cpu_details() -> dict[str, Any]:
    # py-cpuinfo is slow (it may read /proc and spawn helpers): only here,
    # never on the import path, and only for the human-facing details.
    try:
        import cpuinfo
    except ImportError:
        return {"brand": platform.processor() or "unknown"}
    raw = cpuinfo.get_cpu_info()
    keep = (
        "brand_raw",
        "vendor_id_raw",
        "hz_advertised_friendly",
        "count",
        "l1_data_cache_size",
        "l2_cache_size",
        "l3_cache_size",
    )
    details = {k: raw[k] for k in keep if k in raw}
    details.update(sysfs_cache_sizes())
    return details


_CACHE_KEYS = {"1": "l1_data_cache_size", "2": "l2_cache_size", "3": "l3_cache_size"}


def sysfs_cache_sizes(cpu_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[str, int]:
    """Per-instance data/unified cache sizes in bytes from Linux sysfs (what `lscpu -C` reads).

    py-cpuinfo's figures are totals over cores for L1/L2 and can be wrong for L3 (1 MiB on a 32 MiB
    EPYC); sysfs is the kernel's own answer. Empty where sysfs is absent (macOS, some containers).
    """
    out: dict[str, int] = {}
    try:
        entries = sorted(e for e in os.listdir(cpu_dir) if e.startswith("index"))
    except OSError:
        return out
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for entry in entries:
        try:
            level, kind, size = (Path(cpu_dir, entry, name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        key = _CACHE_KEYS.get(level)
        if key is None or kind == "Instruction" or not size:
            continue
        scale = units.get(size[-1].upper(), 1)
        digits = size[:-1] if size[-1].upper() in units else size
        if digits.isdigit():
            out[key] = int(digits) * scale
    return out


def collect(sel: Selection) -> dict[str, Any]:
    """Everything the dispatcher knows, as a JSON-able dict."""
    import torch

    import cpuinfer
    from cpuinfer.platform.threads import layout_report

    mod = sel.module
    return {
        "version": cpuinfer.__version__,
        "arch": sel.platform,
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "cpu": _cpu_details(),
        "cpu_features": sorted(sel.features),
        "variants": {c.name: c.path for c in sel.candidates if c.installed},
        "candidates": [
            {"name": c.name, "priority": c.priority, "installed": c.installed, "missing_features": list(c.missing)}
            for c in sel.candidates
        ],
        "selected": sel.name,
        "forced": sel.forced,
        "reason": sel.reason,
        "notes": sel.notes,
        "abi_stamp": mod.ABI_STAMP,
        "vector_layer": f"{mod.VECTOR_LAYER} ({mod.VECTOR_WIDTH} x f32)",
        "threading": {
            "openmp_runtime": mod.threading_runtime() or None,
            "threads": mod.max_threads(),
            "torch_threads": torch.get_num_threads(),
        },
        "layout": layout_report(),
    }


def _size(value: Any) -> str:
    """py-cpuinfo reports cache sizes in bytes (int) or as text; show KiB/MiB."""
    if not isinstance(value, int):
        return str(value)
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale and value % scale == 0:
            return f"{value // scale} {unit}"
    return f"{value} B"


def _layout_lines(layout: dict[str, Any] | None) -> list[str]:
    """The rank -> cores -> NUMA node lines of each world size the report worked out."""
    if not layout:
        return []
    from cpuinfer.platform.threads import describe_rank

    lines = [f"Layout:     {layout['bind']} (world size = data x tensor x pipeline parallel size)"]
    if "error" in layout:
        lines.append(f"  error: {layout['error']}")
    for entry in layout["layouts"]:
        head = f"  world size {entry['world_size']}: "
        if "error" in entry:
            lines.append(f"{head}error: {entry['error']}")
            continue
        tp, dp = layout.get("tensor_parallel_size", 1), layout.get("data_parallel_size", 1)
        pp = layout.get("pipeline_parallel_size", 1)
        for rank, r in enumerate(entry["ranks"]):
            line = f"{head if rank == 0 else ' ' * len(head)}{describe_rank(rank, r['cpus'], r['node'])}"
            if entry["world_size"] == dp * tp * pp > 1:  # what `cpuinfer info -dp/-tp/-pp` asked for
                stage = f", pipeline stage {rank % (tp * pp) // tp}" if pp > 1 else ""
                line += f"  (data-parallel rank {rank // (tp * pp)}, tensor-parallel rank {rank % tp}{stage})"
            lines.append(line)
    return lines


def show(report: dict[str, Any]) -> str:
    """A readable rendering of the report, in the spirit of numpy.show_runtime()."""
    cpu = report["cpu"]
    lines = [
        f"cpuinfer {report['version']}  (python {report['python']}, torch {report['torch_version']})",
        f"CPU:        {cpu.get('brand_raw') or cpu.get('brand', 'unknown')}  [{report['arch']}]",
    ]
    caches = [
        f"{k.split('_')[0].upper()} {_size(cpu[k])}"
        for k in ("l1_data_cache_size", "l2_cache_size", "l3_cache_size")
        if k in cpu
    ]
    if caches:
        lines.append(f"Caches:     {', '.join(caches)}")
    lines.append(f"Features:   {' '.join(report['cpu_features'])}")
    lines.append("Variants:")
    for c in report["candidates"]:
        mark = "*" if c["name"] == report["selected"] else " "
        if not c["installed"]:
            state = "not installed"
        elif c["missing_features"]:
            state = "cannot run: lacks " + ", ".join(c["missing_features"])
        else:
            state = "runnable"
        lines.append(f"  {mark} {c['name']:<12} {state}")
    how = "forced" if report["forced"] else "auto"
    lines.append(f"Selected:   {report['selected']} ({how}: {report['reason']})")
    for note in report["notes"]:
        lines.append(f"Note:       {note}")
    lines.append(f"Kernels:    {report['variants'][report['selected']]}")
    lines.append(f"Vector:     {report['vector_layer']}, ABI stamp {report['abi_stamp']}")
    t = report["threading"]
    lines.append(f"Threads:    {t['threads']} on {t['openmp_runtime'] or 'no OpenMP runtime (serial)'}")
    lines += _layout_lines(report.get("layout"))
    if "model" in report:
        m = report["model"]
        lines.append(f"Model:      {m['path']}")
        lines.append(f"Quantized:  {m['quantization']}: {m['linear layers']} ({m['kernel']})")
        lines += [f"  {line}" for line in m.get("layers", [])]
    return "\n".join(lines)
