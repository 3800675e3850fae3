"""skpathkernel: a trained neural network as a kernel machine, as scikit-learn estimators.

A network trained by gradient descent is a kernel machine over its training set along its
optimisation path (Domingos 2020; Guo, He & Morel 2026). skpathkernel trains PyTorch
networks behind scikit-learn estimators, records that path, and exposes its tangent
features, tangent and path kernels, and the per-training-point decomposition of every
prediction.
"""

from ._analysis._unrolled import AttributionScores, PrecisionWarning, UnstablePathWarning
from ._estimators._features import TangentFeatures, TangentFeatureSVM
from ._estimators._machine import PathKernelClassifier, PathKernelMachine
from ._estimators._ood import OODRankDetector
from ._network._trained import TrainedNetwork
from ._path._recorder import PathRecorder, RecordedNetwork
from ._path._training import DivergenceWarning, TrainingDivergedError
from ._path._trajectory import Trajectory
from ._version import __version__
from ._warnings import InconsistentVersionWarning
from .kernels import PathKernel, TangentKernel

__all__ = [
    "AttributionScores",
    "DivergenceWarning",
    "InconsistentVersionWarning",
    "OODRankDetector",
    "PathKernel",
    "PathKernelClassifier",
    "PathKernelMachine",
    "PathRecorder",
    "PrecisionWarning",
    "RecordedNetwork",
    "TangentFeatureSVM",
    "TangentFeatures",
    "TangentKernel",
    "TrainedNetwork",
    "Trajectory",
    "TrainingDivergedError",
    "UnstablePathWarning",
    "__version__",
]
