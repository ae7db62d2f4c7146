import numpy as np
import pytest
import torch

from guided.worker.step_upload import NUM_BUFFERS, StepUpload, byte_offsets, pack, unpack


def step_arrays(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """A step's inputs: int64 and int32 arrays of odd lengths, a 2-D one, empty ones."""
    return [rng.integers(-2**40, 2**40, size=n, dtype=np.int64),
            rng.integers(0, 2**31 - 1, size=(max(n // 3, 1), 5), dtype=np.int32),
            np.array([], dtype=np.int64),
            rng.integers(0, 2**31 - 1, size=n + 1, dtype=np.int32),
            np.array([], dtype=np.int32),
            rng.integers(0, 100, size=3, dtype=np.int64)]


def test_offsets_are_aligned_and_disjoint():
    arrays = step_arrays(np.random.default_rng(0), 7)
    offsets, total = byte_offsets(arrays)
    assert all(o % 8 == 0 for o in offsets)
    ends = [o + a.nbytes for o, a in zip(offsets, arrays)]
    assert all(end <= start for end, start in zip(ends, offsets[1:] + [total]))


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_packed_views_equal_the_arrays(n):
    arrays = step_arrays(np.random.default_rng(n), n)
    offsets, total = byte_offsets(arrays)
    buffer = torch.full((total + 16,), 0xAB, dtype=torch.uint8)
    pack(arrays, offsets, buffer)
    views = unpack(buffer, arrays, offsets)
    for a, v in zip(arrays, views):
        assert v.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
        assert tuple(v.shape) == a.shape
        assert np.array_equal(v.numpy(), a)


def test_on_the_cpu_upload_is_the_arrays_themselves():
    arrays = step_arrays(np.random.default_rng(1), 9)
    for a, t in zip(arrays, StepUpload(torch.device("cpu")).upload(arrays)):
        assert np.array_equal(t.numpy(), a)


@pytest.mark.gpu
def test_gpu_uploads_survive_the_buffers_being_reused():
    upload = StepUpload(torch.device("cuda"))
    rng = np.random.default_rng(2)
    kept = []
    for n in [5, 4000, 3, 70000, 12, 9]:  # buffers grow and are taken in turn
        arrays = step_arrays(rng, n)
        kept.append((arrays, upload.upload(arrays)))
    assert len(kept) > 2 * NUM_BUFFERS
    torch.cuda.synchronize()
    for arrays, tensors in kept:
        for a, t in zip(arrays, tensors):
            assert t.device.type == "cuda" and tuple(t.shape) == a.shape
            assert np.array_equal(t.cpu().numpy(), a)
