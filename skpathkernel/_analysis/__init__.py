"""What is read from a trained network and its path, beyond the public modules.

``_decomposition``: every prediction split over the training points, exactly;
``_attribution``: the output functions attribution scores explain (the margin);
``_unrolled``: counterfactual attribution, the path differentiated with respect to each
training point; ``_rank_gap``: the span of the tangent features from Gram matrices alone,
the rank-gap mathematics of :class:`~skpathkernel.OODRankDetector`. The public analyses
are :mod:`skpathkernel.kernels`, :mod:`skpathkernel.metrics`,
:mod:`skpathkernel.plotting` and :mod:`skpathkernel.diagnostics`.
"""
