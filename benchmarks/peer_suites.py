"""The vLLM and SGLang projects' own structured-output and tool-calling tests against `guided
serve` (the embedded default model, CPU). Their test files run as they are, copied from
checkouts you name into a work folder (never into this repo); only their test harness is
replaced: vLLM's `tests.utils.RemoteOpenAIServer` and SGLang's `popen_launch_server` start
`guided serve` under the model name the test asks for (their engine flags are dropped; API key,
chat template, reasoning parser and context length are passed on). Nothing is fetched at test
time: vllm imports the harness needs resolve to empty stubs, LoRA downloads to an empty folder.

    pip install --target /tmp/peer-deps pytest-asyncio lark   # their test dependencies
    python benchmarks/peer_suites.py --vllm ~/src/vllm --sglang ~/src/sglang \
        --deps /tmp/peer-deps [--work DIR]

--sglang may also be an unpacked sglang wheel (its sglang/test/kits and tool_call_test_runner);
a file a checkout lacks is listed as missing. Prints one table: suite, test, result. The triage
of each failure (ours, the model's answer, outside the contract): results/peer_suites_s33.md."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (suite, checkout, path in it, pytest -k or ""): the structured-output and tool-calling tests
SUITES = [  # the longest first: they run --jobs at a time
    ("vllm", "vllm", ("tests/entrypoints/openai/chat_completion/"
                      "test_completion_with_function_calling.py"), ""),
    ("sglang", "sglang", "kits.py", ""),  # written below around SGLang's kits and tool runner
    ("sglang", "sglang", ("test/srt/openai_server/function_call/"
                          "test_openai_function_calling.py"), ""),
    ("vllm", "vllm", "tests/entrypoints/openai/chat_completion/test_chat.py",
     "structured_outputs or response_format or extra_fields"),
    ("vllm", "vllm", "tests/entrypoints/openai/test_completion.py", "guided"),  # older vLLM
    ("sglang", "sglang", "test/srt/openai_server/features/test_structural_tag.py", ""),
    ("sglang", "sglang", "test/srt/openai_server/features/test_openai_server_ebnf.py", ""),
    ("vllm", "vllm", "tests/entrypoints/openai/completion/test_completion.py", "invalid"),
    ("vllm", "vllm", "tests/v1/entrypoints/openai/test_chat_completion.py", "invalid"),
]
# a request, and a test, still running after this long on a loaded 2-core CPU fails with a
# timeout (their clients would wait 10 minutes, then retry twice; a stream never): a tiny model
# that never closes a think section or a string otherwise runs to the end of the context at a
# few tokens a second
REQUEST_TIMEOUT_S = 300
SERVE = [sys.executable, "-m", "guided.server.cli", "serve"]
# their server flags -> ours; the rest are engine settings that mean nothing here
FLAGS = {"--reasoning-parser": "--reasoning-parser", "--chat-template": "--chat-template",
         "--max-model-len": "--max-model-len", "--context-length": "--max-model-len",
         "--api-key": "--api-key", "--max-running-requests": "--max-num-seqs"}

LAUNCH = f'''import os, socket, subprocess, sys, time
import requests
REPO, SERVE, FLAGS = {str(REPO)!r}, {SERVE!r}, {FLAGS!r}
LOGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_logs")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model, port, args, api_key=None, env=None, timeout=600):
    """`guided serve` on port, serving the default model as `model`, until /health answers."""
    ours, it = ["--served-model-name", model], iter(list(args))
    for a in it:
        key, _, val = str(a).partition("=")
        if key in FLAGS:
            ours += [FLAGS[key], val or next(it)]
            if key == "--reasoning-parser" and ours[-1] not in ("deepseek_r1", "qwen3"):
                ours[-1] = "think"
    ours += ["--api-key", api_key] if api_key else []
    os.makedirs(LOGS, exist_ok=True)
    log = open(os.path.join(LOGS, f"{{port}}.log"), "w")
    proc = subprocess.Popen([*SERVE, "--port", str(port), *ours], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={{**os.environ, **(env or {{}}), "PYTHONPATH": REPO}})
    deadline = time.time() + timeout
    while not _healthy(port):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"guided serve did not come up: {{log.name}}")
        time.sleep(0.5)
    return proc


def _healthy(port):
    try:
        return requests.get(f"http://127.0.0.1:{{port}}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def stop(proc):
    import signal
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        proc.kill()
'''
VLLM_UTILS = '''from pathlib import Path
import openai
from guided_launch import free_port, launch, stop
VLLM_PATH = Path(__file__).resolve().parents[1]
ROCM_ENV_OVERRIDES: dict = {}
ROCM_EXTRA_ARGS: list = []


class RemoteOpenAIServer:
    def __init__(self, model, vllm_serve_args, *, env_dict=None, max_wait_seconds=600, **_):
        self.port = free_port()
        self.proc = launch(model, self.port, vllm_serve_args, env=env_dict,
                           timeout=max_wait_seconds)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        stop(self.proc)

    @property
    def url_root(self):
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, *parts):
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kw):
        return openai.OpenAI(base_url=self.url_for("v1"), api_key="token-abc123", **kw)

    def get_async_client(self, **kw):
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key="token-abc123", **kw)
'''
# vLLM's test modules import a few vllm internals that only their unit tests use: empty stubs
VLLM_CONFTEST = '''import importlib.abc, importlib.machinery, signal, sys, tempfile, types
import pytest


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Stubs())


@pytest.fixture(autouse=True, scope="session")
def _no_downloads():
    import huggingface_hub
    huggingface_hub.snapshot_download = lambda *a, **k: tempfile.mkdtemp()


def _bounded(init):  # the clients' default timeout, no retries (a retry repeats a long output)
    def patched(self, *args, **kwargs):
        kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
        kwargs.setdefault("max_retries", 0)
        init(self, *args, **kwargs)
    return patched


@pytest.fixture(autouse=True)
def _deadline():  # a stream's chunks keep a read timeout alive: the test as a whole has one too
    def expire(*_):
        raise TimeoutError("the test ran past REQUEST_TIMEOUT_S + 60 s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(REQUEST_TIMEOUT_S + 60)  # after a request's own timeout, which reports better
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report):  # each result as it comes (a killed run keeps them)
    if report.when == "call" or report.outcome != "passed":
        lines = report.longreprtext.strip().splitlines() if report.failed else []
        why = [x[1:].strip() for x in lines if x.startswith("E ")][:1] + lines[-1:]
        with open("results.txt", "a") as out:
            out.write(f"{report.outcome.upper()} {report.nodeid} {' '.join(why)}"[:400] + "\\n")


import openai, requests
openai.OpenAI.__init__ = _bounded(openai.OpenAI.__init__)
openai.AsyncOpenAI.__init__ = _bounded(openai.AsyncOpenAI.__init__)
_request = requests.Session.request
requests.Session.request = lambda self, *a, **k: _request(
    self, *a, **{"timeout": REQUEST_TIMEOUT_S, **k})
'''.replace("REQUEST_TIMEOUT_S", str(REQUEST_TIMEOUT_S))
SGL_UTILS = '''import unittest
from guided_launch import free_port, launch
DEFAULT_SMALL_MODEL_NAME_FOR_TEST = "meta-llama/Llama-3.2-1B-Instruct"
DEFAULT_MODEL_NAME_FOR_TEST = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600
DEFAULT_URL_FOR_TEST = f"http://127.0.0.1:{free_port()}"
CustomTestCase = unittest.TestCase


def popen_launch_server(model, base_url, timeout=600, api_key=None, other_args=(), env=None,
                        **_):
    return launch(model, int(base_url.rsplit(":", 1)[1]), other_args, api_key, env, timeout)


class ModelLaunchSettings:
    def __init__(self, model_path, tp_size=1, extra_args=None, env=None, variant=None, **_):
        self.model_path, self.extra_args, self.env, self.variant = \\
            model_path, extra_args or [], env, variant
'''
SGL_SRT_UTILS = '''import os, signal, time


def kill_process_tree(pid, include_parent=True, **_):
    """SIGTERM the server's group and wait it out: the next class reuses the same port."""
    try:
        os.killpg(pid, signal.SIGTERM)
        while os.waitpid(pid, os.WNOHANG) == (0, 0):  # the server is this process's child
            time.sleep(0.5)
    except (ProcessLookupError, ChildProcessError):
        pass
'''
# their setUpClass loads the model's tokenizer (a download) that no test taken here uses
NO_TOKENIZER = "def get_tokenizer(*args, **kwargs):\n    return None\n"
# SGLang's test/srt files wrap each kit in a class that launches a server; one server here
SGL_KITS = '''import openai, pytest
from sglang.srt.utils import kill_process_tree
from sglang.test import tool_call_test_runner as tc
from sglang.test.kits.ebnf_constrained_kit import EBNFConstrainedMixin
from sglang.test.kits.json_constrained_kit import JSONConstrainedMixin
from sglang.test.kits.json_mode_kit import JSONModeMixin
from sglang.test.kits.regex_constrained_kit import RegexConstrainedMixin
from sglang.test.test_utils import (DEFAULT_SMALL_MODEL_NAME_FOR_TEST as MODEL,
                                    DEFAULT_URL_FOR_TEST as URL, CustomTestCase,
                                    popen_launch_server)


def setUpModule():
    global _proc
    _proc = popen_launch_server(MODEL, URL, other_args=["--max-running-requests", "10"])


def tearDownModule():
    kill_process_tree(_proc.pid)


class _Base(CustomTestCase):
    model, base_url = MODEL, URL
    client = openai.Client(api_key="EMPTY", base_url=URL + "/v1")


class TestJSONConstrained(_Base, JSONConstrainedMixin): pass
class TestJSONMode(_Base, JSONModeMixin): pass
class TestRegexConstrained(_Base, RegexConstrainedMixin): pass
class TestEBNFConstrained(_Base, EBNFConstrainedMixin): pass


@pytest.mark.parametrize("name,fn", [(n, f) for n, f, flag in tc._TESTS
                                     if getattr(tc.ToolCallTestParams(), flag)])
def test_tool_call_runner(name, fn):
    fn(_Base.client, MODEL)  # run_tool_call_test's loop, its default cases, one item each
'''


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def prepare(work: Path, vllm: Path | None, sglang: Path | None) -> list[tuple[str, str, str]]:
    """The work folder: harness shims, the peers' test files; returns (suite, file, -k) to run."""
    write(work / "guided_launch.py", LAUNCH)
    write(work / "conftest.py", VLLM_CONFTEST)
    write(work / "pytest.ini", "[pytest]\nasyncio_mode = strict\n"
          "asyncio_default_fixture_loop_scope = function\n")
    write(work / "tests/__init__.py", "")
    write(work / "tests/utils.py", VLLM_UTILS)
    if sglang is not None:
        src = next(p for p in (sglang / "python/sglang/test", sglang / "sglang/test") if p.is_dir())
        shutil.copytree(src / "kits", work / "sglang/test/kits", dirs_exist_ok=True)
        shutil.copy(src / "tool_call_test_runner.py", work / "sglang/test/")
        for name, text in {"__init__.py": "", "test/__init__.py": "", "srt/__init__.py": "",
                           "test/test_utils.py": SGL_UTILS, "srt/utils/__init__.py": SGL_SRT_UTILS,
                           "srt/utils/hf_transformers_utils.py": NO_TOKENIZER,
                           "srt/hf_transformers_utils.py": NO_TOKENIZER}.items():
            write(work / "sglang" / name, text)
        write(work / "sglang_tests/kits.py", SGL_KITS)
    runs = []
    for suite, checkout, rel, select in SUITES:
        root = {"vllm": vllm, "sglang": sglang}[checkout]
        if root is None:
            continue
        if rel == "kits.py":
            runs.append((suite, "sglang_tests/kits.py", select))
            continue
        if not (root / rel).is_file():
            print(f"missing: {checkout}/{rel}")
            continue
        dest = work / (rel if suite == "vllm" else "sglang_tests/" + Path(rel).name)
        write(dest, (root / rel).read_text())
        for parent in Path(rel).parents:  # package __init__ and the fixtures' conftest.py
            for name in ("__init__.py", "conftest.py") if suite == "vllm" else ():
                if (root / parent / name).is_file() and parent != Path("tests"):
                    write(work / parent / name, (root / parent / name).read_text())
        runs.append((suite, str(dest.relative_to(work)), select))
    return runs


def run(work: Path, runs: list[tuple[str, str, str]], deps: Path | None, jobs: int) -> None:
    """Each file in its own pytest (and server), `jobs` at a time; then the table."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (work, deps) if p)}
    logs, running = [], []
    for suite, path, select in runs:
        log = work / (path.replace("/", "_") + ".log")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", path,
               *(["-k", select] if select else [])]
        with open(log, "w") as out:
            running.append(subprocess.Popen(cmd, cwd=work, env=env, stdout=out,
                                            stderr=subprocess.STDOUT))
        logs.append((suite, log))
        while len([p for p in running if p.poll() is None]) >= jobs:
            time.sleep(5)
    for proc in running:
        proc.wait()
    rows = [(suite, test, status) for suite, log in logs for status, test in re.findall(
        r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", log.read_text(), re.MULTILINE)]
    width = max((len(t) for _, t, _ in rows), default=10)
    print(f"| suite  | {'test':<{width}} | result |\n|--------|{'-' * (width + 2)}|--------|")
    for suite, test, status in rows:
        print(f"| {suite:<6} | {test:<{width}} | {status:<6} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", type=Path, help="a vLLM checkout")
    ap.add_argument("--sglang", type=Path, help="an SGLang checkout or unpacked wheel")
    ap.add_argument("--deps", type=Path, help="where pytest-asyncio and lark are installed "
                    "(kept out of guided's environment: pytest-asyncio changes how pytest runs)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/peer-suites-work"))
    ap.add_argument("--jobs", type=int, default=1, help="test files run at once")
    args = ap.parse_args()
    run(args.work, prepare(args.work, args.vllm, args.sglang), args.deps, args.jobs)


if __name__ == "__main__":
    main()
