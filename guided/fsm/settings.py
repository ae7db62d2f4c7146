"""How the grammar compiler runs: derived once from EngineConfig and the host (no user options)."""
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
        """A GPU host of 8+ CPUs compiles under SCHED_IDLE on three quarters of them, one compile
        on up to 8 threads, and checks schemas in 4 processes (benchmarks/RESULTS.md). On the CPU
        the forward pass keeps every core busy: 4 threads of one compile each, in-process."""
        roomy_gpu = on_gpu and num_cpus >= 8
        return cls(any_whitespace=any_whitespace, compile_timeout_s=compile_timeout_s,
                   compile_threads=max(4, num_cpus * 3 // 4) if roomy_gpu else 4,
                   xgrammar_threads=max(1, min(8, num_cpus // 2)) if roomy_gpu else 1,
                   compile_sched_idle=roomy_gpu, schema_processes=4 if roomy_gpu else 0)
