"""A tiny random-weight Llama with its own byte-level BPE tokenizer, built locally in seconds.

No model hub needs to be reachable: the demo, the tests and the benches only need something vLLM
loads and serves through its normal paths (tokenizer, chat template, Llama model runner, KV
cache), not sensible text. The
tokenizer is trained on the Python standard library's own sources, so nothing is downloaded, and
the same interpreter and seed give byte-identical files.

    python -m tokentrace.loadgen.tiny_model DIR    # writes the model directory DIR and prints it
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# One role marker, the content, then eos per message; the generation prompt opens the assistant's
# turn. Rendered by vLLM for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_DEFAULT_VOCAB_SIZE = 1024
_DEFAULT_SEED = 0
_DEFAULT_MAX_POSITIONS = 2048
"""RoPE has no position weights, so a long context costs nothing; each server picks its own
`--max-model-len` up to this."""
# Standard-library modules whose sources make the tokenizer's training text (about 1.5 MB): fixed
# names in a fixed order, so the merges are the same on every run with the same interpreter.
_CORPUS_MODULES = (
    "argparse.py",
    "textwrap.py",
    "difflib.py",
    "inspect.py",
    "typing.py",
    "dataclasses.py",
    "pathlib.py",
    "subprocess.py",
    "threading.py",
    "tarfile.py",
    "pydoc.py",
    "ast.py",
    "collections/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
)


def _corpus_lines() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            yield from path.read_text(encoding="utf-8", errors="replace").splitlines()


def build_tokenizer(*, vocab_size: int = _DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast`.

    Every byte is in the alphabet, so any text encodes; `<s>` is prepended on encode the way Llama
    tokenizers do, and the chat template above is attached.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=_DEFAULT_MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"{token!r} is not a single token")
    return token_id


def build_tiny_model(
    directory: Path,
    *,
    vocab_size: int = _DEFAULT_VOCAB_SIZE,
    seed: int = _DEFAULT_SEED,
    max_positions: int = _DEFAULT_MAX_POSITIONS,
) -> Path:
    """Write tokenizer files and a 2-layer random Llama (bf16 safetensors) into `directory`.

    About 1.3 MB on disk. Deterministic for a given interpreter, seed and library versions.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=vocab_size)
    tokenizer.save_pretrained(directory)
    special_ids = {token: _token_id(tokenizer, token) for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).bfloat16()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory", type=Path, help="where to write the model")
    parser.add_argument("--seed", type=int, default=_DEFAULT_SEED)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.directory, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
