"""Hugging Face import and export.

    model = moecore.hf.load_pretrained("path/to/hf_folder")    # config.json + safetensors
    logits = model(input_ids).logits                            # [batch, seq, vocab]
    moecore.hf.save_pretrained(model, "path/to/out")            # transformers.AutoModelForCausalLM loads it

Supported Hugging Face model_types: see `moecore.hf.families.family_names()`. Conversion streams one
tensor at a time (see `pretrained.py`); `convert.py` is the `moecore convert` command.
"""

from moecore.hf.families import family_names
from moecore.hf.pretrained import load_pretrained, save_pretrained

__all__ = ["family_names", "load_pretrained", "save_pretrained"]
