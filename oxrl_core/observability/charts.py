"""Inline SVG charts for `oxrl report` (no plotting library, no script, no network): line charts with log
axes and bands, and the reward heatmap. Every label reaches the SVG escaped (`esc`).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------- SVG charts


def esc(text) -> str:
    """Text from a run directory as HTML (element text or a quoted attribute): every value the page shows
    goes through here, whatever its type (a step, a metric's name, a config value, a directory's name)."""
    return html.escape(str(text), quote=True)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


@dataclass
class Line:
    label: str
    color: str
    points: list[tuple[float, float]]  # (step, value), or (another x, value); NaN = non-finite
    dash: str = ""
    markers: bool = False
    band: list[tuple[float, float, float]] | None = None  # (step, low, high): e.g. mean ± std


W, H, ML, MR, MT, MB = 420, 230, 58, 12, 10, 34


def line_chart(lines: list[Line], ylog: bool = False, xlabel: str = "step") -> str:
    """Lines (and bands) on shared axes as an <svg>; a non-finite value is a red × at the top edge."""
    xs = [x for ln in lines for x, _ in ln.points]
    ys = [y for ln in lines for _, y in ln.points if math.isfinite(y)]
    ys += [v for ln in lines for _, lo, hi in ln.band or () for v in (lo, hi) if math.isfinite(v)]
    if ylog:
        ys = [y for y in ys if y > 0]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = (min(ys), max(ys)) if ys else ((1.0, 10.0) if ylog else (0.0, 1.0))  # no finite point: any axis
    tf = (lambda v: math.log10(v)) if ylog else (lambda v: v)
    y0, y1 = tf(y0), tf(y1)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - ML - MR, H - MT - MB

    def px(x: float) -> float:
        return ML + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return MT + (1 - (tf(y) - y0) / (y1 - y0)) * ph

    out = [f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    out.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>')
    yticks = [10**t for t in _ticks(y0, y1, 4)] if ylog else _ticks(y0, y1, 4)
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ML - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{_fmt(t)}</text>')
    for t in _ticks(x0, x1, 5):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT + ph}" y2="{MT + ph + 4}" stroke="#999"/>')
        out.append(f'<text x="{x:.1f}" y="{MT + ph + 15}" text-anchor="middle" font-size="10">{_fmt(t)}</text>')
    out.append(
        f'<text x="{ML + pw / 2}" y="{H - 4}" text-anchor="middle" font-size="10" fill="#555">{esc(xlabel)}</text>'
    )
    for ln in lines:
        if ln.band:
            pts = [(x, lo, hi) for x, lo, hi in ln.band if math.isfinite(lo) and math.isfinite(hi)]
            if ylog:
                pts = [(x, lo, hi) for x, lo, hi in pts if lo > 0]
            if pts:
                upper = " ".join(f"{px(x):.1f},{py(hi):.1f}" for x, _, hi in pts)
                lower = " ".join(f"{px(x):.1f},{py(lo):.1f}" for x, lo, _ in reversed(pts))
                out.append(f'<polygon points="{upper} {lower}" fill="{ln.color}" fill-opacity="0.15" stroke="none"/>')
    for ln in lines:
        segment: list[str] = []
        segments = [segment]
        for x, y in ln.points:
            if math.isfinite(y) and (not ylog or y > 0):
                segment.append(f"{px(x):.1f},{py(y):.1f}")
            else:
                segment = []
                segments.append(segment)
                out.append(
                    f'<text x="{px(x):.1f}" y="{MT + 10}" text-anchor="middle" font-size="12" fill="#d00" '
                    f'class="nonfinite"><title>{esc(ln.label)}: not finite at {esc(xlabel)} {x:g}</title>×</text>'
                )
        dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
        for seg in segments:
            if len(seg) > 1:
                out.append(
                    f'<polyline points="{" ".join(seg)}" fill="none" stroke="{ln.color}" stroke-width="1.6"{dash}/>'
                )
            if len(seg) == 1 or ln.markers:
                for p in seg:
                    cx, cy = p.split(",")
                    out.append(f'<circle cx="{cx}" cy="{cy}" r="2.6" fill="{ln.color}"/>')
    out.append("</svg>")
    return "".join(out)


def heatmap(columns: list[tuple[int, list[float]]]) -> str:
    """The distribution of values at each logged step: one column per step, one row per value bin, the
    cell's shade the share of samples in it (a reward with few distinct values gets one row per value)."""
    values = sorted({v for _, col in columns for v in col if v is not None and math.isfinite(v)})
    if not values:
        return ""
    if len(values) <= 12:
        bins = [(v, v) for v in values]
    else:
        lo, hi = values[0], values[-1]
        edges = [lo + (hi - lo) * i / 10 for i in range(11)]
        bins = list(zip(edges[:-1], edges[1:]))

    def which(v: float) -> int:
        for k, (a, b) in enumerate(bins):
            if (a == b and v == a) or (a <= v <= b if k == len(bins) - 1 else a <= v < b):
                return k
        return len(bins) - 1

    pw, ph = W - ML - MR, H - MT - MB
    cw, ch = pw / len(columns), ph / len(bins)
    out = [f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    for c, (step, col) in enumerate(columns):
        finite = [v for v in col if v is not None and math.isfinite(v)]
        counts = [0] * len(bins)
        for v in finite:
            counts[which(v)] += 1
        for k, count in enumerate(counts):
            share = count / len(finite) if finite else 0
            x, y = ML + c * cw, MT + (len(bins) - 1 - k) * ch
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw + 0.5:.1f}" height="{ch + 0.5:.1f}" '
                f'fill="rgb(31,119,180)" fill-opacity="{share:.3f}"><title>step {esc(step)}: {share:.0%} of '
                f"{len(finite)} samples in {_fmt(bins[k][0])}–{_fmt(bins[k][1])}</title></rect>"
            )
        if len(columns) <= 12 or c % max(1, len(columns) // 8) == 0:
            out.append(
                f'<text x="{ML + (c + 0.5) * cw:.1f}" y="{MT + ph + 15}" text-anchor="middle" font-size="10">{esc(step)}</text>'
            )
    for k, (a, b) in enumerate(bins):
        label = _fmt(a) if a == b else f"{_fmt(a)}–{_fmt(b)}"
        y = MT + (len(bins) - 1 - k + 0.5) * ch + 4
        if len(bins) <= 12:
            out.append(f'<text x="{ML - 4}" y="{y:.1f}" text-anchor="end" font-size="10">{label}</text>')
    out.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 4}" text-anchor="middle" font-size="10" fill="#555">step</text>')
    out.append("</svg>")
    return "".join(out)
