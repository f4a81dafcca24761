"""The what-if planner's links: a collective's time from a calibration's α-β fits (``calibration.fit_alpha_beta``),
and what it borrows where the calibration did not measure that op, group size or message size
(docs/formulas.md, "What-if planner"). ``planner`` predicts with them; the textbook model uses the nominal figures."""

from __future__ import annotations

import math

from meshscope.dashboard.analysis import busbw_factor
from meshscope.dashboard.planner.calibration import Calibration

# Nominal bus bandwidths of the textbook model (bytes/s): NVLink 4 per direction on an H100 SXM; on CPU a
# loopback figure for gloo's TCP transport. Nothing here is measured: that is the point of the comparison.
NOMINAL_BUS_BW = {"cuda": 450e9, "cpu": 10e9}


class Links:
    """Op times from the calibration's fits, noting what had to be borrowed."""

    def __init__(self, cal: Calibration, notes: list[str], *, shared: bool = False) -> None:
        self.device, self.notes = cal.device, notes
        # A pipeline's point-to-point transfers: the machine's links where no collective was measured.
        hop_s, values = cal.pipeline.get("hop_s", math.nan), cal.pipeline.get("hop_values", math.nan)
        self.p2p_bw = values * act_bytes(cal) / hop_s if hop_s > 0 and values > 0 else math.nan
        same = cal.links[cal.links["shared"] == shared] if len(cal.links) else cal.links
        self.fits = same if len(same) else cal.links
        if len(cal.links) and not len(same):
            note(notes, f"links measured only {'with' if not shared else 'without'} ranks sharing cores", "links")

    def time(self, op: str, n: int, nbytes: float) -> float:
        """α + bytes·f(op, n)/β of the fit for (op, n) when its measured sizes cover ``nbytes`` (within 4×);
        else the bandwidth of the nearest fit that does (the same op at another group size, another op at
        this one, then any), with this fit's latency where it measured small messages; noted."""
        if n <= 1:
            return 0.0
        f = self.fits
        if f.empty:
            if self.p2p_bw > 0:
                self._note(f"{op} over {n} ranks: no collective measured, the pipeline's transfers' bandwidth")
                return nbytes * busbw_factor(op, n) / self.p2p_bw
            self._note(f"{op} over {n} ranks: no collective measured, nominal bandwidth")
            return nbytes * busbw_factor(op, n) / NOMINAL_BUS_BW.get(self.device, NOMINAL_BUS_BW["cpu"])
        covers = (f["bytes_min"] / 4 <= nbytes) & (nbytes <= 4 * f["bytes_max"])
        exact = f[(f["op"] == op) & (f["group_size"] == n)]
        if len(exact) and bool(covers[exact.index[0]]):
            return self._t(exact.iloc[0], op, n, nbytes, alpha=None)
        if op == "all_reduce":  # a ring all-reduce is a reduce-scatter then an all-gather of the same buffer
            parts = [f[covers & (f["op"] == o) & (f["group_size"] == n)] for o in ("reduce_scatter", "all_gather")]
            if all(len(x) for x in parts):
                self._note(f"all_reduce over {n} ranks at {_mb(nbytes)}: a reduce-scatter and an all-gather as measured")
                return sum(self._t(x.iloc[0], x.iloc[0]["op"], n, nbytes, alpha=None) for x in parts)
        for pool in (f[covers & (f["op"] == op)], f[covers & (f["group_size"] == n)], f[covers]):
            if len(pool):
                row = pool.iloc[(pool["group_size"] - n).abs().argsort().iloc[0]]
                break
        else:  # nothing measured this size: the bandwidth of the largest messages measured, this op's first
            same = f[f["op"] == op]
            pool = same if len(same) and same["bytes_max"].max() >= 65536 else f
            row = pool.loc[pool["bytes_max"].idxmax()]
        if len(exact) and exact.iloc[0]["bytes_min"] <= 65536:
            alpha = float(exact.iloc[0]["alpha_s"])
        else:
            alpha = None
        self._note(f"{op} over {n} ranks at {_mb(nbytes)}: bandwidth from {row['op']} over {int(row['group_size'])} "
                   f"ranks ({_mb(row['bytes_min'])}–{_mb(row['bytes_max'])} measured)")
        x, x_min = nbytes * busbw_factor(op, n), row["bytes_min"] * busbw_factor(row["op"], int(row["group_size"]))
        if alpha is None and 0 < x < x_min:
            # Below the smallest message the fit saw, its α is not a latency it measured (ranks sharing cores
            # give flat times: α is then the wait for a peer to be scheduled): the throughput it reached there.
            return self._t(row, row["op"], int(row["group_size"]), row["bytes_min"], alpha=None) * x / x_min
        return self._t(row, op, n, nbytes, alpha=alpha)

    @staticmethod
    def _t(row, op: str, n: int, nbytes: float, *, alpha: float | None) -> float:
        beta = row["beta_bytes_per_s"]
        a = row["alpha_s"] if alpha is None else alpha
        return float(a + (nbytes * busbw_factor(op, n) / beta if beta > 0 else 0.0))

    def _note(self, text: str) -> None:
        note(self.notes, text)


def _mb(x: float) -> str:
    return f"{x / 2**20:.2g} MiB"


def act_bytes(cal: Calibration) -> int:
    """Bytes per activation value: 2 in 16-bit training, 4 in fp32."""
    return 2 if cal.dtype.lower() in ("bfloat16", "bf16", "float16", "fp16", "torch.bfloat16", "torch.float16") else 4


class Notes(list):
    """What a prediction took from something its calibration did not measure: the sentences in order, and
    the kinds of extrapolation each one is (``kinds``: sentence -> kinds, ``dashboard.planner.interval``'s
    ``SPREAD`` keys), which widen the prediction's interval."""

    def __init__(self, items: "Notes | list[str]" = ()) -> None:
        super().__init__(items)
        self.kinds: dict[str, tuple[str, ...]] = dict(getattr(items, "kinds", {}))

    def all_kinds(self) -> tuple[str, ...]:
        return tuple(sorted({k for t in self for k in self.kinds.get(t, ())}))


def note(notes: list[str], text: str, *kinds: str) -> None:
    """Add ``text`` once, of ``kinds`` (default: borrowed links)."""
    if text not in notes:
        notes.append(text)
    if isinstance(notes, Notes):
        notes.kinds[text] = kinds or ("links",)
