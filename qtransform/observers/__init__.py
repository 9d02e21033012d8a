"""Observers: statistics as pure, mergeable folds, registered by name (see :mod:`.base`).

Built-ins: ``minmax`` (default), ``percentile``, ``mse`` (ranges for quantization parameters),
``hessian`` (``XᵀX`` for GPTQ) and ``channel`` (per-channel magnitudes for SmoothQuant/AWQ).
"""

from .base import (OBSERVERS, REDUCTIONS, Observer, finalize_stats, init_stats, is_empty, make_observer,
                   merge_stats, observe, register_observer)
from .minmax import MinMax, MinMaxStats
from .histogram import HistogramObserver, HistogramStats
from .percentile import Percentile
from .mse import MSE
from .hessian import Hessian, HessianStats
from .channel import Channel, ChannelStats, ChannelSummary
from .qparams import choose_qparams, compute_qparams

__all__ = ["OBSERVERS", "REDUCTIONS", "Observer", "register_observer", "make_observer", "init_stats", "observe",
           "merge_stats", "finalize_stats", "is_empty", "MinMax", "MinMaxStats", "HistogramObserver",
           "HistogramStats", "Percentile", "MSE", "Hessian", "HessianStats", "Channel", "ChannelStats",
           "ChannelSummary", "choose_qparams", "compute_qparams"]
