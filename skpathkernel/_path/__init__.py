"""The optimisation path: training that records it, and its storage.

``_training``: the loop over torch.optim's own update functions (``_optim``) and the
default MLP's hand-written gradient (``_mlp_step``); ``_losses``: the per-sample losses
it minimises; ``_trajectory``: :class:`~skpathkernel.Trajectory`, the recorded
parameters, step sizes, batches and optimizer state; ``_storage``: its per-point vectors
in chunk files on disk; ``_recorder``: :class:`~skpathkernel.PathRecorder`, recording a
training loop of your own, and :class:`~skpathkernel.RecordedNetwork`.
"""
