"""torch.distributed glue: the ranks' shares of the calibration data (:mod:`.partition`), the process group as
a :class:`qtransform.Parallel` whose statistics reduce by each observer's declared reduction (:mod:`.group`),
and the launch of the command under torchrun (:mod:`.launch`)."""

from .group import TorchParallel, current, to_cpu
from .partition import raw_tokens, share, share_bounds

__all__ = ["TorchParallel", "current", "to_cpu", "raw_tokens", "share", "share_bounds"]
