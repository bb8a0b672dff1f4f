"""The table of docs/security.md: the embedded default model's GGUF corrupted in one place per row, and the line
``pagedllm generate Hello --model FILE`` prints for it (the validator's message; FILE stands for the path).

    python -m tests.model.gguf_corruption_table > /tmp/table.md
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType

from pagedllm.errors import InvalidModelFileError
from pagedllm.model.gguf_model_checks import validate_gguf
from pagedllm.model.loader import default_gguf_path
from tests.model.gguf_corruption import Layout, Place, patched


def corruptions(layout: Layout) -> list[tuple[str, list]]:
    """(what was done, [(place, value)]) on the default model (SmolLM2-135M: 30 layers, width 576, 9 heads, 3 kv
    heads, vocabulary 49152; matrices Q4_1 or Q8_0)."""
    down, gate = "blk.0.ffn_down.weight", "blk.0.ffn_gate.weight"
    offset = layout.tensor_offset(down)
    return [
        ("a tensor offset moved by 3 bytes", [(offset, layout.read(offset) + 3)]),
        ("a tensor's type changed from Q4_1 to Q8_0", [(layout.tensor_type(down), int(GGMLQuantizationType.Q8_0))]),
        ("a tensor's type unknown (99)", [(layout.tensor_type(down), 99)]),
        ("a tensor offset past the end of the file", [(offset, 1 << 40)]),
        ("a zero dimension", [(layout.tensor_dim(down, 1), 0)]),
        ("swapped dimensions", [(layout.tensor_dim(gate, 0), 1536), (layout.tensor_dim(gate, 1), 576)]),
        ("5 dimensions", [(Place(layout.tensors[down][2][0], "<I"), 5)]),
        ("`rope.freq_base` NaN", [(layout.value("llama.rope.freq_base"), math.nan)]),
        ("`layer_norm_rms_epsilon` infinite", [(layout.value("llama.attention.layer_norm_rms_epsilon"), math.inf)]),
        ("`tokenizer.ggml.tokens` length 2^40", [(layout.value("tokenizer.ggml.tokens"), 1 << 40)]),
        ("a key's length 2^40", [(layout.key_length("llama.block_count"), 1 << 40)]),
        ("a value type unknown (77)", [(layout.key_type("llama.context_length"), 77)]),
        ("`block_count` stored as a float", [(layout.key_type("llama.block_count"), 6)]),
        ("tensor count 2^40", [(layout.value("GGUF.tensor_count"), 1 << 40)]),
        ("key-value count 2^40", [(layout.value("GGUF.kv_count"), 1 << 40)]),
        ("version 99", [(layout.value("GGUF.version"), 99)]),
        ("`block_count` 1000", [(layout.value("llama.block_count"), 1000)]),
        ("`block_count` 29", [(layout.value("llama.block_count"), 29)]),
        ("`context_length` 2^31-1", [(layout.value("llama.context_length"), 2**31 - 1)]),
        ("`head_count` 0", [(layout.value("llama.attention.head_count"), 0)]),
        ("`head_count` 7", [(layout.value("llama.attention.head_count"), 7)]),
        ("`head_count_kv` 2", [(layout.value("llama.attention.head_count_kv"), 2)]),
        ("`embedding_length` 577", [(layout.value("llama.embedding_length"), 577)]),
        ("`vocab_size` 49151", [(layout.value("llama.vocab_size"), 49151)]),
        ("`eos_token_id` 49152", [(layout.value("tokenizer.ggml.eos_token_id"), 49152)]),
    ]


def main() -> int:
    source = default_gguf_path()
    layout = Layout(source)
    rows = ["| corruption of the default model's GGUF | what `pagedllm generate Hello --model FILE` prints |",
            "|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "bad.gguf"
        cases = corruptions(layout) + [("the file cut in half", None), ("not a GGUF file", None)]
        for what, edits in cases:
            if edits is not None:
                patched(source, target, *edits)
            elif what.startswith("the file cut"):
                data = source.read_bytes()
                target.write_bytes(data[: len(data) // 2])
            else:
                target.write_bytes(b"PK\x03\x04" + b"\0" * 100)
            try:
                validate_gguf(target)
                message = "(loads)"
            except InvalidModelFileError as e:
                message = "error: " + str(e).replace(str(target), "FILE")
            rows.append(f"| {what} | `{message}` |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
