"""Imported last by test_distributed's forkserver, after its other preloads: moves every
object the server holds (the preloaded modules') to the garbage collector's permanent
generation, so that a rank's ``gc.collect()`` (in ``_destroy_process_group``) visits only
what the rank created. Objects created in a rank are collected as before.

Only where ``_SKPATHKERNEL_FORKSERVER`` is set, as test_distributed sets it for the server
alone: ``pytest --doctest-modules tests`` imports this file in the test processes too,
whose objects must stay collectable."""

import gc
import os

if os.environ.get("_SKPATHKERNEL_FORKSERVER") == "1":
    gc.freeze()
