"""The runtime dispatcher: selection, forcing, refusals and the ABI stamp."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import types

import pytest

import cpuinfer
from cpuinfer import _dispatch

SEL = cpuinfer._selection


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run python code in a fresh interpreter with extra environment variables."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CPUINFER_")}
    full_env.update(env)
    # Under qemu-user (nox -s emulated_avx2) children must be started through the emulator too.
    wrapper = shlex.split(os.environ.get("CPUINFER_TEST_PYTHON_WRAPPER", ""))
    return subprocess.run(
        [*wrapper, sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=900
    )


def test_auto_selects_best_runnable_variant():
    runnable = [c for c in SEL.candidates if c.installed and c.runnable]
    assert SEL.name == runnable[0].name or SEL.notes  # best one, unless the OS refused it (noted)
    assert not SEL.forced
    assert SEL.name == SEL.module.VARIANT


def test_rank_uses_features_and_priority():
    table = _dispatch.load_table(_dispatch._install_dir())["platforms"]["x86_64"]
    avx2_cpu = {"sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "lzcnt", "movbe", "os_ymm"}
    ranked = _dispatch.rank(table, avx2_cpu, {name: f"/x/{name}.so" for name in table})
    first_runnable = next(c for c in ranked if c.runnable)
    assert first_runnable.name == "avx2"
    amx = next(c for c in ranked if c.name == "amx")
    assert "avx512f" in amx.missing and "amx_tile" in amx.missing
    # The OS must have enabled the wide registers: CPUID alone is not enough.
    no_os = _dispatch.rank(table, avx2_cpu - {"os_ymm"}, {n: "/x" for n in table})
    assert next(c for c in no_os if c.runnable).name == "generic"


def test_a_runnable_variant_missing_from_the_installation_is_named(monkeypatch):
    """A variant wheel holds generic and one variant: on a CPU it was not made for, cpuinfer says what it lacks."""
    generic = _dispatch._variant_path("generic")
    monkeypatch.setattr(_dispatch, "_variant_path", lambda name: generic if name == "generic" else None)
    monkeypatch.delenv("CPUINFER_ISA", raising=False)
    sel = _dispatch.select()
    assert sel.name == "generic"
    runnable = [c.name for c in SEL.candidates if c.runnable and c.name != "generic"]
    if runnable:
        assert f"this CPU could run {', '.join(runnable)}, which this installation lacks" in sel.reason
    else:
        assert "could run" not in sel.reason


def test_sve_is_demoted_when_only_128_bits_wide():
    table = _dispatch.load_table(_dispatch._install_dir())["platforms"]["aarch64"]
    feats = {"asimd", "asimddp", "fphp", "asimdhp", "asimdfhm", "bf16", "i8mm", "sve"}
    installed = {n: "/x" for n in table}
    assert _dispatch.rank(table, feats, installed)[0].name == "neon_bf16"
    assert _dispatch.rank(table, feats | {"sve_wide"}, installed)[0].name == "sve"


def test_forced_variant_is_used():
    r = run_py("import cpuinfer, json; print(json.dumps(cpuinfer.info()))", CPUINFER_ISA="generic")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["selected"] == "generic" and report["forced"] is True


@pytest.mark.parametrize(
    "value,message",
    [
        ("bogus", "CPUINFER_ISA='bogus' is not a kernel variant. Valid for"),
        ("neon", "is a aarch64 variant"),
        ("avx-2", "is not a variant name"),
    ],
)
def test_bad_forced_names_are_clear_errors(value, message):
    if SEL.platform != "x86_64":
        pytest.skip("x86 names")
    r = run_py("import cpuinfer", CPUINFER_ISA=value)
    assert r.returncode == 1
    assert message in r.stderr
    assert "Segmentation" not in r.stderr and "Illegal" not in r.stderr


@pytest.mark.parametrize("name", [c.name for c in SEL.candidates if not c.runnable])
def test_forcing_a_variant_this_cpu_cannot_run_is_an_error_not_sigill(name):
    r = run_py("import cpuinfer", CPUINFER_ISA=name)
    assert r.returncode == 1, (r.returncode, r.stderr)  # a Python exception; SIGILL would be -4
    cand = next(c for c in SEL.candidates if c.name == name)
    if cand.installed:
        assert f"cannot run on this CPU: it lacks {', '.join(cand.missing)}" in r.stderr
        assert "Installed variants this CPU can run:" in r.stderr
    else:
        assert "is not installed" in r.stderr


def test_cli_reports_dispatch_errors_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "cpuinfer", "info"],
        capture_output=True,
        text=True,
        env={**os.environ, "CPUINFER_ISA": "bogus"},
        timeout=300,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("cpuinfer: CPUINFER_ISA='bogus'") and "Traceback" not in r.stderr


def test_stamp_mismatch_is_refused():
    fake = types.SimpleNamespace(ABI_STAMP="0000000000000000", VARIANT="generic", __file__="/x/_C_generic.so")
    with pytest.raises(_dispatch.IsaError, match="do not match the sources"):
        _dispatch._check_stamp(fake, _dispatch._install_dir())


def test_info_object():
    report = cpuinfer.info()
    for key in ("version", "arch", "cpu_features", "variants", "selected", "forced", "torch_version"):
        assert key in report
    assert report["selected"] in report["variants"]
    assert all(os.path.isfile(p) for p in report["variants"].values())
    r = subprocess.run(
        [sys.executable, "-m", "cpuinfer", "info", "--json"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["selected"] == report["selected"]
    text = subprocess.run([sys.executable, "-m", "cpuinfer", "info"], capture_output=True, text=True, timeout=300)
    assert f"Selected:   {report['selected']}" in text.stdout


def test_import_path_does_not_run_py_cpuinfo():
    r = run_py("import sys, cpuinfer; print('cpuinfo' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.skipif(
    shutil.which("lscpu") is None or not os.path.isdir("/sys/devices/system/cpu/cpu0/cache"),
    reason="needs Linux sysfs and util-linux's lscpu",
)
def test_info_cache_sizes_match_lscpu():
    # lscpu reads the same kernel tables independently; py-cpuinfo said L3 = 1 MiB on a 32 MiB EPYC.
    out = subprocess.run(["lscpu", "-C=NAME,ONE-SIZE", "-B"], capture_output=True, text=True, timeout=30).stdout
    sizes = dict(line.split() for line in out.splitlines()[1:] if len(line.split()) == 2)
    cpu = cpuinfer.info()["cpu"]
    for name, key in (("L1d", "l1_data_cache_size"), ("L2", "l2_cache_size"), ("L3", "l3_cache_size")):
        if name in sizes:
            assert cpu[key] == int(sizes[name]), (name, cpu.get(key), sizes[name])
