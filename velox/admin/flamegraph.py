"""A flamegraph as a standalone SVG image, drawn from a pyinstrument frame tree.

Classic layout: the root at the bottom, each call drawn above its caller, widths in proportion
to the time spent in it (children included), siblings ordered by time, largest first. Each box
is coloured by its module (Velox's own modules in warm colours, the standard library and
third-party packages in cool ones, so the gateway's own code stands out) and carries a
`<title>` with its full name, location and time, which browsers show on hover. Boxes
narrower than `MIN_WIDTH_PX` are left out with their callees, as flamegraph tools do.

Only the frame tree's public attributes are used (`time`, `children`, `function`,
`class_name`, `file_path_short`, `line_no`, `is_synthetic`).
"""

from __future__ import annotations

import zlib
from typing import Any
from xml.sax.saxutils import escape, quoteattr

WIDTH_PX = 1200
FRAME_PX = 16
MIN_WIDTH_PX = 0.1
_TOP_PX = 58  # title, subtitle and legend
_PAD_PX = 10
_CHAR_PX = 7.0  # average width of one 11px monospace character
_FONT = "font-family:Menlo,Consolas,'DejaVu Sans Mono',monospace;font-size:11px"


def module_of(frame: Any) -> str:
    """The module a frame belongs to, as shown in the legend: a path without '.py'."""
    path = frame.file_path_short or ""
    if not path or path.startswith("<"):
        return "<built-in>"
    path = path.replace("\\", "/")
    if "site-packages/" in path:
        path = path.rsplit("site-packages/", 1)[1]
    elif "/velox/" in path:  # a checkout (editable install): its directory is no module name
        path = "velox/" + path.rsplit("/velox/", 1)[1]
    return path[:-3] if path.endswith(".py") else path


def colour(module: str) -> str:
    h = zlib.crc32(module.encode())
    if module.startswith(("velox/", "velox.")):
        hue, sat, light = (h % 50), 70 + h % 20, 55 + (h >> 8) % 12  # reds to yellows
    elif module == "<built-in>":
        hue, sat, light = 95, 25, 62  # grey-green
    else:
        hue, sat, light = 190 + h % 60, 45 + h % 20, 58 + (h >> 8) % 12  # blues
    return f"hsl({hue},{sat}%,{light}%)"


def _name(frame: Any) -> str:
    cls = frame.class_name
    return f"{cls}.{frame.function}" if cls else str(frame.function)


def _label(frame: Any) -> str:
    where = frame.file_path_short or ""
    if frame.line_no:
        where = f"{where}:{frame.line_no}"
    return f"{_name(frame)} ({where})" if where else _name(frame)


def _layout(root: Any, total: float, scale: float) -> tuple[list[tuple[Any, float, float, int]],
                                                             int, dict[str, float]]:
    """(frame, x, width, depth) for every box wide enough, the depth, and time per module."""
    boxes: list[tuple[Any, float, float, int]] = []
    by_module: dict[str, float] = {}
    depth_max = 0
    stack: list[tuple[Any, float, int]] = [(root, 0.0, 0)]
    while stack:
        frame, x, depth = stack.pop()
        width = frame.time * scale
        if width < MIN_WIDTH_PX:
            continue
        boxes.append((frame, x, width, depth))
        depth_max = max(depth_max, depth)
        module = module_of(frame)
        self_time = frame.time - sum(c.time for c in frame.children if not c.is_synthetic)
        by_module[module] = by_module.get(module, 0.0) + max(0.0, self_time)
        child_x = x
        for child in sorted(frame.children, key=lambda c: -c.time):
            if child.is_synthetic:  # [self], [await]: time already shown as the parent's own
                child_x += child.time * scale
                continue
            stack.append((child, child_x, depth + 1))
            child_x += child.time * scale
    return boxes, depth_max + 1, by_module


def flamegraph_svg(root: Any | None, title: str = "CPU profile", subtitle: str = "") -> str:
    """The SVG document for the tree under `root` (None: an image saying there were no samples)."""
    total = root.time if root is not None else 0.0
    if root is None or total <= 0:
        return _document(WIDTH_PX, _TOP_PX + 40, title, subtitle or "no samples were taken", [],
                         [])
    inner = WIDTH_PX - 2 * _PAD_PX
    boxes, depth, by_module = _layout(root, total, inner / total)
    height = _TOP_PX + depth * FRAME_PX + _PAD_PX
    body: list[str] = []
    for frame, x, width, level in boxes:
        module = module_of(frame)
        y = height - _PAD_PX - (level + 1) * FRAME_PX
        tip = f"{_label(frame)}: {frame.time * 1000:.1f} ms, {frame.time / total * 100:.2f}%"
        body.append(
            f'<g><title>{escape(tip)}</title>'
            f'<rect x="{_PAD_PX + x:.2f}" y="{y}" width="{width:.2f}" height="{FRAME_PX - 1}" '
            f'rx="2" fill="{colour(module)}"/>'
        )
        chars = int((width - 6) / _CHAR_PX)
        if chars >= 3:
            name = _name(frame)
            if len(name) > chars:
                name = name[:chars - 1] + "…"
            body.append(f'<text x="{_PAD_PX + x + 3:.2f}" y="{y + FRAME_PX - 4}">'
                        f'{escape(name)}</text>')
        body.append("</g>")
    top = sorted(by_module.items(), key=lambda kv: -kv[1])[:8]
    legend = [(module, share / total) for module, share in top]
    return _document(WIDTH_PX, height, title, subtitle, body, legend)


def _document(width: int, height: int, title: str, subtitle: str, body: list[str],
              legend: list[tuple[str, float]]) -> str:
    head = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<style>text{{{_FONT};fill:#1b1b1b;pointer-events:none}} '
        'rect{stroke:#fff;stroke-width:0.5} g:hover rect{stroke:#000;stroke-width:1}</style>',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fbfbf8"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle" '
        f'style="font-size:15px;font-weight:bold">{escape(title)}</text>',
        f'<text x="{width / 2}" y="34" text-anchor="middle">{escape(subtitle)}</text>',
    ]
    x = _PAD_PX
    for module, share in legend:
        label = f"{module} {share * 100:.0f}%"
        fill = quoteattr(colour(module))
        head.append(f'<rect x="{x}" y="41" width="10" height="10" fill={fill}/>'
                    f'<text x="{x + 14}" y="50">{escape(label)}</text>')
        x += 22 + int(len(label) * _CHAR_PX)
        if x > width - 150:
            break
    return "\n".join([*head, *body, "</svg>", ""])
