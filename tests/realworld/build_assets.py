"""Builds, once, the small data set and tokenizer the torchtitan harness trains on; the outputs are committed.

    python3 tests/realworld/build_assets.py      # rewrites tests/realworld/assets/{c4_test,tokenizer}

Nothing is downloaded, at build time or at run time. The text is the Python Language Reference topics that
ship with CPython (``pydoc_data.topics``, PSF License, the same source as meshscope's trainer corpus), one
topic per JSON line in the layout of torchtitan's ``c4_test`` data set (its repository's
``tests/assets/c4_test``: one ``{"text": ...}`` object per line, read by ``datasets.load_dataset(path,
split="train")`` in ``torchtitan/hf_datasets/text_datasets.py:44-47``, the text taken from the "text" key by
``_process_c4_text``). The tokenizer is a byte-level BPE trained on that text with the ``tokenizers`` library,
2048 entries (llama3_debugmodel's vocab_size, ``torchtitan/models/llama3/__init__.py:122``), with the
``<|begin_of_text|>`` / ``<|end_of_text|>`` specials that ``HuggingFaceTokenizer`` reads from
``tokenizer_config.json`` (``torchtitan/components/tokenizer.py``). The output is deterministic for one
CPython and tokenizers version; the committed files are what the tests use, not a rebuild.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASSETS = HERE / "assets"
VOCAB = 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
MAX_TEXT_BYTES = 400_000


def documents() -> list[str]:
    from pydoc_data.topics import topics

    docs, size = [], 0
    for name in sorted(topics):
        text = topics[name].strip()
        if len(text) < 200:
            continue
        docs.append(text)
        size += len(text.encode())
        if size >= MAX_TEXT_BYTES:
            break
    return docs


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = documents()
    data_dir = ASSETS / "c4_test"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "data.json", "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    tok_dir = ASSETS / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, **special} for t in (BOS, EOS)},
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in sorted(ASSETS.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(HERE)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
