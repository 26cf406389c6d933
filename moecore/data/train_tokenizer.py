"""Regenerate the embedded tokenizer, `moecore/data/assets/tokenizer.json`.

    python -m moecore.data.train_tokenizer [--vocab-size 4096] [--max-mb 6] [--output PATH]

A byte-level BPE (GPT-2 style pre-tokenization, 256 byte symbols, no unknown token) trained with Hugging Face
`tokenizers` on the embedded corpus (the Python standard library sources, see `corpus.py`), with one special
token, `<|endoftext|>`, used as end-of-document. The shipped file was produced by this script with its
defaults; rerunning it is only needed to change the vocabulary. Changing the file changes the tokenizer's
fingerprint, so cached tokenized corpora are rebuilt automatically.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moecore.data.corpus import iter_texts, select_files
from moecore.data.tokenizer import EMBEDDED_TOKENIZER, EOD_TOKEN


def train_bpe(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE with `vocab_size` entries in total (bytes + merges + the EOD token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-mb", type=float, default=6.0, help="megabytes of standard-library text to train on")
    ap.add_argument("--output", type=Path, default=EMBEDDED_TOKENIZER)
    args = ap.parse_args(argv)
    files = select_files(max_bytes=int(args.max_mb * 1024 * 1024))
    texts = list(iter_texts(files))
    t0 = time.perf_counter()
    tok = train_bpe(texts, args.vocab_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.output), pretty=False)
    size_kb = args.output.stat().st_size / 1024
    print(
        f"trained on {len(files)} files ({sum(f.size for f in files) / 2**20:.1f} MB) in "
        f"{time.perf_counter() - t0:.1f} s: vocab {tok.get_vocab_size()}, wrote {args.output} ({size_kb:.0f} KB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
