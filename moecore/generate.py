"""Sampling from a trained run: `moecore generate RUN_DIR --prompt TEXT`."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from moecore.checkpoint import latest_checkpoint, load_model_weights
from moecore.config import Config, ConfigError, config_from_dict
from moecore.models.transformer import MoETransformer


@torch.no_grad()
def sample(
    model: MoETransformer,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
) -> list[int]:
    """Autoregressive sampling (temperature 0: greedy). Recomputes the prefix each step (no KV cache)."""
    model.eval()
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    max_len = model.cfg.model.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(x[:, -max_len:]).logits[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        x = torch.cat([x, torch.tensor([[nxt]], device=device)], dim=1)
        if stop_id is not None and nxt == stop_id:
            break
    return x[0].tolist()


def load_run(run_dir: Path) -> tuple[MoETransformer, Config, Path]:
    """The model of a run folder with its latest checkpoint's weights."""
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} is invalid: no config.yaml (not a moecore run folder)")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} is invalid: it holds no complete checkpoint")
    cfg = config_from_dict(yaml.safe_load(cfg_file.read_text()))
    model = MoETransformer(cfg)
    load_model_weights(ckpt, model)
    return model, cfg, ckpt


def generate_from_run(
    run_dir: Path, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50, seed: int = 0
) -> str:
    from moecore.data.tokenizer import load_tokenizer

    model, cfg, _ = load_run(Path(run_dir))
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError("--prompt='' is invalid: give some text to continue")
    gen = torch.Generator().manual_seed(seed)
    out = sample(model, ids, max_new_tokens, temperature, top_k, gen, stop_id=tok.eod_id)
    return tok.decode(out)
