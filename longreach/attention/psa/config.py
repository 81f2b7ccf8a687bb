"""PSA's config and presets (the method and its decisions: method.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ...kernels.key_boxes import BOX_KINDS

DECODE_KERNELS = ("loop", "waves")  # kernels/psa_{decode,waves}.py: same results (method.py: KERNELS)


@dataclass(frozen=True)
class PSAConfig:
    epsilon: float = 0.95  # stop once the estimated attended share of the attention mass is >= epsilon
    microbatch: int = 4  # m: ranked blocks attended per iteration (a power of two; m x block_size >= 16)
    metadata: str = "cuboid-mean"  # block metadata: cuboid-mean (ArkVale's, the paper's) or minmax (Quest's bound)
    n_sink: int = 64  # first tokens always read (rounded up to whole blocks)
    n_window: int = 128  # last tokens always read (>= 1; extended down to a block boundary)
    block_size: int | None = None  # tokens per block = the KV page; None: the engine's --block-size (must match)
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely
    # CUDA decode kernel: waves (ranked blocks read in parallel waves) or loop (one program per KV head walks them);
    # same reads and outputs (fp32 rounding). waves by default: on flat attention, where a query reads most blocks,
    # the loop's H_kv programs are serial (8B shape at 128K, H100: 4.8 tok/s with loop, 44.2 with waves)
    decode_kernel: str = "waves"
    # positions: "none" (the paper's: true positions) or "rank" (past rope_from, attend at rank-order positions
    # within the trained distance and rank by keys moved to a fixed distance; module docstring)
    rope: str = "none"
    rope_from: int | None = None  # rows at or past this position move (rope "rank"); None: the trained length
    # meter the keys each decode query reads (PSABackend.decode_reads; eval passkey and bench decode report it):
    # a few device ops per layer and step, so off unless asked for
    count_reads: bool = False

    def __post_init__(self) -> None:
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < eps <= 1.0:
            raise ValueError(f"epsilon must be a number in (0, 1], the share of the attention mass a query reads "
                             f"before it stops (presets 0.9, 0.95, 0.98; 1 = dense), got {eps!r}")
        m = self.microbatch
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m > 64 or m & (m - 1):
            raise ValueError(f"microbatch must be a power of two in [1, 64] (blocks per iteration), got {m!r}")
        if self.metadata not in BOX_KINDS:
            raise ValueError(f"metadata must be one of {', '.join(BOX_KINDS)}, got {self.metadata!r}")
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")
        if isinstance(self.n_window, bool) or not isinstance(self.n_window, int) or self.n_window < 1:
            raise ValueError(f"n_window must be an integer >= 1 (a query always reads itself), got {self.n_window!r}")
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1)):
            raise ValueError(f"block_size must be None (the engine's --block-size) or a power of two, got {b!r}")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers}")
        if not isinstance(self.decode_kernel, str) or self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        if not isinstance(self.count_reads, bool):
            raise ValueError(f"count_reads must be true or false, got {self.count_reads!r}")
        if self.rope not in ("none", "rank"):
            raise ValueError(f"rope must be 'none' (true positions) or 'rank' (rank-order positions past rope_from), "
                             f"got {self.rope!r}")
        r = self.rope_from
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"rope_from must be None (the model's trained length) or an integer >= 1, got {r!r}")


PRESETS = {"0.9": PSAConfig(epsilon=0.9), "0.95": PSAConfig(epsilon=0.95), "0.98": PSAConfig(epsilon=0.98)}
DEFAULT_PRESET = "0.95"

PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "0.95": "read pages until 95% of the estimated attention mass (default)",
    "0.9": "stop at 90% of the mass: fewer keys, less exact",
    "0.98": "stop at 98% of the mass: more keys, closer to dense",
}
