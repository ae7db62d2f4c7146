"""fsm/settings.py: the compile settings a host gets."""
from __future__ import annotations

from guided.fsm.settings import CompileSettings


def host(on_gpu: bool, num_cpus: int) -> tuple:
    s = CompileSettings.for_host(any_whitespace=False, compile_timeout_s=5, on_gpu=on_gpu,
                                 num_cpus=num_cpus)
    return s.compile_sched_idle, s.compile_threads, s.xgrammar_threads, s.schema_processes


def test_a_gpu_host_with_cores_to_spare_compiles_on_idle_cores_and_checks_in_processes():
    assert host(True, 16) == (True, 12, 8, 4)
    assert host(True, 8) == (True, 6, 4, 4)
    assert host(True, 6)[0] is False


def test_a_cpu_host_or_a_small_one_compiles_beside_the_forward_pass():
    assert host(False, 64) == (False, 4, 1, 0)  # idle-class compiles would starve
    assert host(True, 7) == (False, 4, 1, 0)


def test_for_host_keeps_the_user_options():
    cpu = CompileSettings.for_host(any_whitespace=True, compile_timeout_s=5, on_gpu=False,
                                   num_cpus=16)
    assert cpu.any_whitespace and cpu.compile_timeout_s == 5
