"""Pick the kernel variant for this CPU at import, without ever running code
the CPU cannot execute.

The CPU probe (``_cpu_probe``, compiled with baseline flags) reports what the
CPU and OS support; the ISA table says what each variant needs. Only the
chosen variant is ever loaded: a variant's static initialisers may contain
instructions this CPU lacks, so "import it and ask" is never an option.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import platform as _platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from . import _abi, envs
from .errors import IsaError

logger = logging.getLogger("cpuinfer")


@dataclass(frozen=True)
class Candidate:
    """One variant of this platform and whether it can be used here."""

    name: str
    priority: int
    path: str | None  # extension file, when installed
    missing: tuple[str, ...]  # CPU/OS features this machine lacks
    os_grant: str | None

    @property
    def installed(self) -> bool:
        """True when the variant's extension file is present."""
        return self.path is not None

    @property
    def runnable(self) -> bool:
        """True when this CPU has every feature the variant was compiled for."""
        return not self.missing


@dataclass
class Selection:
    """What the dispatcher saw and chose."""

    platform: str
    features: list[str]
    candidates: list[Candidate]
    name: str
    module: ModuleType
    forced: bool
    reason: str
    notes: list[str] = field(default_factory=list)

    @property
    def path(self) -> str:
        """Extension file of the chosen variant."""
        return str(self.module.__file__)


def _install_dir() -> Path:
    spec = importlib.util.find_spec("cpuinfer._cpu_probe")
    if spec is None or spec.origin is None:
        raise IsaError(
            "cpuinfer's compiled parts are missing (no cpuinfer._cpu_probe): this is a source tree without a "
            "build. Install with `pip install .`, or `CPUINFER_USE_PRECOMPILED=1 pip install -e .` to take them "
            "from a prebuilt wheel."
        )
    return Path(spec.origin).parent


def load_table(install_dir: Path) -> dict:
    """The ISA table installed next to the extensions."""
    return json.loads((install_dir / "_isa_table.json").read_text())


def _variant_path(name: str) -> str | None:
    spec = importlib.util.find_spec(f"cpuinfer._C_{name}")
    return spec.origin if spec is not None else None


def rank(platform_table: dict, features: set[str], installed: dict[str, str | None]) -> list[Candidate]:
    """Every variant of a platform, best first, with what this CPU lacks for it."""
    out = []
    for name, entry in platform_table.items():
        priority = int(entry["priority"])
        demote = entry.get("demote_unless")
        if demote and demote["feature"] not in features:
            priority = int(demote["priority"])
        missing = tuple(f for f in entry["features"] if f not in features)
        out.append(Candidate(name, priority, installed.get(name), missing, entry.get("os_grant")))
    return sorted(out, key=lambda c: -c.priority)


def _request_amx() -> str | None:
    """Ask Linux for AMX tile state; None when granted, else the reason."""
    if sys.platform != "linux" or _platform.machine() not in ("x86_64", "AMD64"):
        return "AMX needs Linux on x86_64"
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    if libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0:
        err = ctypes.get_errno()
        return f"the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: errno {err})"
    return None


_GRANTS = {"amx": _request_amx}


def _expected_stamp(install_dir: Path) -> tuple[str, str]:
    """The ABI stamp the Python side expects, and where it comes from."""
    root = _abi.checkout_root()
    if root is not None:
        return _abi.source_stamp(root), f"the kernel sources in {root / 'csrc'}"
    info = json.loads((install_dir / "_build_info.json").read_text())
    return info["abi_stamp"], "this installation's _build_info.json"


def _check_stamp(module: ModuleType, install_dir: Path) -> None:
    expected, source = _expected_stamp(install_dir)
    if expected == module.ABI_STAMP:
        return
    precompiled = (install_dir / "_precompiled.json").is_file()
    how = (
        "These kernels came from a precompiled wheel built from other sources; run a full build: "
        "`pip install -e .` without CPUINFER_USE_PRECOMPILED/VLLM_USE_PRECOMPILED."
        if precompiled
        else "Rebuild the extensions: `pip install -e .` (or `pip install .`)."
    )
    raise IsaError(
        f"kernel variant {module.VARIANT!r} ({module.__file__}) has ABI stamp {module.ABI_STAMP}, but "
        f"{source} stamp {expected}: the compiled kernels do not match the sources. {how}"
    )


def _describe(c: Candidate) -> str:
    return f"{c.name} (needs {', '.join(c.missing)})" if c.missing else c.name


def select() -> Selection:
    """Detect the CPU, choose a variant (or validate CPUINFER_ISA), import it."""
    install_dir = _install_dir()
    from . import _cpu_probe

    plat, feats = _cpu_probe.features()
    table = load_table(install_dir)
    platforms = table["platforms"]
    if plat not in platforms:
        raise IsaError(f"cpuinfer has no kernels for platform {plat!r}; supported: {', '.join(platforms)}")
    ptable = platforms[plat]
    installed = {name: _variant_path(name) for name in ptable}
    candidates = rank(ptable, set(feats), installed)
    have = [c.name for c in candidates if c.installed]
    notes: list[str] = []

    forced_name = envs.ISA.get()
    if forced_name:
        known = {n for p in platforms.values() for n in p}
        if forced_name not in known:
            raise IsaError(
                f"CPUINFER_ISA={forced_name!r} is not a kernel variant. Valid for {plat}: "
                f"{', '.join(ptable)}; installed here: {', '.join(have) or 'none'}."
            )
        if forced_name not in ptable:
            other = next(p for p, t in platforms.items() if forced_name in t)
            raise IsaError(
                f"CPUINFER_ISA={forced_name!r} is a {other} variant, but this machine is {plat}; "
                f"valid here: {', '.join(ptable)}."
            )
        c = next(c for c in candidates if c.name == forced_name)
        if not c.installed:
            raise IsaError(
                f"CPUINFER_ISA={forced_name!r} is not installed (this build has: {', '.join(have)}). "
                f"Build it with CPUINFER_ISAS={forced_name} or CPUINFER_ISAS=all."
            )
        if c.missing:
            runnable = [x.name for x in candidates if x.installed and x.runnable]
            raise IsaError(
                f"CPUINFER_ISA={forced_name!r} cannot run on this CPU: it lacks {', '.join(c.missing)}. "
                f"Installed variants this CPU can run: {', '.join(runnable) or 'none'}."
            )
        if c.os_grant:
            refused = _GRANTS[c.os_grant]()
            if refused:
                raise IsaError(f"CPUINFER_ISA={forced_name!r}: {refused}.")
        chosen, reason, forced = c, f"forced by CPUINFER_ISA={forced_name}", True
    else:
        chosen = None
        for c in candidates:
            if not (c.installed and c.runnable):
                continue
            if c.os_grant:
                refused = _GRANTS[c.os_grant]()
                if refused:
                    notes.append(f"cpuinfer: not using {c.name}: {refused}; falling back")
                    logger.warning(notes[-1])
                    continue
            chosen = c
            break
        if chosen is None:
            raise IsaError(
                f"no installed kernel variant can run on this CPU ({plat}). Installed: "
                f"{', '.join(_describe(c) for c in candidates if c.installed) or 'none'}."
            )
        skipped = [_describe(c) for c in candidates if c.priority > chosen.priority and c.installed]
        reason = "best installed variant this CPU supports"
        if skipped:
            reason += f"; better ones need what this CPU lacks: {'; '.join(skipped)}"
        absent = [c.name for c in candidates if c.priority > chosen.priority and c.runnable and not c.installed]
        if absent:  # e.g. a variant wheel (generic + one variant) made for another CPU
            reason += (
                f"; this CPU could run {', '.join(absent)}, which this installation lacks (install the wheel without "
                "a variant label, or the variant wheel an installer with variant support picks here)"
            )
            logger.info("cpuinfer: %s", reason)
        forced = False

    module = importlib.import_module(f"cpuinfer._C_{chosen.name}")
    _check_stamp(module, install_dir)
    return Selection(plat, list(feats), candidates, chosen.name, module, forced, reason, notes)
