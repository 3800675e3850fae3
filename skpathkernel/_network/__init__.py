"""The fitted network and its inputs.

``_trained``: :class:`~skpathkernel.TrainedNetwork`, the module with its recorded path,
the object every read-only verb runs on, and :func:`network_of`, which finds it in an
estimator, a recorded network or a network itself. ``_inputs``: what ``X`` may be (2-D
features, N-D arrays, token ids) and how it is checked against what the network was fitted
on.
"""
