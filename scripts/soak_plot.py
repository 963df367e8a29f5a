"""Draws a soak run's resource curves as one SVG (no plotting library needed).

``python scripts/soak_plot.py LOG_DIR/resources.csv OUT.svg`` reads the samples
``scripts/soak_resources.py`` wrote (``role,t_s,pids,rss_kib,fds,threads``) and draws
three panels against minutes: RSS (MiB), open file descriptors and threads, one line per
role and incarnation (a restarted replica starts a new line: its pids changed).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

PANELS = (("rss_kib", "RSS (MiB)", 1 / 1024), ("fds", "open fds", 1), ("threads", "threads", 1))
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
WIDTH, PANEL_H, MARGIN, LEFT = 900, 220, 30, 70


def read_lines(path: Path) -> dict[str, list[list[tuple[float, dict]]]]:
    """role -> incarnations -> [(minute, row)], in file order."""
    roles: dict[str, list[list[tuple[float, dict]]]] = {}
    last_pids: dict[str, str] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            role = row["role"]
            if last_pids.get(role) != row["pids"]:
                roles.setdefault(role, []).append([])
                last_pids[role] = row["pids"]
            roles[role][-1].append((float(row["t_s"]) / 60, row))
    return roles


def _panel(roles, key: str, title: str, scale: float, top: float, minutes: float) -> list[str]:
    values = [float(r[key]) * scale for lines in roles.values() for line in lines for _, r in line]
    high = max(values) * 1.05 or 1.0
    plot_w, plot_h = WIDTH - LEFT - MARGIN, PANEL_H - 2 * MARGIN
    out = [
        f'<text x="{LEFT}" y="{top + 18}" font-size="14">{title}</text>',
        f'<rect x="{LEFT}" y="{top + MARGIN}" width="{plot_w}" height="{plot_h}" '
        'fill="none" stroke="#888"/>',
        f'<text x="{LEFT - 6}" y="{top + MARGIN + 4}" font-size="11" text-anchor="end">'
        f"{high:,.0f}</text>",
        f'<text x="{LEFT - 6}" y="{top + MARGIN + plot_h}" font-size="11" '
        'text-anchor="end">0</text>',
    ]
    for i, lines in enumerate(roles.values()):
        color = COLORS[i % len(COLORS)]
        for line in lines:
            points = " ".join(
                f"{LEFT + plot_w * t / minutes:.1f},"
                f"{top + MARGIN + plot_h * (1 - float(r[key]) * scale / high):.1f}"
                for t, r in line
            )
            out.append(f'<polyline points="{points}" fill="none" stroke="{color}"/>')
    return out


def svg(roles: dict, title: str) -> str:
    minutes = max(t for lines in roles.values() for line in lines for t, _ in line) or 1.0
    height = PANEL_H * len(PANELS) + 60
    body = [f'<text x="{LEFT}" y="20" font-size="16">{title}</text>']
    for i, (key, label, scale) in enumerate(PANELS):
        body += _panel(roles, key, label, scale, 30 + i * PANEL_H, minutes)
    bottom = 30 + len(PANELS) * PANEL_H
    body.append(
        f'<text x="{WIDTH - MARGIN}" y="{bottom - 8}" font-size="11" text-anchor="end">'
        f"minutes (0 - {minutes:.0f})</text>"
    )
    for i, role in enumerate(roles):
        color = COLORS[i % len(COLORS)]
        body.append(
            f'<text x="{LEFT + 150 * i}" y="{bottom + 20}" font-size="12" fill="{color}">'
            f"{role}</text>"
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", type=Path, help="resources.csv of a soak run")
    p.add_argument("out", type=Path, help="the SVG to write")
    p.add_argument("--title", default="soak: resources per process")
    args = p.parse_args()
    args.out.write_text(svg(read_lines(args.csv), args.title))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
