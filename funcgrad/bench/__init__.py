"""funcgrad's benchmark suite: ``python -m funcgrad.bench [--quick] [--plot]``.

Every figure is a ratio between methods timed side by side, interleaved, in one run.
"""
