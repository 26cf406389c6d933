"""Tokenizers: the embedded byte-level BPE and any Hugging Face `tokenizer.json`.

`load_tokenizer(None)` returns the small byte-level BPE shipped in `moecore/data/assets/tokenizer.json`
(4096 entries, trained on the embedded corpus by `moecore/data/train_tokenizer.py`, end-of-document
token `<|endoftext|>`). `load_tokenizer(PATH)` loads a `tokenizer.json` file, or the one inside a folder
(a Hugging Face model folder); the end-of-document id comes from the folder's `tokenizer_config.json`
(`eos_token`) where present, else from the usual special-token names.

Text is encoded without the tokenizer's post-processor (no BOS/EOS added), as Megatron's preprocessing
does for GPT data; documents are separated by an explicit EOD where the caller asks for it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from moecore.config import ConfigError

EMBEDDED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "<｜end▁of▁sentence｜>")


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the few things training needs."""

    def __init__(self, hf: HFTokenizer, eod_id: int | None, source: str) -> None:
        self._hf = hf
        self.eod_id = eod_id
        self.source = source
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.fingerprint: str = hashlib.sha256(hf.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (parallel inside the Rust library)."""
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _find_eod(hf: HFTokenizer, folder: Path | None) -> int | None:
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        try:
            conf = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError):
            conf = {}
        eos = conf.get("eos_token")
        if isinstance(eos, dict):  # older configs store an AddedToken mapping
            eos = eos.get("content")
        if isinstance(eos, str) and hf.token_to_id(eos) is not None:
            return hf.token_to_id(eos)
    for name in _EOD_CANDIDATES:
        tid = hf.token_to_id(name)
        if tid is not None:
            return tid
    return None


def load_tokenizer(path: str | Path | None = None, field: str = "data.tokenizer") -> Tokenizer:
    """The embedded tokenizer (path None) or a Hugging Face tokenizer.json file / folder holding one."""
    if path is None:
        file, folder = EMBEDDED_TOKENIZER, None
    else:
        p = Path(path)
        if p.is_dir():
            file, folder = p / "tokenizer.json", p
        else:
            file, folder = p, p.parent
        if not file.is_file():
            raise ConfigError(
                f"{field}={str(path)!r} is invalid: expected a tokenizer.json file or a folder holding one"
            )
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a generic Exception for malformed files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{field}={str(file)!r} is not a readable tokenizer.json: {first}") from None
    return Tokenizer(hf, _find_eod(hf, folder), str(file))
