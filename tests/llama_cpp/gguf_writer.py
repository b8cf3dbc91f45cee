"""Writes a tiny random-weight Llama GGUF file for llama-cpp-python's tests.

Run with the llama-cpp-python venv's interpreter (the project's own venv has no ``gguf``):
``python tests/llama_cpp/gguf_writer.py OUT.gguf``. The model is a 4-layer, 256-wide Llama
(14 MB) with a character-level SentencePiece vocabulary (every printable ASCII character, byte
fallback for the rest): it loads in milliseconds and decodes a token in well under a millisecond
on one CPU thread, and a prompt of a few hundred tokens takes tens of milliseconds to prefill.

Its outputs are kept to the printable characters: every token embedding carries a large constant
in dimension 0, which dominates the final RMS norm, and the output rows of the control and byte
tokens have a large negative weight there. So generation never samples end-of-sequence (a
request always runs to ``max_tokens``, as ``ignore_eos`` would make it on vLLM) and every output
token is one whole character: one streamed chunk per token.
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType

HIDDEN = 256
"""The default width; ``gguf_writer.py OUT.gguf WIDTH`` writes a wider (slower) model."""
LAYERS = 4
HEADS = 4
FEED_FORWARD_PER_HIDDEN = 3
CONTEXT = 4096
_WEIGHT_STD = 0.02
_CONSTANT_DIMENSION_VALUE = 10.0
_SUPPRESSED_LOGIT_WEIGHT = -100.0
_SEED = 1234


def vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    """(pieces, scores, token types): <unk>, <s>, </s>, 256 byte tokens, printable ASCII."""
    pieces: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for value in range(256):
        pieces.append(f"<0x{value:02X}>".encode())
        types.append(TokenType.BYTE)
    for code in range(0x20, 0x7F):
        pieces.append("\u2581".encode() if code == 0x20 else bytes([code]))
        types.append(TokenType.NORMAL)
    scores = [0.0] * len(pieces)
    return pieces, scores, [int(kind) for kind in types]


def write_model(path: str, hidden: int = HIDDEN) -> None:
    feed_forward = FEED_FORWARD_PER_HIDDEN * hidden
    pieces, scores, types = vocabulary()
    rng = np.random.default_rng(_SEED)
    vocab = len(pieces)

    def random(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * _WEIGHT_STD).astype(np.float32)

    writer = GGUFWriter(path, "llama")
    writer.add_name("tokentrace-tiny-llama")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(feed_forward)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(hidden // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    embeddings = random(vocab, hidden)
    embeddings[:, 0] = _CONSTANT_DIMENSION_VALUE
    output = rng.standard_normal((vocab, hidden)).astype(np.float32)
    output[:, 0] = 0.0
    suppressed = [index for index, kind in enumerate(types) if kind != int(TokenType.NORMAL)]
    output[suppressed, 0] = _SUPPRESSED_LOGIT_WEIGHT
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(LAYERS):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}.{name}.weight", random(hidden, hidden))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", random(feed_forward, hidden))
        writer.add_tensor(f"{prefix}.ffn_up.weight", random(feed_forward, hidden))
        writer.add_tensor(f"{prefix}.ffn_down.weight", random(hidden, feed_forward))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    write_model(sys.argv[1], *(int(width) for width in sys.argv[2:3]))
