"""What loading a quantized GGUF keeps, asserted without timing or RSS thresholds: no float32 copy of a
quantized weight and no second copy of its bytes, the file's map released (during the load, page by
page, and at its end), source bytes let go as each weight is complete, and a converted directory
written without float32 weights unless asked for them."""

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from pagedllm.model import gguf_loader, load_model
from pagedllm.model.layers import quantized
from pagedllm.model.layers.linear import QKVParallelLinear
from pagedllm.model.layers.quantized import QuantizedWeight, QuantTensor
from pagedllm.model.loader import default_gguf_path, resolve_hf_dir
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.tiny_models import make_hf_model

needs_kernel = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def mapped_rss_kib(path: Path) -> int | None:
    """This process's resident KiB of its mappings of ``path`` (/proc/self/smaps), None if unmapped."""
    total, inside = None, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
            if inside and total is None:
                total = 0
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def reachable_tensors(model) -> list[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and tensors in its modules' attributes
    (packed copies, ``QuantizedWeight``s' bytes), each storage once."""
    found, seen = [], set()

    def add(t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if t.numel() and key not in seen:
            seen.add(key)
            found.append(t)

    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            add(t)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif isinstance(value, QuantizedWeight):
                add(value.packed)
    return found


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_load_keeps_one_packed_copy_and_releases_the_map(tmp_path, kind, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(make_hf_model(kind, seed=7), path, GGMLQuantizationType[qtype])
    model = load_model(str(path)).model
    assert mapped_rss_kib(path) is None  # no view of the file outlives the load (checked before any gc)

    reader = GGUFReader(path)
    quant_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == GGMLQuantizationType[qtype])
    float_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == GGMLQuantizationType.F32)
    padded_rows = sum(-(-int(t.shape[1]) // 16) * 16 - int(t.shape[1]) for t in reader.tensors
                      if t.tensor_type == GGMLQuantizationType[qtype])
    del reader
    row_bytes = 64 // 32 * quantized.GGUF_BLOCKS[GGMLQuantizationType[qtype]][1]  # every tiny matrix has K = 64
    held = reachable_tensors(model)
    packed = sum(t.numel() for t in held if t.dtype == torch.uint8)
    # The repacked weights are the file's quantized bytes (plus the zero rows that fill a 16-row
    # panel), once: no staged source copy, no second packed copy.
    assert packed == quant_bytes + padded_rows * row_bytes
    # Float32 tensors: the norms (the file's F32 tensors) and the rotary tables, nothing else.
    rotary = {t.untyped_storage().data_ptr() for m in model.modules() if "Rotary" in type(m).__name__
              for t in list(m.buffers(recurse=False)) + [v for v in vars(m).values() if isinstance(v, torch.Tensor)]}
    floats = sum(t.numel() * t.element_size() for t in held
                 if t.dtype == torch.float32 and t.untyped_storage().data_ptr() not in rotary)
    assert floats == float_bytes


def test_release_pages_drops_a_tensors_pages_from_the_resident_set(tmp_path):
    path = tmp_path / "tiny-Q8_0.gguf"
    hf = make_hf_model("llama", seed=8)
    write_llama_gguf(hf, path, GGMLQuantizationType.Q8_0)
    reader = gguf_loader.open_for_weights(path)
    biggest = max(reader.tensors, key=lambda t: int(t.n_bytes))  # the embedding: several pages
    assert int(biggest.n_bytes) > 4 * 4096
    gguf_loader.release_pages(reader)
    before = mapped_rss_kib(path)
    assert int(np.asarray(biggest.data).sum()) >= 0  # reads every page of the tensor
    touched = mapped_rss_kib(path)
    assert touched - before >= int(biggest.n_bytes) // 1024 - 4
    gguf_loader.release_pages(reader, biggest)
    # Its pages are gone (a fault also maps a few neighbouring pages, which stay: "fault-around").
    assert touched - mapped_rss_kib(path) >= int(biggest.n_bytes) // 1024 - 8
    for t in reader.tensors:
        np.asarray(t.data).sum()
    gguf_loader.release_pages(reader)
    assert mapped_rss_kib(path) == 0
    # The bytes read after a release are the same (the page cache maps them again).
    again = np.asarray(biggest.data).copy()
    assert np.array_equal(again, np.asarray(GGUFReader(path).tensors[reader.tensors.index(biggest)].data))


def test_open_for_weights_drops_the_tokenizer_arrays_only():
    path = default_gguf_path()  # a real tokenizer: 49 K tokens and merges
    full, light = GGUFReader(path), gguf_loader.open_for_weights(path)
    dropped = set(full.fields) - set(light.fields)
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= dropped
    assert all(k.startswith("tokenizer.") and len(full.fields[k].data) > 1 for k in dropped)
    assert "tokenizer.ggml.eos_token_id" in light.fields
    assert gguf_loader.gguf_to_hf_config(light).to_dict() == gguf_loader.gguf_to_hf_config(full).to_dict()


def _quant(qtype, n: int, k: int, seed: int) -> QuantTensor:
    from gguf.quants import quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return QuantTensor(int(qtype), torch.from_numpy(quantize(w, qtype)), k)


@needs_kernel
def test_a_weight_is_repacked_when_its_last_shard_comes():
    qtype = GGMLQuantizationType.Q4_0
    layer = QKVParallelLinear(64, 16, 4, 2)
    param = layer.weight
    q, k, v = _quant(qtype, 64, 64, 1), _quant(qtype, 32, 64, 2), _quant(qtype, 32, 64, 3)
    param.weight_loader(param, v, "v")
    param.weight_loader(param, q, "q")
    assert len(param.__dict__["quant_shards"]) == 2 and "quant_ready" not in param.__dict__
    param.weight_loader(param, k, "k")
    assert "quant_shards" not in param.__dict__  # the sources are let go
    ready = param.__dict__["quant_ready"]
    layer.process_weights_after_loading()
    assert layer.quant_weight is ready and param.numel() == 0
    whole = QuantTensor(int(qtype), torch.cat([q.raw, k.raw, v.raw]), 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer.matmul(x, None), x @ whole.materialize().T, atol=1e-4, rtol=0)


@needs_kernel
def test_a_complete_weight_staged_again_is_dequantized_last_rows_winning():
    qtype = GGMLQuantizationType.Q8_0
    layer = QKVParallelLinear(64, 16, 4, 2)
    param = layer.weight
    first = [_quant(qtype, n, 64, s) for n, s in ((64, 1), (32, 2), (32, 3))]
    for shard, shard_id in zip(first, "qkv"):
        param.weight_loader(param, shard, shard_id)
    again = _quant(qtype, 32, 64, 4)
    param.weight_loader(param, again, "k")
    layer.process_weights_after_loading()
    assert layer.quant_weight is None
    expected = torch.cat([first[0].materialize(), again.materialize(), first[2].materialize()])
    assert torch.equal(param.detach(), expected)


def test_a_gguf_directory_holds_float_weights_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "tiny-Q8_0.gguf"
    write_llama_gguf(make_hf_model("llama", seed=10), path, GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path))
    directory = Path(loaded.model_path)
    assert (directory / "config.json").exists() and not list(directory.glob("*.safetensors"))
    dense = load_model(str(path), gguf_dequantize=True)  # reads the float32 weights: converted again, with them
    assert dense.model_path == loaded.model_path and (directory / "model.safetensors").exists()

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf_dir", must_not_convert)
    assert str(resolve_hf_dir(str(path))) == loaded.model_path  # weights there now: either kind of load reuses it
    assert load_model(str(path)).model_path == loaded.model_path
    gc.collect()


def test_the_heap_is_trimmed_as_the_weights_load_not_only_at_the_end(monkeypatch):
    """Holes of freed repacking temporaries stay resident until a trim: one every TRIM_EVERY_BYTES of source."""
    trims = []
    monkeypatch.setattr(gguf_loader, "release_free_heap", lambda: trims.append(len(seen)))
    monkeypatch.setattr(gguf_loader, "TRIM_EVERY_BYTES", 1000)
    raw = QuantTensor(int(GGMLQuantizationType.Q8_0), torch.zeros(4, 2 * 34, dtype=torch.uint8), 64)  # 272 bytes
    items = [("a", raw), ("b", torch.zeros(100)), ("c", raw), ("d", raw), ("e", torch.zeros(300))]
    seen = []
    for item in gguf_loader.trimming_heap(iter(items)):
        seen.append(item)
    assert seen == items
    assert trims == [4, 5]  # once 272 + 400 + 272 + 272 >= 1000 bytes have passed, then 1200 more
