"""A rank's slices read straight from the default model's GGUF equal the same slices of the
whole dequantized conversion, for every piece of every rank's layout."""
from __future__ import annotations

import pytest
import torch

from guided.worker import loader
from guided.worker.loader import GgufReader, default_gguf_path, load_model_config, read_gguf_weights
from guided.worker.models.llama import weight_pieces
from guided.worker.models.parallel import shard_layout


@pytest.fixture(scope="module")
def whole():
    return read_gguf_weights(default_gguf_path())


@pytest.mark.parametrize("world_size", [1, 2])  # 2: uneven heads, halved vocab
def test_slices_equal_the_whole_conversions(whole, world_size, monkeypatch):
    # chunks of 200 rows: column slices cross several, and q/k chunks round down to whole heads
    monkeypatch.setattr(loader, "CHUNK_ROWS", 200)
    config, state = whole
    reader = GgufReader(default_gguf_path())
    for rank in range(world_size):
        for pieces in weight_pieces(config, shard_layout(config, rank, world_size)).values():
            for piece in pieces:
                got = torch.empty(piece.slice_shape)
                reader.read_into(piece, got)
                want = state[piece.name]
                if piece.dim is not None:
                    want = want.narrow(piece.dim, piece.start, piece.stop - piece.start)
                assert torch.equal(got, want), piece


def test_a_gguf_config_is_read_without_converting_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GUIDED_CACHE_DIR", str(tmp_path))
    config = load_model_config(str(default_gguf_path()))
    assert config.num_kv_heads == 3 and config.tie_word_embeddings
    converted = list(tmp_path.iterdir())
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
    assert not (converted[0] / "model.safetensors").exists()


def test_converting_the_weights_later_adds_them_beside_the_config(tmp_path, monkeypatch):
    """A copy converted without weights keeps its files (a reader may have them open) and
    gains model.safetensors when a whole-model start needs it."""
    from guided.worker.loader import resolve_model_dir

    monkeypatch.setenv("GUIDED_CACHE_DIR", str(tmp_path))
    gguf = str(default_gguf_path())
    light = resolve_model_dir(gguf, need_weights=False)
    config = light / "config.json"
    before = config.stat().st_ino
    assert resolve_model_dir(gguf) == light
    assert (light / "model.safetensors").is_file() and config.stat().st_ino == before
