"""How the grammar compiler runs: its settings, and their defaults for a host, derived once.

The engine builds one CompileSettings from its EngineConfig and its host (for_host); tests and
benchmarks build one directly. Nothing here is a user option: EngineConfig carries what a user
sets (any_whitespace, compile_timeout_s), the rest follows from the host, measured as each
default's docstring says."""
from __future__ import annotations

import os
from dataclasses import dataclass

# the CPUs this process may run on (a container's share, not the host's), read once
NUM_CPUS = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class CompileSettings:
    any_whitespace: bool = False  # compact JSON separators: bounded, and long forced strings
    max_whitespace: int = 2  # with any_whitespace: the longest whitespace run between tokens
    compile_timeout_s: float = 30.0
    compile_threads: int = 4
    xgrammar_threads: int = 1  # threads one xgrammar compile spreads its vocabulary pass over
    # niceness added to compile threads: a cold schema's compile uses idle cores and never
    # preempts the step loop or the mask threads
    compile_nice: int = 10
    compile_sched_idle: bool = False  # compiles under Linux's SCHED_IDLE (a GPU host)
    schema_processes: int = 0  # processes checking schemas (fsm/schema_worker.py)
    grammar_cache_size: int = 512
    # checked schemas with string bounds past a short pattern's compile with llguidance (ms)
    # rather than xgrammar (seconds to minutes: fsm/backends/llguidance_backend.py)
    llguidance: bool = True
    max_grammar_bytes: int = 1_000_000

    @classmethod
    def for_host(cls, *, any_whitespace: bool, compile_timeout_s: float, on_gpu: bool,
                 num_cpus: int = NUM_CPUS) -> CompileSettings:
        idle = sched_idle_default(on_gpu=on_gpu, num_cpus=num_cpus)
        return cls(any_whitespace=any_whitespace, compile_timeout_s=compile_timeout_s,
                   compile_threads=compile_threads_default(sched_idle=idle, num_cpus=num_cpus),
                   xgrammar_threads=xgrammar_threads_default(sched_idle=idle, num_cpus=num_cpus),
                   compile_sched_idle=idle,
                   schema_processes=schema_processes_default(on_gpu=on_gpu, num_cpus=num_cpus))


def schema_processes_default(*, on_gpu: bool, num_cpus: int) -> int:
    """Schema worker processes (fsm/schema_worker.py): where a step loop on a GPU shares the GIL
    with a cold server's compiles, on a host with cores to spare. Measured on an H200 host of 16
    CPUs, the default model cold at 64 (RESULTS, session 28): with 4, TPOT p50 9.0-9.1 ms and
    3844.8-4277.6 tok/s, without 11.7 ms and 3685.3."""
    return 4 if on_gpu and num_cpus >= 8 else 0


def sched_idle_default(*, on_gpu: bool, num_cpus: int) -> bool:
    """Compiles under SCHED_IDLE where the step loop needs one core and the host has many (a GPU
    host of 8+ CPUs; H200 host of 16, default model cold at 64, RESULTS session 29: the step
    loop's wait for a core 0-1% against 5-22%). On the CPU the model's forward pass keeps every
    core busy, and idle-class compiles would wait for their timeout."""
    return on_gpu and num_cpus >= 8


def compile_threads_default(*, sched_idle: bool, num_cpus: int) -> int:
    """Where compiles only take idle cores (SCHED_IDLE, a GPU host), three quarters of the CPUs
    (H200 host of 16 CPUs, default model cold at 64, RESULTS session 29: 6 threads 3578.1
    tok/s, 12: 4323.7-4795.1, 16: 4386.6); elsewhere 4, beside a forward pass that wants every
    core."""
    return max(4, num_cpus * 3 // 4) if sched_idle else 4


def xgrammar_threads_default(*, sched_idle: bool, num_cpus: int) -> int:
    """Where compiles take idle cores only, up to 8 (half the CPUs), so that a cold wave's few
    large schemas (seconds of a core each) compile in a fraction of that; elsewhere 1."""
    return max(1, min(8, num_cpus // 2)) if sched_idle else 1

