"""Run logging: `metrics.jsonl`, TensorBoard, optional Weights & Biases; FLOPs, MFU and GPU memory helpers.

`RunLogger(run_dir, cfg.log, is_main, cfg.to_dict())` writes one JSON object per `log(step, metrics)` call
to `run_dir/metrics.jsonl` (`step`, `time` and the metrics; tensors become numbers or lists, non-finite
numbers become null), the scalar metrics to TensorBoard event files in `run_dir` and, when
`log.wandb_project` is set and wandb is installed, to Weights & Biases. Only the main rank writes;
elsewhere every call is a no-op. On resume (`resume_step=N`) records after step N are dropped from
metrics.jsonl and TensorBoard, so the resumed run continues the same curves without duplicates.

`flops_per_token(cfg, seq_length)` counts the model FLOPs of one training token (forward + backward = 3 x
forward, recomputation not counted, as MFU is defined): 2 FLOPs per multiply-add of every weight matrix a
token passes through, where an MoE layer counts its router, its `router_topk` activated experts and its
shared expert only, plus the attention score and value products over the causal context.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from moecore.config import Config, LogConfig

# Dense bf16/fp16 tensor-core peak TFLOPs per device (no sparsity), matched on the CUDA device name.
PEAK_TFLOPS_BF16 = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("V100", 125.0),
)


def _plain(value: Any) -> Any:
    """A JSON-ready version of a metric: tensors/arrays to numbers or lists, non-finite floats to None."""
    if hasattr(value, "detach"):  # torch.Tensor
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 and value.dim() == 0 else value.tolist()
    elif hasattr(value, "tolist"):  # numpy array or scalar
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class RunLogger:
    """metrics.jsonl + TensorBoard + optional W&B for one run; a no-op on non-main ranks."""

    def __init__(
        self,
        run_dir: Path | str,
        log_cfg: LogConfig,
        is_main: bool,
        config_dict: dict,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = log_cfg
        self.is_main = is_main
        self._file = None
        self._tb = None
        self._wandb = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        if log_cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = resume_step + 1 if resume_step is not None else None
                self._tb = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge)
                if resume_step is None:
                    self._tb.add_text("config", "```\n" + json.dumps(config_dict, indent=2, default=str) + "\n```")
            except ImportError:
                print("TensorBoard logging is off: the tensorboard package is not installed", file=sys.stderr)
        if log_cfg.wandb_project:
            self._wandb = self._init_wandb(log_cfg.wandb_project, config_dict)

    def _truncate_after(self, step: int) -> None:
        if not self.metrics_path.is_file():
            return
        kept = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (ValueError, AttributeError):
                continue  # a line cut short by a crash
        self.metrics_path.write_text("".join(s + "\n" for s in kept), encoding="utf-8")

    def _init_wandb(self, project: str, config_dict: dict) -> Any:
        try:
            import wandb
        except ImportError:
            print(
                f"log.wandb_project={project!r} is set but wandb is not installed "
                "(pip install 'moecore[wandb]'); continuing without Weights & Biases",
                file=sys.stderr,
            )
            return None
        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id)
        return wandb.init(
            project=project,
            name=self.run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            config=config_dict,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One record: a line of metrics.jsonl, scalars to TensorBoard and W&B."""
        if not self.is_main:
            return
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# FLOPs, MFU, memory
# --------------------------------------------------------------------------------------------------


def selected_keys(seq: int, topk: int, causal: bool = True) -> float:
    """Average keys a DSA query attends to: min(topk, visible keys), over the queries of a sequence (query t of a
    causal sequence sees t + 1 keys; every query sees `seq` without the causal mask)."""
    if not causal:
        return float(min(topk, seq))
    if seq <= topk:
        return (seq + 1) / 2
    return (topk * (topk + 1) / 2 + (seq - topk) * topk) / seq


def _indexer_flops(cfg: Config, ctx: float) -> float:
    """Forward FLOPs per token of a DSA layer's lightning indexer: its three projections (q from MLA's query latent,
    the shared key, the head weights) and its scores over `ctx` keys: nh dot products of index_head_dim and the
    head-weighted sum, per key (models/dsa.py)."""
    m = cfg.model
    nh, d = m.index_n_heads, m.index_head_dim
    proj = m.q_lora_rank * nh * d + m.hidden_size * d + m.hidden_size * nh
    return 2.0 * (proj + nh * (d + 1) * ctx)


def _attention_flops(cfg: Config, ctx: float, linear: bool, keys: float | None = None, indexer: bool = False) -> float:
    """Forward FLOPs per token of one token mixer: projections + score/value products (or the linear recurrence).

    DSA: `keys`, the keys the main attention reads per query (the selected ones in the sparse stage; None: `ctx`),
    counted in MLA's per-head form (the model's FLOPs, whatever form the kernel computes them in); `indexer`: the
    layer has a lightning indexer, scoring `ctx` keys per query (GLM-5's shared layers reuse another's top-k)."""
    m = cfg.model
    h, nh = m.hidden_size, m.num_attention_heads
    if linear:
        hk, hv, dk, dv = (
            m.linear_num_key_heads,
            m.linear_num_value_heads,
            m.linear_key_head_dim,
            m.linear_value_head_dim,
        )
        key_dim, value_dim = hk * dk, hv * dv
        proj = h * (2 * key_dim + 2 * value_dim) + h * 2 * hv + value_dim * h
        conv = (2 * key_dim + value_dim) * m.linear_conv_kernel_dim
        # Gated delta rule per value head: S k (read), the rank-1 state update, q S (output): 3 dk x dv products.
        return 2.0 * (proj + conv + 3 * hv * dk * dv)
    if m.attention_type in ("mla", "dsa"):
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * nh * qk if m.q_lora_rank else h * nh * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        proj = q + kv + nh * m.v_head_dim * h
        read = ctx if keys is None else keys
        extra = _indexer_flops(cfg, ctx) if indexer else 0.0
        return 2.0 * (proj + nh * (qk + m.v_head_dim) * read) + extra
    hd = m.resolved_head_dim
    q_out = nh * hd * (2 if m.attn_output_gate else 1)
    proj = h * q_out + 2 * h * m.kv_heads * hd + nh * hd * h
    return 2.0 * (proj + 2 * nh * hd * ctx)


def compressed_attention_flops(cfg: Config, layer: int, seq: int) -> float:
    """Forward FLOPs per token of a DeepSeek-V4 attention layer (models/compressed_attention.py), causal sequences
    of `seq`: projections (q LoRA, the key/value head, the grouped output projection, a compressor's two
    projections, the indexer's three), and per query 2 n D products per key read: min(window, visible) local keys
    plus the visible compressed entries (HCA) or the indexer's picks among them (CSA), which the indexer scores with
    its nh heads of d."""
    m = cfg.model
    h, n, d, ql = m.hidden_size, m.num_attention_heads, m.resolved_head_dim, m.q_lora_rank
    proj = h * ql + ql * n * d + h * d + n * d * m.o_lora_rank + m.o_groups * m.o_lora_rank * h
    keys = min((seq + 1) / 2, float(m.sliding_window))
    kind = m.layer_types[layer]
    extra = 0.0
    if kind != "sliding_attention":
        csa = kind == "compressed_sparse_attention"
        rate = m.csa_compress_rate if csa else m.hca_compress_rate
        entries = seq // rate
        visible = max(entries - 1, 0) / 2  # query t sees (t + 1) // rate entries: about entries / 2 on average
        proj += 2 * h * (2 * d if csa else d)
        keys += selected_keys(entries, m.index_topk) if csa and entries else visible
        if csa:
            nh, di = m.index_n_heads, m.index_head_dim
            proj += 2 * h * 2 * di + ql * nh * di + h * nh
            extra = 2.0 * nh * (di + 1) * visible
    return 2.0 * (proj + 2 * n * d * keys) + extra


def hyper_connection_flops(cfg: Config) -> float:
    """Forward FLOPs per token of one layer's two hyper-connections (n streams): the weight projection from the
    n H stream values, the collapse and the merge."""
    n, h = cfg.model.hc_mult, cfg.model.hidden_size
    return 2 * 2.0 * ((2 + n) * n * n * h + n * h + n * n * h + n * h)


def _ffn_flops(cfg: Config, moe: bool) -> float:
    """Forward FLOPs per token of one layer's feed-forward block (MoE: router + activated experts only)."""
    m, e = cfg.model, cfg.moe
    mats = 2 if m.activation == "gelu" else 3
    if not moe:
        return 2.0 * mats * m.hidden_size * m.ffn_hidden_size
    macs = m.hidden_size * e.num_experts + e.router_topk * mats * m.hidden_size * e.ffn_hidden_size
    if e.shared_expert_intermediate_size:
        macs += mats * m.hidden_size * e.shared_expert_intermediate_size
        if e.shared_expert_gate:
            macs += m.hidden_size
    return 2.0 * macs


def flops_per_token(
    cfg: Config,
    seq_length: int | None = None,
    vocab_size: int | None = None,
    training: bool = True,
    causal: bool = True,
) -> float:
    """Model FLOPs per token (training: forward + backward = 3 x forward; `causal=False`: full S x S scores).

    `vocab_size` defaults to model.vocab_size (pass the data bundle's when that is 0)."""
    m = cfg.model
    s = seq_length or cfg.train.seq_length
    vocab = vocab_size or m.vocab_size
    if not vocab:
        raise ValueError("flops_per_token needs vocab_size when model.vocab_size is 0")
    ctx = (s + 1) / 2 if causal else float(s)  # average number of keys a query attends to
    if m.sliding_window:
        ctx = min(ctx, float(m.sliding_window))
    dsa = m.attention_type == "dsa"
    # DSA: the sparse stage's main attention reads the selected keys; dense_warmup's reads every visible key
    keys = selected_keys(s, m.index_topk, causal) if dsa and m.dsa_stage == "sparse" else None
    fwd = 0.0
    for i in range(m.num_layers):
        linear = m.layer_types is not None and m.layer_types[i] == "linear_attention"
        indexer = dsa and (m.indexer_types is None or m.indexer_types[i] != "shared")
        if m.attention_type == "compressed":
            fwd += compressed_attention_flops(cfg, i, s) + (hyper_connection_flops(cfg) if m.hc_mult > 1 else 0.0)
        else:
            fwd += _attention_flops(cfg, ctx, linear, keys, indexer)
        fwd += _ffn_flops(cfg, cfg.moe.is_moe_layer(i, m.num_layers))
    fwd += 2.0 * m.hidden_size * vocab  # output head (the embedding lookup costs no FLOPs)
    for _ in range(m.mtp_num_layers):  # each MTP depth: 2H -> H projection, an MoE block with full attention, head
        fwd += 2.0 * 2 * m.hidden_size * m.hidden_size + 2.0 * m.hidden_size * vocab
        fwd += _attention_flops(cfg, ctx, False, keys, dsa) + _ffn_flops(cfg, cfg.moe.num_experts > 0)
    return 3.0 * fwd if training else fwd


def peak_tflops(device_name: str | None = None) -> float | None:
    """Dense bf16 peak TFLOPs of a CUDA device from its name (the current device by default), else None."""
    if device_name is None:
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            device_name = torch.cuda.get_device_name()
        except Exception:
            return None
    for key, value in PEAK_TFLOPS_BF16:
        if key in device_name:
            return value
    return None


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float | None, num_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over num_devices x peak TFLOP/s (None without a peak)."""
    if not peak or num_devices < 1:
        return None
    return tokens_per_s * flops_per_tok / (num_devices * peak * 1e12)


def gpu_memory_stats(device: Any = None, reset_peak: bool = False) -> dict[str, float]:
    """`mem/max_allocated_gb` and `mem/max_reserved_gb` of a CUDA device; {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    gib = float(1 << 30)
    out = {
        "mem/max_allocated_gb": torch.cuda.max_memory_allocated(device) / gib,
        "mem/max_reserved_gb": torch.cuda.max_memory_reserved(device) / gib,
    }
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return out
