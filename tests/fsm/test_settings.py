"""fsm/settings.py: the compile settings a host gets."""
from __future__ import annotations

from guided.fsm import settings
from guided.fsm.settings import CompileSettings


def test_schema_workers_by_default_only_on_a_gpu_of_a_roomy_host():
    assert settings.schema_processes_default(on_gpu=True, num_cpus=16) == 4
    assert settings.schema_processes_default(on_gpu=True, num_cpus=8) == 4
    assert settings.schema_processes_default(on_gpu=True, num_cpus=7) == 0
    assert settings.schema_processes_default(on_gpu=False, num_cpus=64) == 0  # CPU: in-thread


def test_idle_class_compiles_by_default_only_on_a_gpu_of_a_roomy_host():
    assert settings.sched_idle_default(on_gpu=True, num_cpus=16)
    assert not settings.sched_idle_default(on_gpu=True, num_cpus=4)
    assert not settings.sched_idle_default(on_gpu=False, num_cpus=64)  # CPU: would starve


def test_compile_threads_by_default_take_idle_cores_only_where_they_are_idle_class():
    assert settings.compile_threads_default(sched_idle=True, num_cpus=16) == 12
    assert settings.compile_threads_default(sched_idle=True, num_cpus=4) == 4
    assert settings.compile_threads_default(sched_idle=False, num_cpus=64) == 4


def test_one_xgrammar_compile_spreads_over_idle_cores_only_where_compiles_are_idle_class():
    assert settings.xgrammar_threads_default(sched_idle=True, num_cpus=16) == 8
    assert settings.xgrammar_threads_default(sched_idle=True, num_cpus=6) == 3
    assert settings.xgrammar_threads_default(sched_idle=False, num_cpus=64) == 1


def test_for_host_derives_every_host_default_once():
    gpu = CompileSettings.for_host(any_whitespace=False, compile_timeout_s=5, on_gpu=True,
                                   num_cpus=16)
    assert (gpu.compile_sched_idle, gpu.compile_threads, gpu.schema_processes,
            gpu.xgrammar_threads) == (True, 12, 4, 8)
    cpu = CompileSettings.for_host(any_whitespace=True, compile_timeout_s=5, on_gpu=False,
                                   num_cpus=16)
    assert (cpu.compile_sched_idle, cpu.compile_threads, cpu.schema_processes,
            cpu.xgrammar_threads) == (False, 4, 0, 1)
    assert cpu.any_whitespace and cpu.compile_timeout_s == 5
