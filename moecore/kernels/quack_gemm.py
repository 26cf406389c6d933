"""The expert FFN's grouped GEMMs through QuACK's CuTe-DSL kernels on Hopper: an optional backend.

QuACK (`pip install "moecore[quack]"`: the `quack-kernels` package and NVIDIA's CUTLASS Python DSL it runs on)
compiles its GEMMs just in time, as Triton does, so there is nothing for a user to build. Its Hopper GEMMs are
warp-specialised: a producer warp streams the operand tiles through TMA while one or two consumer warp groups run
wgmma, and in the ping-pong schedule one consumer's epilogue (the tile's store) runs under the other's main loop.
That overlap is what the expert FFN's GEMMs need at a few hundred rows per expert, where each tile's store is a
large share of its time; our Triton kernels do not get it (docs/design.md, "Expert GEMMs"). A persistent tile
scheduler walks variable-length groups on the GPU: `cu_seqlens_m` (each expert's rows: the forward and
input-gradient GEMMs) and `cu_seqlens_k` (the weight gradients, each contracted over its expert's rows; an expert
with no rows gets a zero gradient). Nothing reads the counts on the host, so the launches can be captured.

The GEMMs, with `bounds` the experts' row offsets [E + 1] (int32, `grouped_gemm.group_bounds`):

    grouped_mm(a, b, bounds, trans_b=True)    out[rows of e] = a[rows of e] @ b[e]^T     a [M, K], b [E, N, K]
    grouped_mm(a, b, bounds, trans_b=False)   out[rows of e] = a[rows of e] @ b[e]       a [M, K], b [E, K, N]
    grouped_wgrad(a, b, bounds)               out[e] = a[rows of e]^T @ b[rows of e]     a [M, N1], b [M, N2]

With `rows` (int32 [M], indices into a's rows) the GEMM's left operand is a[rows]: QuACK's load warps can gather
the rows (cp.async) while its other operand streams in through TMA, so a layer can feed its tokens [T, H] to the
FC1 GEMM in expert order, or its output gradient to the FC2 GEMMs, without writing the [M, H] copies of a
permutation (`moe.activation_memory=minimal`, moecore/moe/minimal.py). Those gathering loads are slower than TMA's,
by more than the copy at some shapes, so gathering is timed against copying the rows first (below). Gathering
needs clusters of one CTA along N, so the 128x128 tile pairs its CTAs along M there.

The tile shape matters (up to 2x between the tiles of `TILES` at one GEMM), and no rule fitted to the shapes we
measured held at the next shape (docs/benchmarks.md, "QuACK's grouped GEMMs"), so each GEMM shape is timed once
per process under each tile and under torch's grouped GEMM, and the fastest is kept (`choose`): QuACK's kernels
run only where they are faster. That first call synchronises with the GPU; under CUDA-graph capture, before any
eager call has tuned the shape, `tile_for`'s measured rule decides instead.

How evenly the rows fall on the experts changes which tile is fastest (with a few experts holding most rows, the
others' last tiles are mostly empty and the tiles' work is uneven), so a choice is also keyed by the layer's load
spread (`LoadSpread`: the busiest expert's rows over the mean, as a power of two), read from an earlier step's
counts without waiting for the GPU. Where the load is skewed, tiles handed out by an atomic counter on the GPU
(QuACK's dynamic persistent scheduler) are timed beside the statically assigned ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moecore.kernels._triton import modules_import

# name: (tile_m, tile_n, pingpong, cluster_m, cluster_n). Cooperative 128x256 tiles in clusters of two along M;
# ping-pong 128x192 tiles in clusters of two along M; ping-pong 128x128 tiles in clusters of two along N; ping-pong
# 64x256 tiles in clusters of two along M. Each expert's rows are tiled apart, so its last tile along M is partly
# empty: with 256 +- 16 rows per expert (DeepSeek-V3's shape, random routing) 128-row tiles hold 320 rows per
# expert on average, 64-row ones 288. Measured (one H100, docs/benchmarks.md, "The 64-row tile"), the 64-row
# tile's lower operand reuse costs more than that at most GEMMs (DeepSeek-V3's FC1 10.5-11.4 ms against 7.7-8.2);
# it is the fastest at a few (Qwen3-Next's FC1 by ~1%, its SwiGLU-backward GEMM by 12%), so it stays a candidate.
TILES = {
    "128x256": (128, 256, False, 2, 1),
    "128x192": (128, 192, True, 2, 1),
    "128x128": (128, 128, True, 1, 2),
    "64x256": (64, 256, True, 2, 1),
}

KINDS = ("fwd13", "fwd2", "dgrad2", "dgrad13", "wgrad2", "wgrad13")


def quack_importable() -> bool:
    """True when QuACK's GEMM interface imports (it is an optional dependency: the `quack` extra)."""
    return modules_import("quack", "quack.gemm_config", "quack.gemm_interface")


def quack_available(device: torch.device) -> bool:
    """Whether QuACK's grouped GEMMs can run on `device`: QuACK imports and it is a Hopper GPU (compute
    capability 9.x, the only architecture they were measured on here)."""
    if device.type != "cuda" or not quack_importable():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def quack_runs(*tensors: torch.Tensor) -> bool:
    """Whether QuACK's grouped GEMMs run on these tensors: bf16 / fp16 CUDA tensors on a Hopper GPU (the only
    architecture they were measured on here), every last dimension a multiple of 8 (TMA's 16-byte strides)."""
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    if any(t.dtype not in (torch.bfloat16, torch.float16) or t.shape[-1] % 8 for t in tensors):
        return False
    return quack_available(tensors[0].device)


def tile_for(kind: str, rows_per_expert: float, n: int) -> str:
    """A tile (a TILES key) for GEMM `kind` (KINDS) with `n` output columns per expert, without measuring: the
    first guess, and the choice under CUDA-graph capture before `grouped_mm` / `grouped_wgrad` have tuned a shape.

    From one-H100 measurements at six model shapes (docs/benchmarks.md): with <= 512 rows per expert the FC1
    forward and the data gradient through w2 take 128x256 tiles and the FC2 forward 128x128 (128x192 for outputs
    >= 4096 wide); the data gradient through w13 (n = hidden) takes 128x256 for wide experts (hidden >= 4096);
    128x192 tiles serve the rest where the output's width is a multiple of 192 or >= 2048 (elsewhere their last
    column of tiles is mostly padding: Qwen3-Next's 512-wide FC2 weight gradient took 1.29 ms with them, 0.79
    with 128x256), and 128x256 tiles serve experts of >= 2048 rows."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: allowed: {' | '.join(KINDS)}")
    few, many = rows_per_expert <= 512, rows_per_expert >= 2048
    if kind == "dgrad13" and n >= 4096:
        return "128x256"
    if few and kind in ("fwd2", "dgrad13"):
        return "128x192" if n >= 4096 else "128x128"
    if few and kind in ("fwd13", "dgrad2"):
        return "128x256"
    if many or not (n % 192 == 0 or n >= 2048):
        return "128x256"
    return "128x192"


# Tiles whose dynamically scheduled variant ("<tile>+dyn": each CTA takes its next tile from an atomic counter
# rather than every P-th one) is timed where the load is skewed (spread >= SKEWED: the busiest expert holds >= 4x
# the mean), where the tiles' work is uneven: an expert of a few rows gives weight-gradient tiles that only store.
# Measured on an H100 (docs/benchmarks.md, "Tiles chosen per load spread"), it won the weight gradients at
# Qwen3-Next's skewed shape (dW13 1.49 against 1.69 ms) and every GEMM at DeepSeek-V3's. Under random routing every
# tile of a GEMM does about the same work, and it is not timed. Taking the experts heaviest, lightest, second
# heaviest, ... (QuACK's `batch_idx_permute`) was also timed and lost to plain dynamic scheduling at every weight
# gradient measured.
DYNAMIC = "+dyn"
DYNAMIC_TILES = ("128x256", "128x192")
SKEWED = 3


def tile_config(tile: str, gather: bool = False):
    """QuACK's GemmConfig for a TILES key, statically scheduled, or dynamically for "<key>+dyn"; `gather`: for
    A's rows gathered."""
    from quack.gemm_config import GemmConfig

    dynamic = tile.endswith(DYNAMIC)
    tm, tn, pingpong, cm, cn = TILES[tile.removesuffix(DYNAMIC)]
    if gather and cn > 1:  # QuACK gathers A's rows only in clusters of one CTA along N
        cm, cn = cn, 1
    return GemmConfig(
        tile_m=tm, tile_n=tn, pingpong=pingpong, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=dynamic
    )


def launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, tile: str, **varlen) -> torch.Tensor:
    """QuACK's GEMM with an explicit tile configuration (its autotuner's wrapped function: no tuning pass).
    varlen: cu_seqlens_m or cu_seqlens_k, and A_idx where A's rows (varlen_m) or columns (varlen_k) are gathered."""
    from quack.gemm_interface import gemm_tuned

    run = getattr(gemm_tuned, "fn", gemm_tuned)
    run(A, B, out, config=tile_config(tile, varlen.get("A_idx") is not None), **varlen)
    return out


# ---------------------------------------------------------------- choosing per shape, by measuring

# The choice per GEMM shape, made once per process by timing the candidates (as Triton's autotuner keeps its
# choices): QuACK's tiles (`TILES`) and torch's grouped GEMM, which stays the choice where it is faster. Every candidate
# accumulates each output in the same order, so the choice changes the speed, not the values (their outputs were
# bit-identical in the measurements of docs/benchmarks.md). Where the rows are gathered, the candidates are QuACK's
# tiles gathering in their loads and "copy": the gathered rows written out first, then this GEMM without rows (its
# own choice). Gathering loads run through cp.async rather than TMA and were slower than the copy at some shapes
# (DeepSeek-V3's FC1, 10.9 against 7.9 ms + the copy, docs/benchmarks.md). Into a given `out` torch's kernel
# would write a whole extra gradient and copy it (14 GiB at DeepSeek-V3's FC1 weight gradient, a peak the first
# step would pay while choosing, enough to run an 80 GB GPU out of memory): it is not a candidate there.
CANDIDATES = (*TILES, "torch")
COPY = "copy"
_CHOICES: dict[tuple, str] = {}
CHOICE_TIMES: dict[tuple, dict[str, float]] = {}  # the ms each candidate took when a shape was chosen (reports)


def _time_ms(fn: Callable[[], object], reps: int = 3) -> float:
    """GPU milliseconds per call of fn, after one untimed call (which compiles a new kernel)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _candidates(gathered: bool = False, into_out: bool = False, spread: int = 1) -> tuple[str, ...]:
    """What `choose` times: CANDIDATES, with "copy" instead of torch's kernel for gathered rows and without it for
    a given output tensor (`into_out`); with a skewed load (spread >= SKEWED) the DYNAMIC_TILES' dynamically scheduled variants
    too, except for gathered rows (QuACK gathers only under the static scheduler on Hopper)."""
    dynamic = tuple(t + DYNAMIC for t in DYNAMIC_TILES) if spread >= SKEWED and not gathered else ()
    if not (gathered or into_out):
        return (*CANDIDATES, *dynamic)
    tiles = tuple(c for c in CANDIDATES if c != "torch")
    return (*tiles, COPY) if gathered else (*tiles, *dynamic)


def choose(key: tuple, guess: str, run: Callable[[str], object], candidates: tuple[str, ...] = ()) -> str:
    """The candidate for this GEMM shape: the memorised one, else (outside CUDA-graph capture) the fastest of
    `candidates` (default CANDIDATES) by `_time_ms` (one that fails to compile is passed over), else `guess`."""
    choice = _CHOICES.get(key)
    if choice is not None:
        return choice
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return guess
    candidates, times = candidates or CANDIDATES, {}
    for cand in candidates:
        try:
            times[cand] = _time_ms(lambda c=cand: run(c))
        except Exception:  # a tile this QuACK version cannot compile for the shape
            continue
    choice = min(times, key=times.get) if times else (COPY if COPY in candidates else "torch")  # both always run
    _CHOICES[key], CHOICE_TIMES[key] = choice, times
    return choice


def shape_key(kind: str, a: torch.Tensor, m: int, n: int, E: int, layout: str = "", spread: int = 1) -> tuple:
    """What a choice depends on: the GEMM, its widths, the experts, the rows per expert (to a power of two), the
    load's spread (`LoadSpread`) and the operands' layout ("rows": the left operand's rows gathered; "t": a
    transposed output)."""
    per_expert = max(m // max(E, 1), 1)
    return (kind, E, a.shape[1], n, a.dtype, per_expert.bit_length(), spread, layout)


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    trans_b: bool,
    kind: str,
    rows: torch.Tensor | None = None,
    spread: int = 1,
) -> torch.Tensor:
    """out[rows of e] = A[rows of e] @ (b[e]^T if trans_b else b[e]) -> [M, N] in a's dtype, with A = a, or
    A = a[rows] for `rows` int32 [M] (gathered in QuACK's loads, or copied first: whichever timed faster).
    `spread`: the layer's `LoadSpread` value, which the choice is keyed by."""
    E = b.shape[0]
    B = b.transpose(1, 2) if trans_b else b  # [E, K, N], as QuACK takes it
    n = B.shape[2]
    m = a.shape[0] if rows is None else rows.numel()
    if m == 0:
        return a.new_empty(0, n)

    def run(cand: str) -> torch.Tensor:
        if cand == COPY:
            return grouped_mm(a.index_select(0, rows), b, bounds, trans_b, kind, spread=spread)
        if cand == "torch":
            return torch._grouped_mm(a, B, offs=bounds[1:])
        return launch(a, B, a.new_empty(m, n), cand, cu_seqlens_m=bounds, A_idx=rows)

    gathered = rows is not None
    key = shape_key(kind, a, m, n, E, "rows" if gathered else "", spread)
    guess = COPY if gathered else tile_for(kind, m / max(E, 1), n)
    return run(choose(key, guess, run, _candidates(gathered, spread=spread)))


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    kind: str,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    spread: int = 1,
) -> torch.Tensor:
    """out[e] = A[rows of e]^T @ b[rows of e] -> [E, N1, N2] in a's dtype (zeros for an expert without rows), with
    A = a, or A = a[rows] for `rows` int32 [M] (gathered in QuACK's loads, or copied first: whichever timed faster).
    `out`: an [E, N1, N2] tensor of a's dtype to write (e.g. a slice of a larger gradient, or the transpose of a
    contiguous [E, N2, N1] one: QuACK stores either layout). `spread`: as for `grouped_mm`."""
    E = bounds.numel() - 1
    m = b.shape[0]
    if m == 0:
        return (a.new_empty(E, a.shape[1], b.shape[1]) if out is None else out).zero_()

    def run(cand: str) -> torch.Tensor:
        if cand == COPY:
            return grouped_wgrad(a.index_select(0, rows), b, bounds, kind, out, spread=spread)
        if cand == "torch":  # torch's grouped GEMM has no out=: its result is copied in where one is given
            res = torch._grouped_mm(a.t(), b, offs=bounds[1:])
            return res if out is None else out.copy_(res)
        dst = a.new_empty(E, a.shape[1], b.shape[1]) if out is None else out
        return launch(a.t(), b, dst, cand, cu_seqlens_k=bounds, A_idx=rows)

    n, gathered, transposed = b.shape[1], rows is not None, out is not None and not out.is_contiguous()
    key = shape_key(kind, a, m, n, E, ("rows" if gathered else "") + ("t" if transposed else ""), spread)
    guess = COPY if gathered else tile_for(kind, m / max(E, 1), n)
    return run(choose(key, guess, run, _candidates(gathered, out is not None, spread)))


# ---------------------------------------------------------------- the load's spread, read without waiting


def spread_of(busiest: int, rows: int, num_experts: int) -> int:
    """The load spread the choices are keyed by: the busiest expert's rows over the mean, floored to a power of two
    and given as its bit length (1: under 2x the mean, 2: 2-4x, 3: 4-8x, ...; 1 without rows)."""
    return max(busiest * num_experts // rows, 1).bit_length() if rows > 0 else 1


class LoadSpread:
    """A layer's load spread (`spread_of`), as of the latest of its steps whose counts the host can read without
    waiting: `current` returns the value from the last asynchronous copy that has landed (1 before any has; in
    training, an earlier step's: the loads drift slowly, and a stale value changes only the speed, never the
    results), and `queue`, called once the step's GEMMs are launched, queues the busiest expert's count for the
    next copy to pinned host memory (one reduction and one copy, kept off the launches before the first GEMM).
    `observe` does both. On the CPU the value is read at once; under CUDA-graph capture nothing is queued and the
    last value stays."""

    def __init__(self) -> None:
        self.value = 1
        self._pending: tuple[torch.Tensor, torch.cuda.Event, int, int] | None = None
        self._host: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> LoadSpread:  # a copied layer (e.g. for a reference run) starts afresh
        return LoadSpread()

    def current(self, counts: torch.Tensor, rows: int) -> int:
        """The value to key this step's choices by; launches nothing on the GPU. counts: rows per expert [E] (any
        integer dtype, any device); rows: their sum, known on the host."""
        E = counts.numel()
        if E == 0:
            return self.value
        if not counts.is_cuda:
            self.value = spread_of(int(counts.max()), rows, E)
        elif self._pending is not None and not torch.cuda.is_current_stream_capturing() and self._pending[1].query():
            host, _, n, experts = self._pending
            self.value, self._pending = spread_of(int(host), n, experts), None
        return self.value

    def queue(self, counts: torch.Tensor, rows: int) -> None:
        """Queue these counts' busiest expert for a copy to the host, unless one is still in flight (CUDA only)."""
        E = counts.numel()
        if E == 0 or not counts.is_cuda or self._pending is not None or torch.cuda.is_current_stream_capturing():
            return
        if self._host is None:
            self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
        self._host.copy_(counts.max().to(torch.int64), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (self._host, event, rows, E)

    def observe(self, counts: torch.Tensor, rows: int) -> int:
        """`current`, then `queue`: the value for this step, and these counts queued for a later one."""
        value = self.current(counts, rows)
        self.queue(counts, rows)
        return value
