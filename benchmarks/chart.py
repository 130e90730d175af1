"""A dependency-free SVG bar chart for the benchmark page (median bars with min-max whiskers).

One panel per state, one horizontal bar per method, each panel on its own time scale (a 1 GiB
save and a 4 KiB-tensor load differ by orders of magnitude). Colours mark the family of a row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

WIDTH = 900  # px; fits the docs theme's content column
LABEL_WIDTH = 290  # px reserved for method names left of the bars
ROW_HEIGHT = 18
PANEL_GAP = 34  # room for the panel title
MAX_TICKS = 6  # grid lines per panel, at most
# Family (first word of a row's group) -> fill colour.
COLOURS = {"raw": "#9e9e9e", "burnpack": "#e65100", "records": "#f9a825", "peer": "#1565c0"}


@dataclass(frozen=True)
class Bar:
    """One row: label, family (a :data:`COLOURS` key), median and range in seconds."""

    label: str
    family: str
    median: float
    low: float
    high: float


def _ticks(limit: float) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) from 0 to ``limit``."""
    base = 10 ** math.floor(math.log10(limit))
    step = next(base * f for f in (0.1, 0.2, 0.5, 1.0, 2.0, 5.0) if limit / (base * f) <= MAX_TICKS)
    return [i * step for i in range(int(limit / step) + 1)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def render(panels: Sequence[tuple[str, Sequence[Bar]]]) -> str:
    """SVG text for ``[(panel title, bars), ...]``."""
    plot_width = WIDTH - LABEL_WIDTH - 70
    parts: list[str] = []
    y = 0
    for title, bars in panels:
        y += PANEL_GAP
        parts.append(f'<text x="4" y="{y - 12}" font-weight="bold">{escape(title)}</text>')
        limit = max(b.high for b in bars) * 1.05 or 1.0
        scale = plot_width / limit
        grid: list[str] = []
        rows: list[str] = []
        top = y
        for bar in bars:
            width = max(bar.median * scale, 1)
            colour = COLOURS.get(bar.family, "#616161")
            mid = y + ROW_HEIGHT / 2
            rows.append(
                f'<text x="{LABEL_WIDTH - 6}" y="{mid + 4}" text-anchor="end">'
                f"{escape(bar.label)}</text>"
                f'<rect x="{LABEL_WIDTH}" y="{y + 2}" width="{width:.1f}" '
                f'height="{ROW_HEIGHT - 4}" fill="{colour}"/>'
                f'<line x1="{LABEL_WIDTH + bar.low * scale:.1f}" y1="{mid}" '
                f'x2="{LABEL_WIDTH + bar.high * scale:.1f}" y2="{mid}" stroke="#212121"/>'
                f'<text x="{LABEL_WIDTH + bar.high * scale + 4:.1f}" y="{mid + 4}" '
                f'font-size="10">{_ms(bar.median)}</text>'
            )
            y += ROW_HEIGHT
        for tick in _ticks(limit):
            x = LABEL_WIDTH + tick * scale
            grid.append(
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y}" stroke="#e0e0e0"/>'
                f'<text x="{x:.1f}" y="{y + 12}" font-size="9" text-anchor="middle">'
                f"{_ms(tick) if tick else '0'}</text>"
            )
        parts += grid + rows  # grid lines behind the bars
        y += 14
    legend = " ".join(
        f'<rect x="{LABEL_WIDTH + i * 110}" y="{y + 8}" width="10" height="10" fill="{c}"/>'
        f'<text x="{LABEL_WIDTH + i * 110 + 14}" y="{y + 17}">{escape(name)}</text>'
        for i, (name, c) in enumerate(COLOURS.items())
    )
    height = y + 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">'
        f'<rect width="100%" height="100%" fill="white"/>{"".join(parts)}{legend}</svg>\n'
    )
