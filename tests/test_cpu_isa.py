"""kernels/native/isa.py: the CPU probe's parse of CPU flags, its levels and the override."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from hybrid_engine.kernels.native import isa

# Flag lines as /proc/cpuinfo prints them (trimmed to the relevant part).
EPYC_ZEN3 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
             "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
             "pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand "
             "bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt")
SKYLAKE_X = EPYC_ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl"
SAPPHIRE_RAPIDS = SKYLAKE_X + " avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16"
SANDY_BRIDGE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx popcnt"


def cpuinfo(flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: X\nmodel name\t: Y\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n"


@pytest.mark.parametrize("flags,level", [(SANDY_BRIDGE, "none"), (EPYC_ZEN3, "avx2"),
                                         (SKYLAKE_X, "avx512"), (SAPPHIRE_RAPIDS, "avx512_bf16")])
def test_levels_from_cpuinfo_flag_lines(flags, level):
    parsed = isa.flags_from_cpuinfo(cpuinfo(flags))
    assert "avx" in parsed and "spectre_v1" not in parsed          # the flags line only
    assert isa.level_from_flags(parsed) == level
    assert isa.missing_flags(level, parsed) == []


def test_a_level_needs_every_flag_of_the_levels_below():
    no_fma = isa.flags_from_cpuinfo(cpuinfo(SAPPHIRE_RAPIDS.replace(" fma ", " ")))
    assert isa.level_from_flags(no_fma) == "none"                   # AVX-512 without FMA: nothing native
    assert isa.missing_flags("avx2", no_fma) == ["fma"]
    avx512f_only = frozenset(EPYC_ZEN3.split()) | {"avx512f", "avx512_bf16"}
    assert isa.level_from_flags(avx512f_only) == "avx2"             # torch's and oneDNN's AVX-512 want BW/VL/DQ
    assert isa.missing_flags("avx512", avx512f_only) == ["avx512bw", "avx512vl", "avx512dq"]
    assert isa.flags_from_cpuinfo("processor : 0\n") == frozenset()


def test_the_override_only_lowers_the_level():
    assert isa.choose_level("avx512_bf16", None) == "avx512_bf16"
    assert isa.choose_level("avx512_bf16", "") == "avx512_bf16"
    for lower in ("avx512_bf16", "avx512", "avx2", "none"):
        assert isa.choose_level("avx512_bf16", lower) == lower
    assert isa.choose_level("avx2", " AVX2 ") == "avx2"
    with pytest.raises(ValueError, match="HYBRID_ENGINE_CPU_ISA=avx512 asks for more than this CPU offers "
                                         r"\(its level is avx2\)"):
        isa.choose_level("avx2", "avx512")
    with pytest.raises(ValueError, match="HYBRID_ENGINE_CPU_ISA='sse4' is not a CPU level; choose one of "
                                         "none, avx2, avx512, avx512_bf16"):
        isa.choose_level("avx512_bf16", "sse4")


def test_the_process_level_is_the_detected_one_lowered_by_the_environment():
    assert isa.cpu_level() == isa.choose_level(isa.detected_level(), os.environ.get(isa.ENV))
    assert isa.LEVELS.index(isa.detected_level()) <= isa.LEVELS.index(isa.level_from_flags(isa.cpu_flags()))
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":      # torch's own cap is respected too
        assert isa.detected_level() == "none"


def test_a_bad_override_is_a_clear_error_when_the_engine_packs_weights():
    code = ("from hybrid_engine.kernels.linear.blocked import native_available\n"
            "try:\n    native_available()\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    env = {**os.environ, isa.ENV: "avx1024"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ValueError: HYBRID_ENGINE_CPU_ISA='avx1024' is not a CPU level" in out.stdout, out.stderr


def test_no_library_is_loaded_for_a_level_above_the_process(monkeypatch):
    from hybrid_engine.kernels.native import build
    monkeypatch.setattr(build, "cpu_level", lambda: "avx2")
    with pytest.raises(ValueError, match="level 'avx512' is not one this process may run"):
        build.load_ops("avx512")
    monkeypatch.setattr(build, "cpu_level", lambda: "none")
    assert build.load_ops() is None


@pytest.mark.parametrize("level", ["none", "avx2"])
def test_onednn_packing_needs_the_avx512_level(monkeypatch, level):
    monkeypatch.setattr(isa, "cpu_level", lambda: level)
    assert not isa.onednn_packs(torch.bfloat16) and not isa.onednn_packs(torch.float16)


def test_onednn_packing_follows_torchs_own_check_at_avx512(monkeypatch):
    monkeypatch.setattr(isa, "cpu_level", lambda: "avx512")
    assert isa.onednn_packs(torch.bfloat16) == (torch.backends.mkldnn.is_available()
                                                and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert isa.onednn_packs(torch.float16) == (torch.backends.mkldnn.is_available()
                                               and torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert not isa.onednn_packs(torch.float32)


def _zmm_instructions(library) -> int | None:
    """Instructions of a library that touch a 512-bit zmm register; None without objdump."""
    if shutil.which("objdump") is None:
        return None
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], check=True,
                             capture_output=True, text=True).stdout
    return sum("%zmm" in line for line in listing.splitlines())


def test_every_level_builds_on_any_machine_and_only_avx512_levels_use_zmm():
    # A CPU runs only its own level and those below, so an AVX2-only machine never loads the
    # AVX-512 libraries: building them here (compile and link, never load) keeps their code
    # compiling where CI has no AVX-512, and the zmm count shows each got the width it asked for.
    from hybrid_engine.kernels.native import build
    for level in ("avx2", "avx512", "avx512_bf16"):
        library = build._build(level)
        assert library.is_file() and f"-{level}-" in library.name
        zmm = _zmm_instructions(library)
        if zmm is not None:
            assert (zmm > 0) == level.startswith("avx512"), (level, zmm)
