"""An offline stand-in for ``graphviz.Digraph`` (the Python package and Graphviz's ``dot`` are not
installed here; a script's ``import graphviz`` is pointed at it): it records the nodes and edges NNI's DARTS tutorial draws, and ``pipe()`` renders
them as a plain PNG listing the edges (drawn with Pillow), so the tutorial's plotting code runs."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["Digraph"]


class Digraph:
    def __init__(self, name: str | None = None, node_attr: dict[str, Any] | None = None, format: str = "png",
                 **_: Any) -> None:
        self.name, self.node_attr, self.format = name, dict(node_attr or {}), format
        self.body: list[str] = []
        self.nodes: list[str] = []
        self.edges: list[tuple[str, str, str | None]] = []

    def node(self, name: str, label: str | None = None, **attrs: Any) -> None:
        self.nodes.append(name)

    def edge(self, tail: str, head: str, label: str | None = None, **attrs: Any) -> None:
        if tail not in self.nodes or head not in self.nodes:
            raise ValueError(f"edge {tail} -> {head} between nodes the graph does not have")
        self.edges.append((tail, head, label))

    def attr(self, kw: str | None = None, **attrs: Any) -> None:
        self.graph_attr = {**getattr(self, "graph_attr", {}), **attrs}

    def pipe(self, format: str | None = None, **_: Any) -> bytes:
        from PIL import Image, ImageDraw

        lines = [f"{t} -> {h}" + (f" [{lab}]" if lab else "") for t, h, lab in self.edges]
        image = Image.new("RGB", (320, 14 * len(lines) + 8), "white")
        draw = ImageDraw.Draw(image)
        for i, line in enumerate(lines):
            draw.text((4, 4 + 14 * i), line, fill="black")
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
