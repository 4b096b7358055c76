"""funcgrad's benchmark suite: ``python -m funcgrad.bench [--quick] [--plot]``.

Every figure is a ratio between methods timed side by side, interleaved, in one run.
:mod:`funcgrad.bench.ranks` (local gloo ranks) and :mod:`funcgrad.bench.models` (small
real-stack models) are public: the tests use them too.
"""
