"""One frozen EngineConfig: every knob of the engine, validated once with errors that say what to change."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from guided.errors import InvalidRequestError

DEFAULT_MODEL = "default"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    """"default" (the embedded SmolLM2-135M-Instruct), an HF model directory, a .gguf file, or
    synthetic:<shape> (random weights, real architecture)."""
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    seed: int = 0

    # KV cache and batching
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory (gpu_memory_utilization / cpu_kv_cache_gb)
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096
    # admission reserves KV room for up to this many future tokens per running request
    # (LightLLM's peak estimate); 0 admits whatever fits now, as vLLM does, and relies on preemption
    admission_lookahead_tokens: int = 1024

    # structured generation
    jump_forward: bool = True
    max_jump_forward_tokens: int = 32
    # with jump_forward: up to this many prompt-lookup draft tokens past the forced text (the
    # last 2-4 tokens matched earlier in the request's tokens), verified like the forced ones
    lookup_draft_tokens: int = 4
    # lookup guesses only while at most this many requests run (None: at any batch), as vLLM
    # turns speculation off by batch size: past the GPU's memory-bound knee a guess costs verify
    # compute, a mask row and its proposal; on an H200 at 256 the default model's constrained
    # throughput gained 9% without them, the 8B's none (benchmarks/RESULTS.md, session 10)
    lookup_max_batch: int | None = 128
    # drafts (forced + lookup) verified per step, over all requests: past the GPU's
    # memory-bound knee every drafted slot costs compute (and a mask row); None: no cap
    max_draft_tokens_per_step: int | None = None
    # overlapped scheduling: drafts anchored on a request's in-flight sample only while such
    # proposals gain at least this many tokens each on average (guided/engine/drafts.py AnchorPayoff);
    # a random-weights model gains ~0 and its drafts cost more than they save (RESULTS, session
    # 11); a large negative value anchors always
    min_anchor_gain: float = 0.5
    any_whitespace: bool = False  # compact JSON separators: bounded, and long forced strings
    max_whitespace: int = 2  # with any_whitespace: the longest whitespace run between JSON tokens
    # None: 12 on a GPU host of 16 CPUs (three quarters of them, at least 4) where compiles run
    # under SCHED_IDLE, else 4 (policy.default_compile_threads)
    compile_threads: int | None = None
    # threads one xgrammar compile may spread its vocabulary pass over (GrammarCompiler's
    # max_threads; the compile time of a large schema divides by them, ~4.8 s to ~2.4 s with 2):
    # a cold wave's slowest compile is its tail. None: 8 where compiles run under SCHED_IDLE
    # (they take idle cores only), else 1 (policy.default_xgrammar_threads)
    xgrammar_threads: int | None = None
    # niceness added to compile threads: a cold schema's compile uses idle cores and never
    # preempts the step loop or the mask threads (a preempted mask thread stalls a whole step)
    compile_nice: int = 10
    # compile threads, DFA upgrades and the shards' own compiles run under Linux's SCHED_IDLE
    # (a core only when nothing else wants it): with niceness alone a cold wave's compiles (8-10
    # cores of a 16-core host) kept the step loop waiting for a core 12-29% of the time; None:
    # on where the model runs on a GPU on a host of 8 or more CPUs (on the CPU the forward pass
    # wants every core, and idle-class compiles would starve: policy.default_compile_sched_idle)
    compile_sched_idle: bool | None = None
    # JSON schemas are checked and their regexes written (the compile's Python, which holds the
    # GIL) in this many worker processes (fsm/schema_worker.py); 0: on the compile threads;
    # None: 4 where the model runs on a GPU on a host of 8 or more CPUs
    # (policy.default_schema_processes), else 0
    schema_processes: int | None = None
    compile_timeout_s: float = 30.0
    grammar_cache_size: int = 512
    # JSON schemas whose language is regular compile to a token-level DFA (outlines-core)
    # instead of xgrammar's grammar: a state's mask row is written once, then copied (~1 us
    # against ~50 us a fill; guided/fsm/backends/dfa_backend.py); the others stay on xgrammar
    dfa_masks: bool = True
    # a schema whose regex unrolls past this many positions (fsm/regex_size.py: its DFA
    # takes ~0.3 ms a position to build, seconds for the largest) is served by xgrammar at
    # once while its DFA compiles in the background; its requests after that get the DFA.
    # None: 0 where compiles run under SCHED_IDLE (a GPU host: every schema xgrammar's first,
    # ~5x cheaper to compile), else 1000 (policy.default_dfa_max_wait_size)
    dfa_max_wait_size: int | None = None
    dfa_upgrade_threads: int = 1  # threads building those DFAs in the background
    max_grammar_bytes: int = 1_000_000
    mask_threads: int = 8  # threads filling grammar masks (capped by the CPU count)
    # processes filling constrained requests' mask rows beside the step loop, from mirror
    # matchers (guided/fsm/mask_shards.py); 0: every row filled in the engine's process; None:
    # 4 under overlapped scheduling on a GPU for a model under 1B weights on a host of 8 or
    # more CPUs (policy.default_mask_processes), else 0. A cold wave of new grammars fills
    # in-process while they ship (RESULTS, session 7: such a first run at 0.57-0.69x of
    # in-process fills, H200); warm ones fill beside the loop (RESULTS, session 13: H100,
    # default model at 64, constrained / free 0.68-0.79 against 0.61-0.66)
    mask_processes: int | None = None

    # GPU execution
    cuda_graphs: bool = True
    compile_ops: bool = True  # torch.compile the elementwise ops on the GPU (fused kernels)
    num_scheduler_steps: int = 1  # >1: multi-step decode for batches that allow it (no overlap)
    # multi-step decode for constrained requests too (not while they have drafts): their
    # matchers fill each step's mask rows while the device runs its forward pass
    multi_step_constrained: bool = True
    # multi-step decode: DFA grammars (dfa_masks) are masked and stepped on the device, with
    # no host work between the call's steps (guided/worker/device_dfa.py); their transition
    # tables are built by worker processes once a grammar compiles (fsm/table_worker.py), for
    # indexes up to device_dfa_max_index_bytes serialized (~7 bytes a transition); the device
    # holds up to device_dfa_max_rows states' rows and device_dfa_max_exceptions transitions
    # off the states' common next state
    device_dfa: bool = True
    device_dfa_max_index_bytes: int = 8 << 20
    device_dfa_max_rows: int = 1 << 16
    device_dfa_max_exceptions: int = 1 << 24
    # overlapped scheduling: the host updates step t and prepares t+2 while the device runs
    # t+1; None: on where the model runs on a GPU (on the CPU nothing runs alongside the host)
    # unless num_scheduler_steps > 1 was asked for
    async_scheduling: bool | None = None
    # overlapped scheduling: fill a step's masks on the mask thread while the host makes the
    # next step's drafts, schedules and prepares it (True), or on the step loop before those.
    # Measured on an H200 (RESULTS, session 5): the loop wins, 12495 vs 9214 tok/s at 64: the
    # two threads' Python halves contend for the GIL and both run 1.7-2.7x slower
    concurrent_masks: bool = False
    # lazy masks: a constrained request whose last filled mask row allowed at least
    # lazy_mask_min_allowed of the vocabulary (inside a JSON string, say) samples without its
    # mask; the host checks the token against the grammar and, where it is outside, the request
    # runs that position again, masked. Gumbel-max sampling gives eager masks' outputs (an
    # allowed unmasked argmax is the masked argmax; a position run again is recomputed in
    # another batch, whose bf16 numerics on a GPU can tip a near tie, as a verify step's can),
    # and the costliest rows (long strings) are never filled. None: on with overlapped
    # scheduling (where a fill holds up the sampling), and there only while the host hardly
    # waits on the device (under 0.5 ms a step, and less than it fills masks: LazyGate). H100, one warm engine, on / off: default
    # model +5% at 64, +11% at 256; random 8B -3% at 64, +1% at 256 (RESULTS, session 12)
    lazy_masks: bool | None = None
    lazy_mask_min_allowed: float = 0.5
    # a row sampled unmasked also brings back its best lazy_mask_candidates tokens in the
    # sampler's order; the first the grammar takes is the masked sample (kernels/candidates.py),
    # so a token outside costs the request the step in flight only, not that and a step run
    # again. Off by default: on the random 8B at 256 (H100) 8 candidates cut the misses from
    # 168-340 to 93-163 a run, but cost 0.25 ms of GPU a full step and the ratio fell (0.928,
    # 0.878 against 0.947, 0.933 without; RESULTS, session 19)
    lazy_mask_candidates: int = 0
    # CUDA events at each forward pass and sampling, for the spans where the device waits on
    # the host (guided/worker/device_timeline.py; benchmarks only: a few events a step)
    device_timeline: bool = False
    # the server logs what it is doing (requests, tokens a second, cache hits, step phases)
    # this often while it has work (guided/server/stats_log.py); 0: never
    log_stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        def need(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        need(self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128",
             "block_size")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
             "num_kv_blocks must be at least 2 (or None to size it from memory)", "num_kv_blocks")
        need(0.05 <= self.gpu_memory_utilization <= 0.99,
             "gpu_memory_utilization must lie in [0.05, 0.99]", "gpu_memory_utilization")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1", "max_num_seqs")
        need(self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16",
             "max_num_batched_tokens")
        need(self.max_model_len is None or self.max_model_len >= 16,
             "max_model_len must be >= 16", "max_model_len")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             "dtype must be auto, float32, bfloat16 or float16", "dtype")
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             "device must be auto, cpu or cuda[:N]", "device")
        need(self.max_whitespace >= 0, "max_whitespace must be >= 0", "max_whitespace")
        need(self.compile_timeout_s > 0, "compile_timeout_s must be > 0", "compile_timeout_s")
        need(self.schema_processes is None or self.schema_processes >= 0,
             "schema_processes must be >= 0 (or None)", "schema_processes")
        need(self.dfa_max_wait_size is None or self.dfa_max_wait_size >= 0,
             "dfa_max_wait_size must be >= 0 (or None)", "dfa_max_wait_size")
        need(self.compile_threads is None or self.compile_threads >= 1,
             "compile_threads must be >= 1 (or None)", "compile_threads")
        need(self.xgrammar_threads is None or self.xgrammar_threads >= 1,
             "xgrammar_threads must be >= 1 (or None)", "xgrammar_threads")
        need(self.dfa_upgrade_threads >= 1, "dfa_upgrade_threads must be >= 1",
             "dfa_upgrade_threads")
        need(self.device_dfa_max_rows >= 1 and self.device_dfa_max_exceptions >= 1,
             "device_dfa_max_rows and device_dfa_max_exceptions must be >= 1", "device_dfa")
        need(self.num_scheduler_steps >= 1, "num_scheduler_steps must be >= 1", "num_scheduler_steps")
        need(not (self.async_scheduling and self.num_scheduler_steps > 1),
             "async_scheduling and num_scheduler_steps > 1 are alternatives: choose one",
             "async_scheduling")
        need(self.admission_lookahead_tokens >= 0, "admission_lookahead_tokens must be >= 0",
             "admission_lookahead_tokens")
        need(self.max_draft_tokens_per_step is None or self.max_draft_tokens_per_step >= 0,
             "max_draft_tokens_per_step must be >= 0 (or None)", "max_draft_tokens_per_step")
        need(self.lookup_draft_tokens >= 0, "lookup_draft_tokens must be >= 0",
             "lookup_draft_tokens")
        need(self.lookup_max_batch is None or self.lookup_max_batch >= 0,
             "lookup_max_batch must be >= 0 (or None)", "lookup_max_batch")
        need(self.min_anchor_gain == self.min_anchor_gain, "min_anchor_gain must be a number",
             "min_anchor_gain")
        need(0 <= self.lazy_mask_candidates <= 64, "lazy_mask_candidates must lie in [0, 64]",
             "lazy_mask_candidates")
        need(0.0 <= self.lazy_mask_min_allowed <= 1.0, "lazy_mask_min_allowed must lie in [0, 1]",
             "lazy_mask_min_allowed")
        need(self.mask_processes is None or 0 <= self.mask_processes <= 64,
             "mask_processes must lie in [0, 64] (or None)", "mask_processes")
        need(self.max_jump_forward_tokens >= 1, "max_jump_forward_tokens must be >= 1",
             "max_jump_forward_tokens")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; known: {sorted(names)}", param=unknown[0])
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
