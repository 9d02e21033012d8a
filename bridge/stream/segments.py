"""The parts of a model's facts that concern one part of it (a decoder block, or the tensors outside the
blocks): what a streamed run hands the recipe's steps when it runs them on that part alone."""

from __future__ import annotations

from qtransform.rotation import ResidualLayout

__all__ = ["restrict_layout"]


def restrict_layout(layout: ResidualLayout, paths: set) -> ResidualLayout:
    """The part of ``layout`` whose tensors are among ``paths``: the embeddings, the norms (with their
    readers), the writers, the head pairs, the down projections and the attention modules there."""
    return ResidualLayout(
        embeddings=tuple(e for e in layout.embeddings if e in paths),
        norms=tuple(n for n in layout.norms if n.weight in paths),
        writers=tuple(w for w in layout.writers if w in paths),
        heads=tuple(h for h in layout.heads if h.v in paths and h.o in paths),
        down=tuple(d for d in layout.down if d in paths),
        attention=tuple(a for a in layout.attention if any(p.startswith(a.module + ".") for p in paths)))
