"""The scikit-learn estimators.

``_base``: what the network trainers share (validation, building the module, ``fit``
recording the path); ``_params``: their training parameters, declared once; ``_machine``:
the trainers, :class:`~skpathkernel.PathKernelMachine` and
:class:`~skpathkernel.PathKernelClassifier`; ``_meta``: what the meta-estimators share (a
trainer passed as ``estimator=``); ``_features``: :class:`~skpathkernel.TangentFeatures`
and :class:`~skpathkernel.TangentFeatureSVM`; ``_ood``:
:class:`~skpathkernel.OODRankDetector`.
"""
