"""Striping over NICs, measured: one large tcp put from host T to host R over one shaped link,
then over two (each side listening on both NICs), in the same run on the same fabric
(:mod:`tests._support.netns`), and the ratio of the two rates. ``python -m benchmarks.striping``;
needs root (network namespaces)."""
