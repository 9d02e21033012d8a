"""Graph preparation for models that are not language models: BatchNorm folding (``fold_batchnorm``, the
pairs it folds found by ``find_pairs``: a ``torch.fx`` graph where the model traces, ``nn.Sequential``
adjacency where it does not)."""

from .pairs import NORMS, PRODUCERS, Pairs, find_pairs
from .fold_bn import BatchNormFolding, fold_batchnorm

__all__ = ["fold_batchnorm", "BatchNormFolding", "find_pairs", "Pairs", "PRODUCERS", "NORMS"]
